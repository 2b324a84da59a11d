"""A batch cut into micro-batches by token budget, for gradient accumulation.

A batch is what the ledger records and what one optimiser step trains on; how many rows go
through the model at once is a memory question, answered here. Rows are taken longest first and
grouped while `rows x longest <= token_budget` (a row longer than the budget goes alone), and
each micro-batch is cut to its own longest row: rows of like length travel together, so a
micro-batch carries less padding than the batch it came from.

The loss of the whole batch is a token mean; a micro-batch's loss (a token mean over its own
tokens) is weighted by its share of the batch's trained tokens, so the accumulated gradient is
the gradient of the whole batch's loss, whatever the cut.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

from trajstore.trainer.collate import FIELDS
from trajstore.trainer.vision import MULTI_MODAL_INPUTS

_PADDING = {name: padding for name, _, padding in FIELDS}


@dataclass(frozen=True)
class MicroBatch:
    """Rows of a batch cut to their longest, and their share of the batch's trained tokens."""

    tensors: TensorDict
    trained_tokens: int  #: loss_mask true and a finite behaviour logprob
    weight: float  #: trained_tokens / the batch's trained tokens (0 when the batch has none)
    #: `[2, n]` (row, column) of the tokens whose logprob the loss needs, when the learner
    #: computes only those (`trainer.logprobs.predict_positions`); None: found when needed
    predicts: torch.Tensor | None = None


def trained_tokens(batch: TensorDict) -> torch.Tensor:
    """Per row, the tokens the loss trains on (`trainer.loss`'s mask)."""
    counts: torch.Tensor = (batch["loss_mask"] & torch.isfinite(batch["logprobs"])).sum(dim=1)
    return counts


def split(batch: TensorDict, token_budget: int | None, pad_multiple: int = 1) -> list[MicroBatch]:
    """The batch as micro-batches of at most `token_budget` padded tokens each (None: one).

    Each is cut (or padded) to its longest row rounded up to `pad_multiple`:
    on a GPU, fewer distinct shapes mean fewer kernel autotunes and recompilations. Works on
    the CPU copy of the batch (its lengths are read as Python ints).
    """
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    per_row = trained_tokens(batch).tolist()
    total = sum(per_row)
    rows = batch.batch_size[0]
    images = batch.get_non_tensor(MULTI_MODAL_INPUTS, default=None)
    if token_budget is None:
        groups = [list(range(rows))]
    else:
        groups = []
        current: list[int] = []
        for row in sorted(range(rows), key=lambda r: -lengths[r]):
            # Rows come longest first: the group's longest is its first row.
            if current and (len(current) + 1) * lengths[current[0]] > token_budget:
                groups.append(current)
                current = []
            current.append(row)
        if current:
            groups.append(current)
    micro = []
    for group in groups:
        longest = max(max(lengths[r] for r in group), 1)
        width = -(-longest // pad_multiple) * pad_multiple
        index = torch.tensor(group)
        tensors = TensorDict(
            {name: _cut(name, batch[name][index], width) for name, _, _ in FIELDS},
            batch_size=[len(group)],
        )
        every = batch.get("routed_experts", None)
        if every is not None:  # (`trainer.routing`): cut along the tokens
            routed = every[index][:, :width]
            if routed.shape[1] < width:
                pad = routed.new_full((len(group), width - routed.shape[1], *routed.shape[2:]), -1)
                routed = torch.cat([routed, pad], dim=1)
            tensors["routed_experts"] = routed
        if images is not None:  # a VLM's rows keep their images (`trainer.vision`)
            tensors.set_non_tensor(MULTI_MODAL_INPUTS, [images[r] for r in group])
        tokens = sum(per_row[r] for r in group)
        micro.append(MicroBatch(tensors, tokens, tokens / total if total else 0.0))
    return micro


def _cut(name: str, rows: torch.Tensor, width: int) -> torch.Tensor:
    """`rows` cut to `width` columns, or padded to it with the field's padding value."""
    if rows.shape[1] >= width:
        return rows[:, :width]
    pad = width - rows.shape[1]
    return torch.nn.functional.pad(rows, (0, pad), value=_PADDING.get(name, 0))
