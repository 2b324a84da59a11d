"""Batches from samples: padding, packing, the per-sample mask, and GRPO advantages (no I/O)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from trajstore.trainer.advantages import group_advantages
from trajstore.trainer.collate import (
    FIELDS,
    Layout,
    ReplaySample,
    block_causal_mask,
    collate,
    sample_ids,
)
from trajstore.trainer.errors import BadSelection


def sample(tokens: list[int], n_prompt: int, *, advantage: float = 0.5) -> ReplaySample:
    mask = np.array([0] * n_prompt + [1] * (len(tokens) - n_prompt), np.uint8)
    return ReplaySample(
        uuid.uuid4(), "s", np.array(tokens, np.int32), mask,
        np.where(mask == 1, -0.5, 0.0).astype(np.float32), 1.0, advantage, 3, 1,
    )  # fmt: skip


def test_padding_pads_to_the_longest_sample_and_masks_the_padding() -> None:
    batch = collate([[sample([5, 6, 7], 1)], [sample([8, 9, 10, 11, 12], 2)]])
    assert batch.batch_size == torch.Size([2])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 1]]
    assert batch["logprobs"][0].tolist() == [0.0, -0.5, -0.5, 0.0, 0.0]
    assert batch["advantages"][0].tolist() == [0.5, 0.5, 0.5, 0.0, 0.0]
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 3, 4]
    assert batch["staleness"][0].tolist() == [1, 1, 1, -1, -1]


def test_packing_restarts_positions_and_numbers_segments() -> None:
    a, b = sample([5, 6, 7], 1), sample([8, 9], 1)
    batch = collate([[a, b]])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 2, 2]]
    assert sample_ids(batch) == [str(a.sample_id), str(b.sample_id)]
    assert [s["row"] for s in batch.get_non_tensor("samples")] == [0, 0]


def test_the_tensors_of_a_batch_do_not_share_memory() -> None:
    # collate lays every tensor out in one allocation: writing one must leave the others alone.
    batch = collate([[sample([5, 6, 7], 1)], [sample([8, 9], 1)]])
    before = {name: batch[name].clone() for name, _, _ in FIELDS}
    for name in before:
        batch[name].fill_(True if batch[name].dtype == torch.bool else 7)
        for other in before.keys() - {name}:
            assert torch.equal(batch[other], before[other]), (name, other)
        batch[name].copy_(before[name])
    assert batch["policy_version"].tolist() == [[3, 3, 3], [3, 3, -1]]
    assert batch["input_ids"].dtype == torch.int64 and batch["input_ids"].is_contiguous()


def test_the_block_causal_mask_keeps_packed_samples_apart() -> None:
    mask = block_causal_mask(torch.tensor([[1, 1, 2, 2, 0]]))[0, 0]
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [False, False, True, False, False],  # the 2nd sample does not see the 1st
        [False, False, True, True, False],
        [False, False, False, False, False],  # padding sees nothing
    ]


@pytest.mark.parametrize(
    ("layout", "lengths", "plan"),
    [
        (Layout(batch_size=2), [3, 1, 4, 1, 5], [[[0], [1]], [[2], [3]], [[4]]]),
        # rows x longest <= 8: [3,1] -> 2x3=6; adding 4 would make 3x4=12
        (Layout(token_budget=8), [3, 1, 4, 1, 5], [[[0], [1]], [[2], [3]], [[4]]]),
        (Layout(batch_size=3, token_budget=6), [1, 1, 1, 1], [[[0], [1], [2]], [[3]]]),
        # packed rows of 5 tokens, next fit keeps the order; 2 rows per batch
        (Layout(token_budget=5, pack=True, batch_size=2), [3, 1, 4, 1, 5],
         [[[0, 1], [2, 3]], [[4]]]),
        (Layout(token_budget=5, pack=True), [2, 2, 2], [[[0, 1]], [[2]]]),
    ],
)  # fmt: skip
def test_plans_follow_the_layout(layout: Layout, lengths: list[int], plan: object) -> None:
    assert layout.plan(lengths, list(range(len(lengths)))) == plan


def test_a_sample_longer_than_the_budget_is_refused_by_name() -> None:
    with pytest.raises(BadSelection, match="sample s-9 has 9 tokens, more than token_budget=8"):
        Layout(token_budget=8).plan([9], ["s-9"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({}, "give batch_size or token_budget"), ({"pack": True, "batch_size": 2}, "pack=True needs"),
     ({"batch_size": 0}, "positive integer")],
)  # fmt: skip
def test_bad_layouts_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BadSelection, match=message):
        Layout(**kwargs)  # type: ignore[arg-type]


def test_group_advantages_normalise_within_each_group() -> None:
    advantages = group_advantages([1.0, 0.0, 5.0, 5.0, 2.0, 7.0], ["a", "a", "b", "b", "c", None])
    assert advantages[0] == pytest.approx(1.0, abs=1e-5)  # (1 - 0.5) / 0.5
    assert advantages[1] == pytest.approx(-1.0, abs=1e-5)
    assert advantages[2:] == [0.0, 0.0, 0.0, 0.0]  # equal rewards, a group of one, no group
    # Equal rewards whose float mean is not exactly their value still say nothing: exactly 0.
    assert group_advantages([0.1, 0.1, 0.1], ["a", "a", "a"]) == [0.0, 0.0, 0.0]
