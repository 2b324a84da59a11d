"""The training ledger: a step is recorded once, and its batch rebuilt bit for bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from tensordict import TensorDict

from tests.trainer.rows import sample_row, store_samples
from trajstore.cli import main
from trajstore.store import EventStore
from trajstore.trainer.collate import Layout
from trajstore.trainer.errors import SampleChanged, SampleGone, StepAlreadyRecorded, StepNotFound
from trajstore.trainer.ledger import rebuild_step, record_step
from trajstore.trainer.replay import replay

LAYOUTS = [Layout(batch_size=3), Layout(token_budget=12, pack=True, batch_size=2)]


async def recorded_batches(store: EventStore, layout: Layout) -> list[TensorDict]:
    """Train-time batches of 8 samples (rewards 0..7 in two groups), each recorded as a step."""
    rows = [
        sample_row(session_id=f"s-{i}", group_id=f"g-{i % 2}", reward=float(i),
                   completion=list(range(20, 21 + i % 5)))
        for i in range(8)
    ]  # fmt: skip
    await store_samples(store, rows)
    batches = []
    step = 0
    sizes = {"batch_size": layout.batch_size, "token_budget": layout.token_budget}
    async for batch in replay(store, **sizes, pack=layout.pack, seed=3):
        step += 1
        await record_step(store, "t-1", step, batch, layout=layout,
                          metrics={"loss": 0.25 * step}, model_version=step - 1)  # fmt: skip
        batches.append(batch)
    return batches


def assert_identical(rebuilt: TensorDict, original: TensorDict) -> None:
    assert set(rebuilt.keys()) == set(original.keys())
    for key in original.keys():  # noqa: SIM118 (a TensorDict, not a dict)
        if key == "samples":
            assert rebuilt.get_non_tensor(key) == original.get_non_tensor(key)
        else:
            assert torch.equal(rebuilt[key], original[key]), key
            assert rebuilt[key].dtype == original[key].dtype


@pytest.mark.parametrize("layout", LAYOUTS, ids=["padded", "packed"])
async def test_every_recorded_step_rebuilds_bit_for_bit(store: EventStore, layout: Layout) -> None:
    batches = await recorded_batches(store, layout)
    assert len(batches) >= 2
    for step, original in enumerate(batches, start=1):
        assert_identical(await rebuild_step(store, "t-1", step), original)


async def test_a_step_is_never_recorded_twice(store: EventStore) -> None:
    (first, *_) = await recorded_batches(store, LAYOUTS[0])
    with pytest.raises(StepAlreadyRecorded, match="step 1 of training run 't-1'"):
        await record_step(store, "t-1", 1, first, layout=LAYOUTS[0], metrics={})


async def test_steps_are_recorded_in_order(store: EventStore) -> None:
    (first, *_) = await recorded_batches(store, LAYOUTS[0])
    with pytest.raises(Exception, match="the next one to record is 4, not 9"):
        await record_step(store, "t-1", 9, first, layout=LAYOUTS[0], metrics={})


async def test_missing_runs_and_steps_are_named(store: EventStore) -> None:
    await recorded_batches(store, LAYOUTS[0])
    with pytest.raises(StepNotFound, match="no training run 'nope'"):
        await rebuild_step(store, "nope", 1)
    with pytest.raises(StepNotFound, match="has steps 1 to 3; there is no step 7"):
        await rebuild_step(store, "t-1", 7)


async def test_a_sample_gone_or_changed_since_the_step_is_reported(store: EventStore) -> None:
    (first, *_) = await recorded_batches(store, LAYOUTS[0])
    samples: list[dict[str, Any]] = first.get_non_tensor("samples")
    gone, changed = samples[0]["session_id"], samples[1]["session_id"]
    async with store.pool.acquire() as conn:
        await conn.execute(
            "UPDATE samples SET token_ids = token_ids || '\\x01000000'::bytea "
            "WHERE session_id = $1",
            changed,
        )
    with pytest.raises(SampleChanged, match=f"session '{changed}'"):
        await rebuild_step(store, "t-1", 1)
    async with store.pool.acquire() as conn:
        await conn.execute("DELETE FROM samples WHERE session_id = $1", gone)
    with pytest.raises(SampleGone, match="no longer in the samples projection"):
        await rebuild_step(store, "t-1", 1)


async def test_the_cli_prints_the_step_and_saves_the_same_batch(
    store: EventStore, database_url: str, tmp_path: Path
) -> None:
    (first, *_) = await recorded_batches(store, LAYOUTS[0])
    out = tmp_path / "step1.pt"
    runner = CliRunner()
    args = ["--database-url", database_url, "replay", "--training-run", "t-1", "--step", "1"]
    result = await _invoke(runner, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    for entry in first.get_non_tensor("samples"):
        assert entry["session_id"] in result.output
    assert "loss=0.25" in result.output
    assert_identical(torch.load(out, weights_only=False), first)

    missing = await _invoke(runner, [*args[:-1], "5"])
    assert missing.exit_code == 1
    assert "there is no step 5" in missing.output


async def _invoke(runner: CliRunner, args: list[str]) -> Any:
    """The CLI runs its own event loop: run it in a thread, away from the test's."""
    import asyncio

    return await asyncio.to_thread(runner.invoke, main, args)
