"""On-policy distillation in the trainer: replay batches, the verl batch and the TRL dataset carry
a teacher's per-token logprobs aligned with the tokens; the loss moves the student toward the
teacher (alone and mixed with GRPO); the live replay waits for a sample's score."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import numpy as np
import pytest
import torch
from tensordict import TensorDict

from tests.trainer.rows import sample_row, store_samples
from trajstore.store import EventStore
from trajstore.store.side_data import LOGPROBS, sample_stream, scored_event
from trajstore.trainer.distill import DistillConfig, with_distillation
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.loss import token_logprobs
from trajstore.trainer.replay import replay
from trajstore.trainer.replay_live import replay_live
from trajstore.trainer.selection import Selection
from trajstore.trainer.trl_dataset import read_samples_table


def test_the_distillation_advantage_is_the_teachers_minus_the_students_logprob() -> None:
    tensors = TensorDict(
        {
            "advantages": torch.tensor([[0.5, 0.5, 0.5, 0.5]]),
            "loss_mask": torch.tensor([[False, True, True, True]]),
            "teacher_logprobs": torch.tensor([[float("nan"), -1.0, float("nan"), -3.0]]),
            "teacher_mask": torch.tensor([[False, True, False, True]]),
        },
        batch_size=[1],
    )
    student = torch.tensor([[0.0, -2.0, -2.0, -1.0]])
    alone, metrics = with_distillation(tensors, student, DistillConfig("t", coef=1.0, grpo=0.0))
    assert alone["advantages"].tolist() == [[0.0, 1.0, 0.0, -2.0]]  # teacher - student
    read = {name: float(value) for name, value in metrics.items()}
    assert read == {"reverse_kl": pytest.approx((-1.0 + 2.0) / 2), "teacher_tokens": 2.0}
    mixed, _ = with_distillation(tensors, student, DistillConfig("t", coef=0.5, grpo=1.0))
    # An unscored generated token keeps its GRPO advantage only.
    assert mixed["advantages"].tolist() == [[0.5, 1.0, 0.5, -0.5]]
    assert tensors["advantages"].tolist() == [[0.5] * 4]  # the batch itself is unchanged


async def _scored_rows(store: EventStore, n: int, *, score: bool = True) -> list[dict[str, Any]]:
    rows = [
        sample_row(
            session_id=f"s{k}",
            group_id="g",
            reward=float(k % 2),
            prompt=(1, 2, 3),
            completion=(4 + k, 5, 6),
        )
        for k in range(n)
    ]
    await store_samples(store, rows)
    if score:
        for k, row in enumerate(rows):
            await score_row(store, row, -float(k + 1))
    return rows


async def score_row(store: EventStore, row: dict[str, Any], value: float) -> None:
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    event = scored_event(
        sample_id=row["sample_id"], session_id=row["session_id"], run_id=row["run_id"],
        source="t", token_bytes=row["token_ids"], loss_mask=mask,
        behaviour_logprobs=np.frombuffer(row["logprobs"], "<f4"),
        arrays={LOGPROBS: np.array([value, value - 0.5, value - 1.0], np.float32)},
    )  # fmt: skip
    await store.append(sample_stream(row["sample_id"]), [event])


async def test_replay_batches_carry_the_teachers_logprobs_aligned(store: EventStore) -> None:
    rows = await _scored_rows(store, 4)
    [batch] = [b async for b in replay(store, batch_size=4, teacher="t", shuffle=False)]
    by_id = {r["sample_id"]: k for k, r in enumerate(rows)}
    for r, entry in enumerate(batch.get_non_tensor("samples")):
        k = by_id[uuid.UUID(entry["sample_id"])]
        teacher = batch["teacher_logprobs"][r, :6]
        assert teacher[:3].tolist() == [0.0] * 3
        assert teacher[3:].tolist() == [-(k + 1), -(k + 1.5), -(k + 2)]
        assert batch["teacher_mask"][r].tolist() == [False] * 3 + [True] * 3
    [plain] = [b async for b in replay(store, batch_size=4, shuffle=False)]
    assert not plain["teacher_mask"].any() and not plain["teacher_logprobs"].any()


async def test_a_replay_refuses_samples_the_teacher_has_not_scored(store: EventStore) -> None:
    await _scored_rows(store, 2, score=False)
    with pytest.raises(BadSelection, match="has not scored 2 selected samples"):
        _ = [b async for b in replay(store, batch_size=2, teacher="t")]


async def test_the_recipe_distills_from_the_named_teachers_scores(
    store: EventStore, tmp_path: Any
) -> None:
    from trajstore.tiny_model import build_tiny_model
    from trajstore.trainer.recipe import RecipeConfig, train_steps

    model_dir = build_tiny_model(tmp_path / "model")
    await _scored_rows(store, 4)
    learner = LearnerConfig(device="cpu", distill=DistillConfig("t", coef=1.0, grpo=0.0))
    [step] = await train_steps(store, "run-1", model_dir, 1, training_run="d",
                               config=RecipeConfig(batch_size=4, learner=learner))  # fmt: skip
    assert step["teacher_tokens"] == 12  # 4 samples x 3 generated tokens, each scored
    assert step["reverse_kl"] != 0.0
    # A teacher that scored none of them: refused, not a distillation term of zero.
    other = LearnerConfig(device="cpu", distill=DistillConfig("nobody"))
    with pytest.raises(BadSelection, match="has not scored"):
        await train_steps(store, "run-1", model_dir, 1, training_run="e",
                          config=RecipeConfig(batch_size=4, learner=other))  # fmt: skip


async def test_the_verl_batch_and_the_trl_dataset_carry_them(store: EventStore) -> None:
    from trajstore.trainer.verl_batch import verl_batch

    rows = await _scored_rows(store, 2)
    batch = await verl_batch(store, teacher="t", shuffle=False)
    assert batch is not None
    first = [r["sample_id"] for r in rows].index(uuid.UUID(batch.non_tensor_batch["sample_id"][0]))
    assert batch.batch["teacher_mask"][0].tolist() == [1, 1, 1]
    assert batch.batch["teacher_log_probs"][0].tolist() == [
        -(first + 1), -(first + 1.5), -(first + 2)
    ]  # fmt: skip
    table = await read_samples_table(store, teacher="t")
    values = table.column("teacher_logprobs").to_pylist()[0]
    assert np.isnan(values[:3]).all() and not np.isnan(values[3:]).any()


async def test_the_live_replay_waits_for_a_samples_score(store: EventStore) -> None:
    rows = await _scored_rows(store, 2, score=False)
    got: list[Any] = []

    async def tail() -> None:
        async for batch, _ in replay_live(
            store, Selection(), batch_size=2, teacher="t", poll_interval=0.05
        ):
            got.append(batch)
            return

    task = asyncio.create_task(tail())
    await asyncio.sleep(1.0)
    assert got == [] and not task.done()  # held: no score yet
    for row in rows:
        await score_row(store, row, -1.0)
    await asyncio.wait_for(task, 10)
    assert got[0]["teacher_mask"].sum() == 6

    # A score that never comes: the sample goes on without one after `teacher_wait`.
    more = [
        sample_row(session_id=f"late{k}", run_id="late", group_id="h", reward=float(k))
        for k in range(2)
    ]
    await store_samples(store, more)
    stream = replay_live(store, Selection(runs=("late",)), batch_size=2,
                         teacher="t", teacher_wait=0.3, poll_interval=0.05)  # fmt: skip
    batch, _ = await asyncio.wait_for(anext(stream), 10)
    await stream.aclose()
    assert not batch["teacher_mask"].any()


@pytest.mark.slow
async def test_distillation_moves_the_student_toward_the_teacher(tmp_path: Any) -> None:
    """On the generated tiny model: steps of distillation alone lower the reverse KL to a
    teacher (another seed's weights, the same tokenizer) on the student's sampled tokens."""
    from transformers import AutoModelForCausalLM

    from trajstore.tiny_model import build_tiny_model, reweighted_copy
    from trajstore.trainer.collate import ReplaySample, collate

    student_dir = build_tiny_model(tmp_path / "student", seed=0)
    teacher_dir = reweighted_copy(student_dir, tmp_path / "teacher", seed=3)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    learner = Learner.load(
        student_dir, LearnerConfig(lr=1e-2, distill=DistillConfig("t", coef=1.0, grpo=0.0))
    )
    rng = np.random.default_rng(0)
    samples = []
    for k in range(8):
        ids = rng.integers(3, 500, 24).astype(np.int32)
        mask = np.array([0] * 8 + [1] * 16, np.uint8)
        with torch.no_grad():
            behaviour = token_logprobs(
                learner.model(torch.tensor(ids[None])).logits, torch.tensor(ids[None])
            )[0]
            lp = token_logprobs(teacher(torch.tensor(ids[None])).logits, torch.tensor(ids[None]))[0]
        lp = np.where(mask == 1, lp.numpy(), np.nan).astype(np.float32)
        samples.append(ReplaySample(uuid.uuid4(), f"s{k}", ids, mask, behaviour.numpy() * mask,
                                    0.0, 0.0, 0, 0, teacher_logprobs=lp))  # fmt: skip
    batch = collate([[s] for s in samples])
    kls = [learner.step(learner.prepare(batch))["reverse_kl"] for _ in range(6)]
    assert kls[-1] < kls[0] * 0.8, kls
