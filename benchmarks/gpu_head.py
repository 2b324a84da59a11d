"""The output layer's logprobs alone, as `benchmarks/gpu.py --long` measures them ("head"):
forward and backward with a per-token gradient, full logits against the chunked path and
Liger-Kernel's fused kernel, each checked against full (`benchmarks/gpu_long.py`)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from trajstore.trainer.device import peak_memory, synchronize
from trajstore.trainer.logprobs import chunked_logprobs, liger_logprobs


def free(device: torch.device) -> None:
    """Give back what the last pass held."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def head_case(
    kind: str, tokens: int, shape: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """The output layer's logprobs alone, forward + backward, as the learner computes them."""
    hidden_size, vocab = int(shape["hidden_size"]), int(shape["vocab_size"])
    generator = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=generator,
                         requires_grad=True)  # fmt: skip
    weight = torch.nn.Parameter(0.02 * torch.randn(vocab, hidden_size, device=device,
                                                   generator=generator))  # fmt: skip
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    upstream = torch.randn(tokens, device=device, generator=generator)
    bf16 = device.type == "cuda"
    run = _head_kinds(hidden, weight, targets, upstream, bf16)[kind]
    times = []
    check = _head_check(run, hidden, weight, kind)
    before = 0.0
    for i in range(7):
        hidden.grad, weight.grad = None, None
        free(device)
        if device.type == "cuda":
            before = torch.cuda.memory_allocated(device) / 1e9
        with peak_memory(device) as memory:
            synchronize(device)
            started = time.perf_counter()
            run()
            synchronize(device)
        if i >= 2:  # the first two: kernels' autotuning
            times.append(time.perf_counter() - started)
    # What the pass allocated beyond what was there: the gradients (hidden's, weight's) too.
    return check | {"median_ms": statistics.median(times) * 1e3,
                    "peak_gb_transient": memory["peak_memory_gb"] - before}  # fmt: skip


_REFERENCE: dict[str, torch.Tensor] = {}


def _head_check(
    run: Callable[[], torch.Tensor], hidden: torch.Tensor, weight: torch.Tensor, kind: str
) -> dict[str, float]:
    """Largest differences from the full path's logprobs and gradients (it runs first)."""
    hidden.grad, weight.grad = None, None
    picked = run().detach()
    assert hidden.grad is not None and weight.grad is not None
    got = {"logprobs": picked, "hidden": hidden.grad.clone(), "weight": weight.grad.clone()}
    if kind == "full":
        _REFERENCE.clear()
        _REFERENCE.update(got)
    if not _REFERENCE:
        return {}
    return {f"max_diff_{k}": float((v - _REFERENCE[k]).abs().max()) for k, v in got.items()}


def _head_kinds(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, upstream: torch.Tensor,
    bf16: bool,
) -> dict[str, Callable[[], torch.Tensor]]:  # fmt: skip
    dtype = torch.bfloat16 if bf16 else torch.float32

    def backward(picked: torch.Tensor) -> torch.Tensor:  # a per-token gradient, as a loss gives
        (picked * upstream).sum().backward()  # type: ignore[no-untyped-call]
        return picked

    def full() -> torch.Tensor:  # the model's lm_head under autocast, then `token_logprobs`'s
        logits = torch.nn.functional.linear(hidden.to(dtype), weight.to(dtype))
        return backward(torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None])[:, 0])

    def chunked() -> torch.Tensor:
        return backward(chunked_logprobs(hidden, weight, targets, compute_dtype=dtype))

    def liger() -> torch.Tensor:
        return backward(liger_logprobs(hidden, weight, targets, compute_dtype=dtype))

    return {"full": full, "chunked": chunked, "liger": liger}
