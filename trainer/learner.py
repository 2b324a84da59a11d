"""The learner: a causal LM, its optimiser, and one policy-gradient step on a batch, on any device.

    prepare(batch)   on the CPU (in the prefetch thread): cut into micro-batches by token
                     budget, pin, copy to the device without blocking
    step(prepared)   per micro-batch, under autocast: the model's logprobs -> the loss weighted
                     by the micro-batch's share of tokens -> backward; then clip, optimiser step

Weights and AdamW state stay float32 on the device (bf16 autocast on a GPU computes the passes;
`trainer.device`). Packed rows get per-sample attention (`trainer.attention`).

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

from trajstore.trainer import attention, microbatch, routing
from trajstore.trainer.device import autocast, default_autocast, resolve_device, to_device
from trajstore.trainer.distill import DistillConfig, with_distillation
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.loss import LossConfig, policy_loss, token_logprobs
from trajstore.trainer.vision import MULTI_MODAL_INPUTS, VisionProcessor, model_inputs


@dataclass(frozen=True)
class LearnerConfig:
    """The learner's knobs; the defaults train the tiny model on a CPU in seconds."""

    device: str = "auto"  #: auto | cuda | cpu
    autocast: bool | None = None  #: bf16 autocast; None: on for a GPU, off on the CPU
    attention: str = "sdpa"  #: sdpa | flex: how packed rows attend per sample
    micro_token_budget: int | None = None  #: padded tokens per forward pass (None: whole batch)
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
            microbatch.MicroBatch(to_device(m.tensors, self.device), m.trained_tokens, m.weight)
            for m in microbatch.split(
                batch, self.config.micro_token_budget, self.config.pad_multiple
            )
        ]
        return Prepared(micro, packed, batch.get_non_tensor("samples"), batch)

    def logprobs(self, tensors: TensorDict, packed: bool) -> torch.Tensor:
        """The model's logprob of each token of the rows (`trainer.loss.token_logprobs`).

        A sample's first token has no context: 0, as alone (in a packed row the position before
        it is the previous sample's last token, whose prediction is meaningless here).
        """
        inputs = attention.model_inputs(tensors, self.config.attention, packed)
        images = tensors.get_non_tensor(MULTI_MODAL_INPUTS, default=None)
        if images and any(images):  # a VLM's rows with images: their pixels (`trainer.vision`)
            inputs |= {k: v.to(self.device) for k, v in model_inputs(images).items()}
        routed = tensors.get("routed_experts", None)
        with autocast(self.device, self.autocast), routing.replayed(self.model, routed):
            logits = self.model(**inputs).logits
        logprobs = token_logprobs(logits, tensors["input_ids"])
        return logprobs.masked_fill(tensors["position_ids"] == 0, 0.0)

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
            totals: dict[str, float] = {}
            loss_sum = torch.zeros((), device=self.device)
            for m, old_logprobs in zip(prepared.micro, old, strict=True):
                logprobs = self.logprobs(m.tensors, prepared.packed)
                reference = logprobs.detach() if old_logprobs is None else old_logprobs
                tensors = m.tensors
                if not self.config.importance_weights:
                    tensors = _behaving_as(tensors, reference)
                distilled: dict[str, float] = {}
                if self.config.distill is not None:
                    tensors, distilled = with_distillation(tensors, logprobs, self.config.distill)
                loss, metrics = policy_loss(
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
        return totals | {
            "loss": float(loss_sum),
            "grad_norm": float(grad_norm),
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "micro_batches": float(len(prepared.micro)),
            "real_tokens": float(sum(s["n_tokens"] for s in prepared.samples)),
            "step_seconds": time.perf_counter() - started,
        }


def _accumulate(totals: dict[str, float], metrics: dict[str, float], weight: float) -> None:
    """Fold a micro-batch's loss metrics in: token-weighted means, a max, a count."""
    for key, value in metrics.items():
        if key == "ratio_max":
            totals[key] = max(totals.get(key, value), value)
        elif key in ("tokens", "teacher_tokens"):
            totals[key] = totals.get(key, 0.0) + value
        else:
            totals[key] = totals.get(key, 0.0) + value * weight


def _behaving_as(tensors: TensorDict, reference: torch.Tensor) -> TensorDict:
    """The rows with pi_old's logprobs as the behaviour's (w = 1); unreported ones stay NaN."""
    behaviour = tensors["logprobs"]
    copy = tensors.clone(recurse=False)
    copy["logprobs"] = torch.where(torch.isfinite(behaviour), reference, behaviour)
    return copy
