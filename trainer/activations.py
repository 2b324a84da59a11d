"""Activation (gradient) checkpointing of a Hugging Face model's decoder layers, by mode.

    full        a layer keeps its input; the backward runs the layer's forward again
                (about a third more compute; the least memory)
    selective   a layer keeps its input and the outputs of its matrix products and attention;
                the backward re-runs only the element-wise ops between them (norms, rotary,
                SiLU and its product, residual adds). Its policy runs in Python for every op,
                so it pays where kernels are large: on an H100 at 0.5B, 1.16-1.19x the tokens/s
                of `full` for 32 k and 64 k-token samples (at 2.7-3.3x its memory), and slower
                than `full` on short batches (docs/performance.md, "Memory per token")

Either mode can be given to some of the layers only (`layers`, spread evenly over the depth): each
layer left out keeps all its activations and costs no recomputation, a dial between the two.

Selective is PyTorch's selective activation checkpointing (`create_selective_checkpoint_contexts`
with a policy), the policy torchtitan's "op" mode uses: save the matmuls and the attention
kernels, recompute the rest. Both modes are non-reentrant (inputs that need no gradient and
autocast work).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from trajstore.trainer.errors import TrainerError

MODES = ("full", "selective")

#: The ops whose outputs a selectively checkpointed layer keeps: the products (a Linear under
#: autocast is `mm` or, with a bias, `addmm`; eager attention is `bmm`) and every attention
#: kernel SDPA may pick, CUDA's and the CPU's. Names a build lacks are left out.
_SAVED_ATEN = (
    "mm", "addmm", "bmm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
)  # fmt: skip


def _saved_ops() -> frozenset[Any]:
    ops: set[Any] = {
        getattr(torch.ops.aten, name).default
        for name in _SAVED_ATEN
        if hasattr(torch.ops.aten, name)
    }
    # Flex attention is a higher-order op that selective checkpointing sees as one op.
    flex = getattr(torch._higher_order_ops, "flex_attention", None)
    if flex is not None:
        ops.add(flex)
    return frozenset(ops)


def _policy(saved: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def check_mode(mode: str) -> None:
    """`TrainerError` naming the modes when `mode` is none of them."""
    if mode not in MODES:
        raise TrainerError(f"unknown checkpoint_mode {mode!r}: use one of {', '.join(MODES)}")


def enable(model: Any, mode: str, layers: int | None = None) -> None:
    """Turn on checkpointing of `model`'s decoder layers in `mode` (see the module docstring):
    all of them, or `layers` of them spread evenly over the depth."""
    check_mode(mode)
    kwargs: dict[str, Any] = {"use_reentrant": False}
    if mode == "selective":
        policy = functools.partial(_policy, _saved_ops())
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if layers is not None:
        decoder = checkpointed_layers(model)
        chosen = {k * len(decoder) // layers for k in range(layers)} if layers > 0 else set()
        for index, layer in enumerate(decoder):
            layer.gradient_checkpointing = index in chosen


def checkpointed_layers(model: Any) -> list[Any]:
    """The layers of `model` that checkpointing can apply to (Hugging Face's decoder layers), in
    order, whether it is on for them or not."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
