"""Per-sample attention for packed rows, and the mask a model is given for any batch.

A packed row (`trainer.collate`, `pack=True`) lays several samples one after another. Each must
be computed exactly as if it were alone: its tokens attend to the earlier tokens of the same
sample only, at the positions it would have alone (`position_ids` restart per sample). Hugging
Face models take such a mask as a 4-D mask, passed through untouched:

    sdpa  a dense `[rows, 1, L, L]` bool mask (same sample and causal). Works everywhere, but
          SDPA then computes every L x L score of the row and masks most of them away: a row of
          10 samples pays 10x the attention FLOPs its samples need (measured on an H100: packed
          rows with a dense mask ran at 0.67x padding's tokens/s, /work notes of 2026-11-26).
    flex  a `BlockMask` for flex attention (`attn_implementation="flex_attention"`): only the
          blocks (128 x 128 tokens) that hold any same-sample causal pair are computed, so a
          packed row costs about what its samples cost alone. The default for packed rows.

Padding tokens (segment 0) attend to themselves only: a query row with nothing to attend to
would give NaN, which the loss's mask could not cancel (NaN x 0 is NaN).

Padded batches (one sample per row) need neither: the 2-D `attention_mask` is enough.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from trajstore.trainer.errors import TrainerError

AttentionKind = Literal["sdpa", "flex"]

#: The `attn_implementation` a model is loaded with for each kind.
IMPLEMENTATION: dict[str, str] = {"sdpa": "sdpa", "flex": "flex_attention"}


def implementation(kind: str) -> str:
    """The Hugging Face `attn_implementation` for `kind` (sdpa or flex)."""
    try:
        return IMPLEMENTATION[kind]
    except KeyError:
        raise TrainerError(f"unknown attention {kind!r}: use sdpa or flex") from None


def is_packed(segment_ids: torch.Tensor) -> bool:
    """True when some row holds more than one sample."""
    return bool((segment_ids.amax(dim=1) > 1).any())


def dense_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """`[rows, 1, L, L]` bool: i sees j iff j <= i in the same sample; padding sees itself."""
    length = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = (segment_ids > 0)[:, :, None]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment_ids.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=segment_ids.device)
    return ((same & real & causal) | diagonal)[:, None, :, :]


def block_mask(segment_ids: torch.Tensor) -> Any:
    """The flex attention `BlockMask` of `dense_mask(segment_ids)`, without an L x L tensor."""
    from torch.nn.attention.flex_attention import create_block_mask

    segments = segment_ids.long()
    rows, length = segments.shape

    def same_sample_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        seg_q, seg_k = segments[b, q], segments[b, k]
        return ((seg_q == seg_k) & (k <= q) & (seg_q > 0)) | (q == k)

    return create_block_mask(
        same_sample_causal, rows, None, length, length, device=str(segment_ids.device)
    )


def model_inputs(batch: Any, kind: str, packed: bool | None = None) -> dict[str, Any]:
    """The keyword arguments of the model's forward pass for this batch.

    Padded rows: the 2-D attention mask. Packed rows: the per-sample 4-D mask of `kind`.
    `packed` (when the caller knows it, e.g. from the batch's CPU copy) saves a look at the
    segment ids, which on a GPU waits for the device.
    """
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
    segment_ids = batch["segment_ids"]
    if not (is_packed(segment_ids) if packed is None else packed):
        return inputs | {"attention_mask": batch["attention_mask"].long()}
    mask = block_mask(segment_ids) if kind == "flex" else dense_mask(segment_ids)
    return inputs | {"attention_mask": mask}
