"""The samples read API: every read of the `samples` table outside the projector, by name.

The projector writes `samples` (`store.projection`, its SQL in `store.queries`); everything else
that reads them (the trainer's replay, its ledger and datasets, the viewer, the demo, the live
loop) calls a function here, so the table has one owner and its columns one place to change.

A selection of samples (`SampleCriteria`, which `trainer.selection.Selection` checks) becomes
one SQL condition in `where`; its values are asyncpg parameters,
never text. Each reader takes the store, or (for a worker with a connection of its own, such as
a Ray task) an asyncpg connection.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import asyncpg

from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.eventstore import EventStore
from trajstore.store.queries import SERVED_SAMPLES_VERSION

#: Where samples are read from: the store's pool, or one connection.
Source: TypeAlias = "EventStore | asyncpg.Connection"


@dataclass(frozen=True)
class SampleCriteria:
    """What a selection of samples says; `trainer.selection.Selection` checks and documents
    each criterion (every one left at its default selects everything)."""

    runs: tuple[str, ...] = ()
    since: datetime | None = None
    until: datetime | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    statuses: tuple[str, ...] = ("completed",)
    tags: tuple[str, ...] = ()
    final_only: bool = False
    rollouts: bool = False
    max_staleness: int | None = None
    current_policy_version: int | None = None
    projection_version: int | None = None


#: A lineage's last branch (`store.samples.rollout_rows`), over the unaliased `samples` table.
_LINEAGE_TIP = (
    "alternative_of IS NULL AND NOT EXISTS (SELECT 1 FROM samples later "
    "WHERE later.session_id = samples.session_id "
    "AND later.projection_version = samples.projection_version "
    "AND later.lineage = samples.lineage AND later.branch > samples.branch)"
)


def where(criteria: SampleCriteria, first_parameter: int = 1) -> tuple[str, list[Any]]:
    """The SQL condition over `samples` and its arguments, numbered from `$first_parameter`."""
    conditions: list[str] = []
    arguments: list[Any] = []

    def parameter(value: Any, cast: str) -> str:
        arguments.append(value)
        return f"${first_parameter + len(arguments) - 1}::{cast}"

    if criteria.projection_version is None:
        conditions.append(f"projection_version = {SERVED_SAMPLES_VERSION}")
    else:
        conditions.append(f"projection_version = {parameter(criteria.projection_version, 'int4')}")
    conditions.append(f"status = ANY({parameter(list(criteria.statuses), 'text[]')})")
    if criteria.runs:
        conditions.append(f"run_id = ANY({parameter(list(criteria.runs), 'text[]')})")
    if criteria.since is not None:
        conditions.append(f"finished_at >= {parameter(criteria.since, 'timestamptz')}")
    if criteria.until is not None:
        conditions.append(f"finished_at < {parameter(criteria.until, 'timestamptz')}")
    if criteria.min_policy_version is not None:
        low = parameter(criteria.min_policy_version, "int8")
        conditions.append(f"policy_version_min >= {low}")
    if criteria.max_policy_version is not None:
        high = parameter(criteria.max_policy_version, "int8")
        conditions.append(f"policy_version_max <= {high}")
    if criteria.min_reward is not None:
        conditions.append(f"reward >= {parameter(float(criteria.min_reward), 'float8')}")
    if criteria.max_reward is not None:
        conditions.append(f"reward <= {parameter(float(criteria.max_reward), 'float8')}")
    if criteria.tags:
        conditions.append(f"tags @> {parameter(list(criteria.tags), 'text[]')}")
    if criteria.final_only:
        conditions.append("is_final")
    if criteria.rollouts:
        conditions.append(_LINEAGE_TIP)
    if criteria.max_staleness is not None and criteria.current_policy_version is not None:
        oldest = criteria.current_policy_version - criteria.max_staleness
        conditions.append(f"policy_version_min >= {parameter(oldest, 'int8')}")
    return " AND ".join(conditions), arguments


# -- the statements ------------------------------------------------------------------------------

#: What a replay needs to order and batch samples, before reading their arrays.
SELECT_INDEX = """
SELECT sample_id, session_id, group_id, reward, octet_length(token_ids) / 4 AS n_tokens,
       policy_version_min, projection_version
FROM samples
WHERE {where}
ORDER BY sample_id
"""

#: The arrays of the given samples, in one projection version.
READ_ARRAYS = """
SELECT sample_id, token_ids, loss_mask, logprobs, version_spans FROM samples
WHERE projection_version = $1 AND sample_id = ANY($2::uuid[])
"""

#: The turn-level side data of the given samples (`store.side_data`: routed experts).
READ_SIDE = """
SELECT sample_id, side, side_data FROM samples
WHERE projection_version = $1 AND sample_id = ANY($2::uuid[]) AND side IS NOT NULL
"""

#: The given samples in the served projection version (the ledger rebuilds a step from these).
READ_SERVED_SAMPLES = f"""
SELECT sample_id, session_id, group_id, reward, token_ids, loss_mask, logprobs, version_spans,
       policy_version_min, projection_version
FROM samples
WHERE projection_version = {SERVED_SAMPLES_VERSION}
  AND sample_id = ANY($1::uuid[])
"""

#: The images of the given samples in the served projection version (`trainer.vision`).
READ_SAMPLE_IMAGES = f"""
SELECT sample_id, session_id, images FROM samples
WHERE projection_version = {SERVED_SAMPLES_VERSION}
  AND sample_id = ANY($1::uuid[])
"""

# Samples in the order their projector committed them, never past the oldest transaction still
# in flight: the same rule as the event log's READ_ALL, so a slow commit is never skipped.
TAIL = """
SELECT sample_id, session_id, group_id, reward, token_ids, loss_mask, logprobs, version_spans,
       policy_version_min, projection_version, projected_tx, projected_seq
FROM samples
WHERE {where}
  AND (projected_tx, projected_seq) > (${tx}::xid8, ${seq}::int8)
  AND projected_tx < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY projected_tx, projected_seq
LIMIT ${limit}
"""

#: The selected samples, one row each, in sample id order (a TRL dataset's rows).
SELECT_DATASET = """
SELECT sample_id, session_id, run_id, task_id, group_id, lineage, role, branch, is_final, status,
       finish_reason, reward, policy_version_min, prompt_len, token_ids, loss_mask, logprobs,
       version_spans
FROM samples
WHERE {where}
ORDER BY sample_id
"""

#: The session's rows in the served samples projection (what the viewer shows of them).
SESSION_SAMPLES = f"""
SELECT sample_id, branch, alternative_of, projection_version, projected_at
FROM samples
WHERE session_id = $1
  AND projection_version = {SERVED_SAMPLES_VERSION}
ORDER BY branch, alternative_of NULLS FIRST
"""

#: How many of the run's sessions have samples in the served projection version.
RUN_SESSIONS_WITH_SAMPLES = f"""
SELECT count(DISTINCT session_id) FROM samples
WHERE run_id = $1 AND projection_version = {SERVED_SAMPLES_VERSION}
"""

#: How many of the run's samples come from completed sessions (served projection version).
RUN_COMPLETED_SAMPLES = f"""
SELECT count(*) FROM samples
WHERE run_id = $1 AND status = 'completed' AND projection_version = {SERVED_SAMPLES_VERSION}
"""

#: (policy version, sessions, mean reward) of a run's default samples, by the version.
RUN_REWARDS_BY_VERSION = f"""
SELECT policy_version_min AS v, count(*) AS n, avg(reward) AS r FROM samples
WHERE run_id = $1 AND is_final AND projection_version = {SERVED_SAMPLES_VERSION}
GROUP BY 1 ORDER BY 1
"""


# -- the readers ---------------------------------------------------------------------------------


async def _fetch(source: Source, query: str, *arguments: Any) -> list[asyncpg.Record]:
    async with unavailable_as_store_error():
        if isinstance(source, EventStore):
            return list(await source.pool.fetch(query, *arguments))
        return list(await source.fetch(query, *arguments))


async def read_index(source: Source, criteria: SampleCriteria) -> list[asyncpg.Record]:
    """The selected samples' ids, sessions, groups, rewards, lengths and projection version,
    sorted by id (`SELECT_INDEX`)."""
    condition, arguments = where(criteria)
    return await _fetch(source, SELECT_INDEX.format(where=condition), *arguments)


async def read_arrays(
    source: Source, version: int, ids: Sequence[uuid.UUID]
) -> list[asyncpg.Record]:
    """(sample_id, token_ids, loss_mask, logprobs) of the given samples of one projection
    version; a sample removed meanwhile is missing."""
    return await _fetch(source, READ_ARRAYS, version, list(ids))


async def read_side(source: Source, version: int, ids: Sequence[uuid.UUID]) -> list[asyncpg.Record]:
    """(sample_id, side, side_data) of the given samples that have turn-level side data."""
    return await _fetch(source, READ_SIDE, version, list(ids))


async def read_served(source: Source, ids: Sequence[uuid.UUID]) -> list[asyncpg.Record]:
    """The given samples, arrays included, in the served projection version."""
    return await _fetch(source, READ_SERVED_SAMPLES, list(ids))


async def read_images(source: Source, ids: Sequence[uuid.UUID]) -> list[asyncpg.Record]:
    """(sample_id, session_id, images) of the given samples, served projection version."""
    return await _fetch(source, READ_SAMPLE_IMAGES, list(ids))


async def read_tail(
    source: Source, criteria: SampleCriteria, after: tuple[int, int], limit: int
) -> list[asyncpg.Record]:
    """Up to `limit` selected samples projected after `after` (projected_tx, projected_seq), in
    commit order, never past a transaction still in flight."""
    condition, arguments = where(criteria)
    n = len(arguments)
    query = TAIL.format(where=condition, tx=n + 1, seq=n + 2, limit=n + 3)
    return await _fetch(source, query, *arguments, after[0], after[1], limit)


async def read_dataset(source: Source, criteria: SampleCriteria) -> list[asyncpg.Record]:
    """The selected samples, every column a dataset row needs (`SELECT_DATASET`)."""
    condition, arguments = where(criteria)
    return await _fetch(source, SELECT_DATASET.format(where=condition), *arguments)


async def session_samples(source: Source, session_id: str) -> list[asyncpg.Record]:
    """The session's rows in the served projection: ids, branches, when they were projected."""
    return await _fetch(source, SESSION_SAMPLES, session_id)


async def sessions_with_samples(source: Source, run_id: str) -> int:
    """How many of the run's sessions the projector has made samples of."""
    [row] = await _fetch(source, RUN_SESSIONS_WITH_SAMPLES, run_id)
    return int(row[0])


async def completed_samples(source: Source, run_id: str) -> int:
    """How many samples of the run come from completed sessions."""
    [row] = await _fetch(source, RUN_COMPLETED_SAMPLES, run_id)
    return int(row[0])


async def rewards_by_version(source: Source, run_id: str) -> list[tuple[int, int, float]]:
    """(policy version, sessions, mean reward) of a run's default samples, by the version that
    made them; samples of a version that is not an integer are left out."""
    rows = await _fetch(source, RUN_REWARDS_BY_VERSION, run_id)
    return [(int(r["v"]), int(r["n"]), float(r["r"])) for r in rows if r["v"] is not None]
