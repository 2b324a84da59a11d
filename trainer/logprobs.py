"""Per-token logprobs through the output layer in chunks, without the full logits.

The plain way (`trainer.loss.token_logprobs`) asks the model for its logits, `[tokens, vocab]`,
and takes a float32 `log_softmax` over them: for a Qwen-shaped vocabulary (151,936) that is
0.6 MB per token per copy, and autograd keeps several copies for the backward. A 16 k-token
sample then needs about 40 GB for its logprobs alone (measured on an H100, /work notes of
2026-11-27: 8-25 k-token samples ran out of memory there, whatever the rest of the model needed).

Here the model gives its last hidden states (`[tokens, hidden]`, 4 KB a token at 0.5B) and the
output layer's weight `W` (`[vocab, hidden]`); `chunked_logprobs` takes the tokens in chunks of
`chunk_tokens`, and for each computes `logits = h W^T` in float32, the picked logit and the
log-sum-exp, and drops the logits. The backward (a custom `autograd.Function`) recomputes each
chunk's logits from the saved hidden states, so at most one chunk's `[chunk, vocab]` block lives
at a time, forward or backward:

    d logprob_t / d logits_t = onehot(target_t) - softmax(logits_t)
    grad_h_t = g_t (onehot - softmax) W          grad_W = sum_t g_t (onehot - softmax)^T h_t

The cost: one more `h W^T` per chunk in the backward (a 0.5B model's output layer is about a
quarter of its FLOPs per token). The gain beyond memory: only the positions the loss trains on go
through the output layer at all (`needed_positions`): a prompt token's logprob is never used.

On a GPU, `logprobs="liger"` does the same with Liger-Kernel's fused linear cross-entropy
(Triton kernels; `reduction="none"` recomputes per chunk in its backward too): measured against
this one by `benchmarks/gpu.py --long` (docs/performance.md).

Precision: `compute_dtype` is the dtype of the two matmuls (bf16 under a GPU's autocast, as the
plain path's `lm_head` computes there; float32 on the CPU); softmax, log-sum-exp and the weight's
gradient accumulate in float32.
"""

from __future__ import annotations

from typing import Any

import torch

from trajstore.trainer.errors import TrainerError

#: Tokens per chunk: [2,048, 151,936] float32 logits are 1.2 GB, a few times that in flight.
DEFAULT_CHUNK_TOKENS = 2048


class _ChunkedLogprobs(torch.autograd.Function):
    """logprob[t] = logits[t, target[t]] - logsumexp(logits[t]), logits = hidden @ weight^T."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        chunk_tokens: int,
        compute_dtype: torch.dtype,
    ) -> torch.Tensor:
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)  # one cast per pass, not per chunk
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty_like(out)
        for start in range(0, h.shape[0], chunk_tokens):
            span = slice(start, start + chunk_tokens)
            logits = (h[span] @ w.T).float()
            lse[span] = torch.logsumexp(logits, dim=-1)
            out[span] = logits.gather(-1, targets[span, None]).squeeze(-1) - lse[span]
            del logits
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        ctx.hidden_dtype = hidden.dtype
        return out

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple[Any, ...]:
        (grad,) = grad_outputs
        h, weight, targets, lse = ctx.saved_tensors
        w = weight.to(h.dtype)
        grad_h = torch.empty(h.shape, dtype=ctx.hidden_dtype, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device)
        grad = grad.float()
        for start in range(0, h.shape[0], ctx.chunk_tokens):
            span = slice(start, start + ctx.chunk_tokens)
            # Recomputed here rather than kept from the forward: the point of the chunks.
            probs = (h[span] @ w.T).float().sub_(lse[span, None]).exp_()
            # d logprob / d logits = onehot(target) - softmax, times the incoming gradient.
            dlogits = probs.mul_(-grad[span, None])
            dlogits.scatter_add_(-1, targets[span, None], grad[span, None])
            dlogits_c = dlogits.to(h.dtype)
            del probs, dlogits
            grad_h[span] = (dlogits_c @ w).to(ctx.hidden_dtype)
            grad_w += (dlogits_c.T @ h[span]).float()
            del dlogits_c
        return grad_h, grad_w.to(weight.dtype), None, None, None


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`[n]` float32: log softmax(hidden @ weight^T)[i, targets[i]] for each of the n rows.

    `hidden` is `[n, hidden]`, `weight` the output layer's `[vocab, hidden]`, `targets` `[n]`
    token ids. Differentiable in `hidden` and `weight`; no `[n, vocab]` tensor is kept.
    `compute_dtype`: the matmuls' dtype (default: `hidden`'s).
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    dtype = compute_dtype or hidden.dtype
    result: torch.Tensor = _ChunkedLogprobs.apply(  # type: ignore[no-untyped-call]
        hidden, weight, targets, chunk_tokens, dtype
    )
    return result


def liger_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """`chunked_logprobs` by Liger-Kernel's fused linear cross-entropy (Triton, GPU only).

    Its `reduction="none"` keeps the per-token loss and, given a per-token gradient, recomputes
    the chunks in its backward as ours does (Liger >= 0.8.5). Minus the cross-entropy is the
    logprob. `TrainerError` when the package (and Triton) is not installed.
    """
    try:
        from liger_kernel.transformers.functional import (  # type: ignore[import-not-found]
            liger_fused_linear_cross_entropy,
        )
    except ImportError as exc:
        raise TrainerError(
            f"logprobs='liger' needs the liger-kernel package and a GPU ({exc}); "
            "use logprobs='chunked' (the same result, in PyTorch)"
        ) from exc
    dtype = compute_dtype or hidden.dtype
    loss: torch.Tensor = liger_fused_linear_cross_entropy(
        hidden.to(dtype), weight.to(dtype), targets, reduction="none"
    )
    return -loss.float()


def needed_positions(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """`[rows, length]` bool: the tokens whose logprob the loss uses.

    Those it trains on, except a sample's first token (position 0), which has no context: its
    logprob is 0 by convention (`Learner.logprobs`), in a packed row too.
    """
    return loss_mask & (position_ids > 0)


def predict_positions(loss_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """`[2, n]` int64: (row, column) of each token whose logprob the loss uses and that has a
    token before it in its row (`needed_positions`, minus column 0)."""
    return _positions(needed_positions(loss_mask, position_ids))


def _positions(needed: torch.Tensor) -> torch.Tensor:
    predicts = needed.clone()
    predicts[:, 0] = False  # nothing before the first column predicts it
    return torch.stack(predicts.nonzero(as_tuple=True))


def row_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    needed: torch.Tensor,
    *,
    predicts: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    compute_dtype: torch.dtype | None = None,
    kernel: str = "chunked",
) -> torch.Tensor:
    """`[rows, length]` float32: each needed token's logprob given the ones before it, else 0.

    `hidden` is the model's last hidden state, `[rows, length, hidden]`: the state at t - 1
    predicts token t, as `token_logprobs` lines them up. Only `needed` tokens go through the
    output layer, by `chunked_logprobs` (`kernel="chunked"`) or `liger_logprobs` ("liger").
    `predicts`: their `[2, n]` positions when already known (`predict_positions` of `needed`).
    """
    rows, length = input_ids.shape
    row, col = _positions(needed) if predicts is None else predicts
    states, targets = hidden[row, col - 1], input_ids[row, col]
    if kernel == "liger":
        picked = liger_logprobs(states, weight, targets, compute_dtype=compute_dtype)
    else:
        picked = chunked_logprobs(
            states, weight, targets, chunk_tokens=chunk_tokens, compute_dtype=compute_dtype
        )
    out = torch.zeros(rows, length, dtype=torch.float32, device=hidden.device)
    return out.index_put((row, col), picked)
