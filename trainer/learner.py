"""The learner: a causal LM, its optimiser, and one policy-gradient step on a batch, on any device.

    prepare(batch)   on the CPU (in the prefetch thread): cut into micro-batches by token
                     budget, pin, copy to the device without blocking
    step(prepared)   per micro-batch, under autocast: the model's logprobs -> the loss weighted
                     by the micro-batch's share of tokens -> backward; then clip, optimiser step

Weights and AdamW state stay float32 on the device (bf16 autocast on a GPU computes the passes;
`trainer.device`). Packed rows get per-sample attention (`trainer.attention`).

Memory per token (what lets a 64 k-token sample train on one GPU):

    logprobs="chunked"       the model's last hidden states through the output layer in chunks,
                             only at the tokens the loss trains on, the logits recomputed in the
                             backward (`trainer.logprobs`): no [tokens, vocab] tensor. "liger":
                             the same by Liger-Kernel's fused kernels (a GPU, the package).
                             "full": the model's logits and a log_softmax (the reference).
    gradient_checkpointing   each decoder layer's activations recomputed in the backward instead
                             of kept (`trainer.activations`): checkpoint_mode "full" keeps a
                             layer's input per token (~1/3 more compute); "selective" keeps its
                             matmuls' and attention's outputs too and recomputes only the
                             element-wise ops between them; checkpoint_layers: only that many
                             layers, spread over the depth (a dial between memory and time).
    micro_token_budget       rows per forward pass by padded tokens (`trainer.microbatch`); a
                             row longer than the budget goes alone, never cut.

pi_old: with one update per batch, pi_old is the policy being trained at the moment of the
update, so its logprobs are the current ones, detached (ratio exactly 1): no second forward
pass is needed. With several updates per batch (PPO epochs), pi_old is computed once, without
gradients, before the first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from trajstore.trainer import activations, attention, microbatch, routing
from trajstore.trainer.device import autocast, default_autocast, resolve_device, to_device
from trajstore.trainer.distill import DistillConfig, with_distillation
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    needed_positions,
    predict_positions,
    row_logprobs,
)
from trajstore.trainer.loss import LossConfig, policy_loss_terms, token_logprobs
from trajstore.trainer.vision import MULTI_MODAL_INPUTS, VisionProcessor, model_inputs

#: How `Learner.logprobs` computes the logprobs (see the module docstring).
LOGPROBS = ("chunked", "full", "liger")


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's knobs; the defaults train the tiny model on a CPU in seconds."""

    device: str = "auto"  #: auto | cuda | cpu
    autocast: bool | None = None  #: bf16 autocast; None: on for a GPU, off on the CPU
    attention: str = "sdpa"  #: sdpa | flex: how packed rows attend per sample
    micro_token_budget: int | None = None  #: padded tokens per forward pass (None: whole batch)
    logprobs: str = "chunked"  #: chunked | full | liger (a GPU): the output layer's logprobs
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS  #: tokens per chunk of the output layer
    gradient_checkpointing: bool = False  #: recompute each layer's activations in the backward
    checkpoint_mode: str = "full"  #: full | selective: what a checkpointed layer keeps
    checkpoint_layers: int | None = None  #: how many decoder layers are checkpointed (None: all)
    pad_multiple: int = 1  #: rows cut to a multiple of this (fewer shapes for a GPU's kernels)
    lr: float = 3e-3  #: AdamW learning rate
    max_grad_norm: float = 1.0
    updates_per_batch: int = 1  #: PPO epochs on one batch (> 1: the clip starts to matter)
    #: False: no importance weight (w = 1), the samples trained as if pi_old had generated them
    #: (what "TIS off" means in `benchmarks/learning.py`)
    importance_weights: bool = True
    loss: LossConfig = field(default_factory=LossConfig)
    #: On-policy distillation from a teacher's logprobs (`trainer.distill`); None: GRPO alone.
    distill: DistillConfig | None = None

    @property
    def teacher(self) -> str | None:
        """The teacher whose scores batches must carry (`distill`'s); None when not distilling."""
        return self.distill.teacher if self.distill is not None else None

    def __post_init__(self) -> None:
        if self.logprobs not in LOGPROBS:
            raise TrainerError(
                f"unknown logprobs {self.logprobs!r}: use one of {', '.join(LOGPROBS)}"
            )
        activations.check_mode(self.checkpoint_mode)
        if self.checkpoint_layers is not None and (
            self.checkpoint_layers < 0 or not self.gradient_checkpointing
        ):
            raise TrainerError(
                f"checkpoint_layers={self.checkpoint_layers} needs gradient_checkpointing=True "
                "and a count of layers >= 0"
            )
        if self.logprob_chunk_tokens < 1:
            raise TrainerError(
                f"logprob_chunk_tokens must be >= 1, not {self.logprob_chunk_tokens}"
            )


@dataclass(frozen=True)
class Prepared:
    """A batch ready for `Learner.step`: its micro-batches on the device, and its record."""

    micro: list[microbatch.MicroBatch]
    packed: bool
    samples: list[dict[str, Any]]  #: the batch's `samples` entry (what the ledger records)
    batch: TensorDict  #: the CPU batch, for the ledger


class Learner:
    """A model being trained, its optimiser and device; `step` is one optimiser step."""

    def __init__(self, model: Any, config: LearnerConfig | None = None) -> None:
        self.config = config or LearnerConfig()
        self.device = resolve_device(self.config.device)
        self.autocast = (
            default_autocast(self.device) if self.config.autocast is None else self.config.autocast
        )
        self.model = model.to(device=self.device, dtype=torch.float32)  # master weights
        self.model.train()
        if self.config.gradient_checkpointing:
            activations.enable(
                self.model, self.config.checkpoint_mode, self.config.checkpoint_layers
            )
        self.optimiser = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.config.lr,
            weight_decay=0.0,
            fused=self.device.type == "cuda",  # one kernel for all parameters on a GPU
        )

    @classmethod
    def load(cls, model_dir: Path, config: LearnerConfig | None = None) -> Learner:
        """A learner for the model saved in `model_dir`, with the attention `config` asks for
        (a vision-language model, whose processor has an image part, as image-text-to-text)."""
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        config = config or LearnerConfig()
        vision = VisionProcessor.of_model(model_dir) is not None
        loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        model = loader.from_pretrained(
            model_dir,
            dtype=torch.float32,
            attn_implementation=attention.implementation(config.attention),
        )
        return cls(model, config)

    def prepare(self, batch: TensorDict) -> Prepared:
        """Cut the CPU batch into micro-batches and start their copies to the device."""
        packed = attention.is_packed(batch["segment_ids"])
        micro = [
            microbatch.MicroBatch(
                to_device(m.tensors, self.device), m.trained_tokens, m.weight, self._predicts(m)
            )
            for m in microbatch.split(
                batch, self.config.micro_token_budget, self.config.pad_multiple
            )
        ]
        return Prepared(micro, packed, batch.get_non_tensor("samples"), batch)

    def _predicts(self, m: microbatch.MicroBatch) -> torch.Tensor | None:
        """Where the output layer is needed (`predict_positions`), found on the CPU copy: on
        the device, finding them would wait for it (`nonzero` reads its result's size)."""
        if self.config.logprobs == "full":
            return None
        found = predict_positions(m.tensors["loss_mask"], m.tensors["position_ids"])
        if self.device.type == "cpu":
            return found
        return found.pin_memory().to(self.device, non_blocking=True)

    def logprobs(
        self, tensors: TensorDict, packed: bool, predicts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The model's logprob of each token of the rows (`trainer.loss.token_logprobs`).

        A sample's first token has no context: 0, as alone (in a packed row the position before
        it is the previous sample's last token, whose prediction is meaningless here). With
        `logprobs="chunked"`, only the tokens the loss trains on are computed; the others are 0.
        """
        inputs = attention.model_inputs(tensors, self.config.attention, packed)
        images = tensors.get_non_tensor(MULTI_MODAL_INPUTS, default=None)
        if images and any(images):  # a VLM's rows with images: their pixels (`trainer.vision`)
            inputs |= {k: v.to(self.device) for k, v in model_inputs(images).items()}
        # A mixture of experts routes as the engine did, when the batch says so (`trainer.routing`).
        routed = tensors.get("routed_experts", None)
        if self.config.logprobs == "full":
            with autocast(self.device, self.autocast), routing.replayed(self.model, routed):
                logits = self.model(**inputs).logits
            logprobs = token_logprobs(logits, tensors["input_ids"])
            return logprobs.masked_fill(tensors["position_ids"] == 0, 0.0)
        with autocast(self.device, self.autocast), routing.replayed(self.model, routed):
            # The decoder alone: its last hidden states, not the logits (`trainer.logprobs`).
            hidden = self.model.base_model(**inputs, use_cache=False).last_hidden_state
        return row_logprobs(
            hidden,
            self.model.get_output_embeddings().weight,
            tensors["input_ids"],
            needed_positions(tensors["loss_mask"], tensors["position_ids"]),
            predicts=predicts,
            chunk_tokens=self.config.logprob_chunk_tokens,
            # The dtype the output layer computes in under autocast, as the full path's lm_head.
            compute_dtype=torch.bfloat16 if self.autocast else None,
            kernel=self.config.logprobs,
        )

    def step(self, prepared: Prepared) -> dict[str, float]:
        """One optimiser step (or `updates_per_batch`) on the batch; its metrics.

        Metrics: the loss's (token-weighted over micro-batches), `loss`, `grad_norm`,
        `reward_mean`, `micro_batches`, `tokens` (real tokens through the model, prompt
        included), `step_seconds` (the step's wall time, device work included).
        """
        if prepared.packed and self.config.attention == "flex" and self.device.type == "cpu":
            raise TrainerError(
                "flex attention has no backward pass on the CPU (torch raises NotImplementedError):"
                " train packed rows with attention='sdpa' there, or on a GPU"
            )
        started = time.perf_counter()
        old: list[torch.Tensor | None] = [None] * len(prepared.micro)
        if self.config.updates_per_batch > 1:
            with torch.no_grad():
                old = [self.logprobs(m.tensors, prepared.packed) for m in prepared.micro]
        for _ in range(self.config.updates_per_batch):
            self.optimiser.zero_grad(set_to_none=True)
            totals: dict[str, torch.Tensor] = {}
            loss_sum = torch.zeros((), device=self.device)
            for m, old_logprobs in zip(prepared.micro, old, strict=True):
                logprobs = self.logprobs(m.tensors, prepared.packed, m.predicts)
                reference = logprobs.detach() if old_logprobs is None else old_logprobs
                tensors = m.tensors
                if not self.config.importance_weights:
                    tensors = _behaving_as(tensors, reference)
                distilled: dict[str, torch.Tensor] = {}
                if self.config.distill is not None:
                    tensors, distilled = with_distillation(tensors, logprobs, self.config.distill)
                loss, metrics = policy_loss_terms(
                    logprobs, tensors, old_logprobs=reference, config=self.config.loss
                )
                metrics |= distilled
                (loss * m.weight).backward()  # type: ignore[no-untyped-call]
                loss_sum += loss.detach() * m.weight
                _accumulate(totals, metrics, m.weight)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.config.max_grad_norm
            )
            self.optimiser.step()
        rewards = [s["reward"] for s in prepared.samples]
        # The step's one wait for the device: every figure read at once.
        names = [*totals, "loss", "grad_norm"]
        values = torch.stack([*totals.values(), loss_sum, grad_norm.to(loss_sum)]).tolist()
        return dict(zip(names, values, strict=True)) | {
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "micro_batches": float(len(prepared.micro)),
            "real_tokens": float(sum(s["n_tokens"] for s in prepared.samples)),
            "step_seconds": time.perf_counter() - started,
        }


#: Metrics that add up over micro-batches rather than average.
_COUNTS = ("tokens", "teacher_tokens")


def _accumulate(
    totals: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], weight: float
) -> None:
    """Fold a micro-batch's loss metrics in: token-weighted means, a max, a count (on the
    device: nothing here waits for it)."""
    for key, value in metrics.items():
        if key not in totals:
            totals[key] = value if key in _COUNTS or key == "ratio_max" else value * weight
        elif key == "ratio_max":
            totals[key] = torch.maximum(totals[key], value)
        elif key in _COUNTS:
            totals[key] = totals[key] + value
        else:
            totals[key] = totals[key] + value * weight


def _behaving_as(tensors: TensorDict, reference: torch.Tensor) -> TensorDict:
    """The rows with pi_old's logprobs as the behaviour's (w = 1); unreported ones stay NaN."""
    behaviour = tensors["logprobs"]
    copy = tensors.clone(recurse=False)
    copy["logprobs"] = torch.where(torch.isfinite(behaviour), reference, behaviour)
    return copy
