"""A selection read as a Ray Dataset and split across workers, on a local Ray with 2 CPUs and a
real PostgreSQL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import ray

from tests.trainer.rows import insert_samples, sample_row
from trajstore.store import EventStore
from trajstore.trainer.ray_data import read_samples, split_for_workers
from trajstore.trainer.selection import Selection

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def write(database_url: str, rows: list[dict[str, Any]]) -> None:
    async def insert() -> None:
        async with await EventStore.open(database_url) as store, store.pool.acquire() as conn:
            await insert_samples(conn, rows)

    asyncio.run(insert())


def selected_rows() -> list[dict[str, Any]]:
    """30 samples of run-1 with completions of different lengths (2 to 8 tokens)."""
    return [
        sample_row(session_id=f"s-{i}", completion=list(range(10, 12 + i % 7)), reward=i / 10)
        for i in range(30)
    ]


@ray.remote(num_cpus=0)  # consumers take no CPU, so both read tasks can run beside them
def consume(shard: Any) -> list[dict[str, Any]]:
    """What one trainer worker sees: every row of its shard, arrays as lists."""
    seen = []
    for batch in shard.iter_batches(batch_size=4, batch_format="numpy"):
        for i, sample_id in enumerate(batch["sample_id"]):
            seen.append(
                {
                    "sample_id": str(sample_id),
                    "reward": float(batch["reward"][i]),
                    "token_ids": np.asarray(batch["token_ids"][i]).tolist(),
                    "loss_mask": np.asarray(batch["loss_mask"][i]).tolist(),
                    "logprobs": np.asarray(batch["logprobs"][i]).tolist(),
                }
            )
    return seen


def test_shards_are_disjoint_and_together_the_selection(local_ray: None, database_url: str) -> None:
    rows = selected_rows()
    left_out = [
        sample_row(session_id="other-run", run_id="run-2"),
        sample_row(session_id="aborted", status="aborted"),
    ]
    write(database_url, rows + left_out)

    dataset = read_samples(database_url, Selection(runs=("run-1",)), seed=3, rows_per_block=4)
    shards = split_for_workers(dataset, 2)
    first, second = ray.get([consume.remote(shard) for shard in shards])

    print(f"shard sizes: {len(first)}, {len(second)}")  # shown with -s
    ids = [r["sample_id"] for r in first + second]
    assert len(ids) == len(set(ids))  # no sample twice, within a shard or across
    assert {r["sample_id"] for r in first}.isdisjoint(r["sample_id"] for r in second)
    assert set(ids) == {str(r["sample_id"]) for r in rows}  # all of the selection, nothing else
    stored = {str(r["sample_id"]): r for r in rows}
    for seen in first + second:
        row = stored[seen["sample_id"]]
        assert seen["token_ids"] == np.frombuffer(row["token_ids"], "<i4").tolist()
        assert seen["loss_mask"] == list(row["loss_mask"])
        assert seen["logprobs"] == np.frombuffer(row["logprobs"], "<f4").tolist()
        assert seen["reward"] == row["reward"]


def test_a_sample_that_leaves_the_projection_while_reading_is_an_error(
    local_ray: None, database_url: str
) -> None:
    rows = selected_rows()[:6]
    write(database_url, rows)
    dataset = read_samples(database_url, rows_per_block=2)  # lazy: nothing read yet

    async def discard_one() -> None:
        async with await EventStore.open(database_url) as store:
            await store.pool.execute(
                "DELETE FROM samples WHERE sample_id = $1", rows[4]["sample_id"]
            )

    asyncio.run(discard_one())
    with pytest.raises(Exception, match="left projection version") as raised:
        dataset.take_all()
    assert str(rows[4]["sample_id"]) in str(raised.value)


def test_an_empty_selection_is_an_empty_dataset(local_ray: None, database_url: str) -> None:
    write(database_url, selected_rows()[:2])
    assert read_samples(database_url, Selection(runs=("no-such-run",))).count() == 0
