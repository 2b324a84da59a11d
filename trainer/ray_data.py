"""A selection of samples as a Ray Dataset, read in parallel and split across trainer workers.

    import ray
    from trajstore.trainer.ray_data import read_samples, split_for_workers

    dataset = read_samples(database_url, Selection(runs=("run-7",)), seed=0)
    shards = split_for_workers(dataset, n_workers)   # one DataIterator per worker
    # in worker i: for batch in shards[i].iter_batches(batch_size=64): ...

How it reads. The driver reads the selection's index (sample ids and projection version, one
small query: `store.sample_reads.read_index`); the ids, sorted and
optionally shuffled with a seed, are cut into blocks of `rows_per_block`. Each block becomes one
Ray task that fetches its rows from PostgreSQL and decodes the packed bytes (`trainer.arrays`,
as the replay does), so the arrays never pass through the driver and the reading spreads over
the cluster. `ray.data.read_sql` was the other candidate: it takes no typed parameters in the
form `Selection` builds them (asyncpg's `$n::type`), and it shards by hashing a key on the
server rather than by a fixed id list, which a training run wants to know.

Reading ids first pins the set: a sample projected after the index was read is not in this
dataset, and one that leaves the projection meanwhile (a discard, a rebuild) raises `SampleGone`
in the task that misses it, instead of being dropped silently.

Rows: `sample_id`, `session_id`, `group_id`, `reward`, `policy_version_min`, `n_tokens`, and the
arrays `token_ids` (int32), `loss_mask` (uint8), `logprobs` (float32, behaviour logprobs).
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import ray.data

from trajstore.store import sample_reads
from trajstore.store.connection import connect, unavailable_as_store_error
from trajstore.trainer.arrays import Arrays, read_arrays
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.selection import Selection

#: Columns of the index the driver reads, carried into each row as they are.
_INDEX_COLUMNS = ("session_id", "group_id", "reward", "policy_version_min", "n_tokens")


async def _read_index(url: str, selection: Selection) -> list[dict[str, Any]]:
    async with unavailable_as_store_error():
        conn = await connect(url, application_name="trajstore-ray-index")
        try:
            rows = await sample_reads.read_index(conn, selection)
        finally:
            await conn.close()
    return [dict(row) for row in rows]


async def _read_arrays(url: str, version: int, ids: list[uuid.UUID]) -> dict[uuid.UUID, Arrays]:
    async with unavailable_as_store_error():
        conn = await connect(url, application_name="trajstore-ray-read")
        try:
            return await read_arrays(conn, version, ids)
        finally:
            await conn.close()


def _read_block(block: dict[str, np.ndarray], url: str, version: int) -> dict[str, Any]:
    """A Ray task: the rows of one block of the index, with their arrays read and decoded."""
    ids = [uuid.UUID(i) for i in block["sample_id"]]
    found = asyncio.run(_read_arrays(url, version, ids))  # SampleGone when one left meanwhile
    out: dict[str, Any] = {name: block[name] for name in ("sample_id", *_INDEX_COLUMNS)}
    # Object columns of 1-D arrays of varying length: Ray keeps them as variable-shaped tensors.
    for k, name in enumerate(("token_ids", "loss_mask", "logprobs", "token_versions")):
        out[name] = _column([found[i][k] for i in ids])
    return out


def _column(arrays: Sequence[Any]) -> np.ndarray:
    column = np.empty(len(arrays), dtype=object)
    for i, array in enumerate(arrays):
        column[i] = np.array(array)  # a writable copy: the bytes' view is read-only
    return column


def read_samples(
    database_url: str,
    selection: Selection | None = None,
    *,
    seed: int | None = None,
    rows_per_block: int = 256,
) -> ray.data.Dataset:
    """The selected samples as a Ray Dataset, one read task per block of `rows_per_block` ids.

    Ids are sorted, then shuffled with `numpy.random.default_rng(seed)` when a seed is given: the
    same selection over the same rows and seed gives the same blocks. Needs `ray.init()` first
    (or starts a local Ray, as Ray Data does).
    """
    if rows_per_block < 1:
        raise BadSelection(f"rows_per_block must be at least 1, got {rows_per_block}")
    index = asyncio.run(_read_index(database_url, selection or Selection()))
    if seed is not None:
        order = np.random.default_rng(seed).permutation(len(index))
        index = [index[i] for i in order]
    if not index:
        return ray.data.from_items([])
    # SELECT_INDEX reads one projection version (the selection's WHERE pins it).
    version = int(index[0]["projection_version"])
    items = [
        {"sample_id": str(row["sample_id"])} | {name: row[name] for name in _INDEX_COLUMNS}
        for row in index
    ]
    n_blocks = -(-len(items) // rows_per_block)
    dataset = ray.data.from_items(items, override_num_blocks=n_blocks)
    read = functools.partial(_read_block, url=database_url, version=version)
    return dataset.map_batches(read, batch_size=rows_per_block, batch_format="numpy")


def split_for_workers(dataset: ray.data.Dataset, n_workers: int) -> list[Any]:
    """One streaming iterator per trainer worker; every sample goes to exactly one of them.

    `equal=False` on purpose: Ray's `equal=True` makes the shards the same size by dropping the
    rows that do not divide evenly. Which worker gets which block is decided as they read (the
    fastest takes more); consume all iterators at the same time, as workers do.
    """
    if n_workers < 1:
        raise BadSelection(f"n_workers must be at least 1, got {n_workers}")
    return list(dataset.streaming_split(n_workers, equal=False))
