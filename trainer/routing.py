"""Routing replay ("R3") for mixture-of-experts models: the trainer's forward uses the experts
the inference engine chose for each token, recorded with the turn (`store.side_data`).

On an MoE model the engine's router and the trainer's disagree on many tokens (other kernels,
other precision, a policy a few versions old), and a token routed to other experts gets another
probability: the importance ratio then measures the routing, not the policy. Forcing the
trainer's routers to the recorded experts removes that term. The router still computes its
softmax, and the experts' weights are its probabilities at the forced experts (renormalised as
the model does), so the router keeps its gradient; only the choice is replayed.

A batch carries them as `routed_experts`: int64 `[rows, length, moe_layers, top_k]`, -1 where
nothing was recorded (prompt padding, a turn's last token, which the engine never forwarded);
a position without routing is routed freely. Routers are found by shape, in module order (one
per MoE layer, as the engine numbers them): modules with `top_k`, `num_experts`,
`norm_topk_prob` and a `weight` of (experts, hidden), as transformers' Qwen3-MoE and Qwen2-MoE
top-k routers are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from trajstore.trainer.errors import TrainerError

#: The batch entry (and the side-data kind) routing replay reads.
ROUTED = "routed_experts"


def routers(model: nn.Module) -> list[Any]:
    """The model's top-k routers, in module order (one per MoE layer)."""
    return [
        m
        for m in model.modules()
        if all(hasattr(m, a) for a in ("top_k", "num_experts", "norm_topk_prob", "weight"))
    ]


def _route(router: Any, hidden_states: torch.Tensor, forced: torch.Tensor | None) -> Any:
    """A top-k router's forward, its choice forced where `forced` has experts (>= 0)."""
    hidden = hidden_states.reshape(-1, router.weight.shape[1])
    logits = nn.functional.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    _, chosen = torch.topk(probs, router.top_k, dim=-1)
    if forced is not None:
        known = (forced >= 0).all(dim=-1, keepdim=True)
        chosen = torch.where(known, forced.clamp(min=0), chosen)
    values = probs.gather(-1, chosen)
    if router.norm_topk_prob:
        values = values / values.sum(dim=-1, keepdim=True)
    return logits, values.to(logits.dtype), chosen


@contextlib.contextmanager
def replayed(model: nn.Module, routed: torch.Tensor | None) -> Iterator[None]:
    """Within the block, the model's routers choose the `routed` experts (`[rows, length,
    layers, top_k]`, -1: free) for the rows of the next forward; nothing changes with None."""
    if routed is None:
        yield
        return
    found = routers(model)
    if len(found) != routed.shape[2] or (found and found[0].top_k != routed.shape[3]):
        raise TrainerError(
            f"the recorded routing has {routed.shape[2]} layers x top-{routed.shape[3]}; the "
            f"model has {len(found)} routers of top-{found[0].top_k if found else '?'}"
        )
    try:
        for layer, router in enumerate(found):
            forced = routed[:, :, layer, :].reshape(-1, routed.shape[3]).to(router.weight.device)
            router.forward = lambda h, r=router, f=forced: _route(r, h, f)
        yield
    finally:
        for router in found:
            router.__dict__.pop("forward", None)


@contextlib.contextmanager
def captured(model: nn.Module, rows: int, length: int) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward's routing is recorded: the list holds, after it, one
    `[rows, length, layers, top_k]` tensor per forward (what an engine would return)."""
    found = routers(model)
    chosen: list[torch.Tensor] = []
    forwards: list[torch.Tensor] = []

    def record(router: Any, hidden: torch.Tensor) -> Any:
        logits, values, experts = _route(router, hidden, None)
        chosen.append(experts.detach())
        if len(chosen) == len(found):
            forwards.append(torch.stack(chosen, dim=1).reshape(rows, length, len(found), -1))
            chosen.clear()
        return logits, values, experts

    try:
        for router in found:
            router.forward = lambda h, r=router: record(r, h)
        yield forwards
    finally:
        for router in found:
            router.__dict__.pop("forward", None)


def as_batch_routing(experts: npt.NDArray[Any]) -> npt.NDArray[np.int64]:
    """A sample's stored routed experts (`store.side_data`: absent = the dtype's largest value)
    as a batch's rows hold them (int64, -1 absent)."""
    out = experts.astype(np.int64)
    out[experts == np.iinfo(experts.dtype).max] = -1
    return out
