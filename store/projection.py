"""The samples projection: finished sessions of the log, turned into training samples.

The projector follows the log like any consumer, in (tx_id, position) order below the horizon,
but reads only the facts that change a session's samples (finished, discarded, rewarded). For
each session they touch it rebuilds the session from all its events (`store.sessions`), builds
its samples (`store.samples`) and replaces that session's rows, then moves its checkpoint: all in
one transaction, so a projector killed at any point resumes with no sample lost or doubled.

Discarded and unfinished sessions have no samples; failed, aborted and timed-out ones do, with
their status (the trainer leaves them out by default).

Versions: every row carries the projection version it was written for, and `projection_serving`
names the version readers use. A live projector follows the served version. `rebuild()` projects
the whole log into a new version beside it (readers keep the old one meanwhile), then switches
readers over and drops the old rows in one transaction; the live projector picks the new version
up at its next batch. Sample ids do not depend on the version, so a training ledger written
against the old version still finds its samples after a rebuild.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg

from trajstore.store import queries
from trajstore.store.collector import collections_paused
from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.errors import StoreUnavailable
from trajstore.store.events import RecordedEvent
from trajstore.store.eventstore import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.schema import FACTS_CHANNEL
from trajstore.store.sessions import rebuild_session
from trajstore.store.subscription import wake_ups

log = logging.getLogger(__name__)


def _integer_versions(versions: list[str]) -> tuple[int | None, int | None]:
    """Lowest and highest policy version, when every one is an integer (a step number)."""
    try:
        numbers = [int(v) for v in versions]
    except ValueError:
        return None, None
    return (min(numbers), max(numbers)) if numbers else (None, None)


def sample_row(sample: Sample, last_position: int, version: int) -> tuple[Any, ...]:
    """A `samples` row, in `queries.SAMPLE_COLUMNS` order."""
    session = sample.session
    tags = session.metadata.get("tags") if isinstance(session.metadata, dict) else None
    return (
        sample.sample_id,
        version,
        session.session_id,
        session.run_id,
        session.task_id,
        session.group_id,
        sample.branch,
        sample.alternative_of,
        sample.is_final,
        session.status,
        sample.finish_reason,
        session.reward,
        sample.token_bytes,
        sample.mask_bytes(),
        sample.logprob_bytes(),
        sample.prompt_len,
        sample.response_len,
        len(sample.turns),
        sample.tool_turns,
        sample.policy_versions,
        sample.engines,
        None if sample.divergence is None else sample.divergence.as_json(),
        last_position,
        [str(t) for t in tags] if isinstance(tags, list) else [],
        [session.turns[i].request_id for i in sample.turns],
        session.recorded_created_at,
        session.recorded_finished_at,
        *_integer_versions(sample.policy_versions),
        sample.images or None,
        sample.lineage,
        sample.role,
        sample.parent,
        sample.fork_at,
        sample.version_spans or None,
        *sample.side_columns(),
    )


class Projector:
    """Keeps the `samples` table up to date with the log (one checkpoint per name/version)."""

    def __init__(
        self,
        store: EventStore,
        *,
        name: str = "samples",
        version: int | None = None,
        batch_size: int = 500,
    ) -> None:
        self.store = store
        self.name = name
        self.version = version  # None: whichever version readers are served
        self.batch_size = batch_size

    async def run_once(
        self, progress: Callable[[int], None] | None = None, *, settle: float = 10.0
    ) -> int:
        """Project everything committed so far; return how many session projections it made.

        A session counts once per batch that touched it (its reward and its finish may fall in
        two batches); projecting a session again replaces its rows. `progress` is told how many
        facts each batch consumed. It first waits up to `settle` seconds for the readers'
        horizon to pass what was committed before the call (`EventStore.settle`).
        """
        if settle > 0:
            await self.store.settle(settle)
        total = 0
        while True:
            # A batch's rows, sessions and samples all stay alive until it is written: no cyclic
            # collection walks them in the meantime (store.collector).
            with collections_paused():
                async with unavailable_as_store_error(), self.store.pool.acquire() as conn:
                    sessions, facts = await self._project_batch(conn)
            total += sessions
            if progress is not None and facts:
                progress(facts)
            if facts == 0:
                return total

    async def served_version(self) -> int:
        """The version readers are served (version 1 from the first projection on)."""
        async with unavailable_as_store_error(), self.store.pool.acquire() as conn:
            return await self._served_version(conn)

    async def _served_version(self, conn: asyncpg.Connection) -> int:
        version = await conn.fetchval(queries.READ_SERVED_VERSION, self.name)
        if version is None:
            await conn.execute(queries.SERVE_FIRST_VERSION, self.name)
            version = await conn.fetchval(queries.READ_SERVED_VERSION, self.name)
        return int(version)

    async def rebuild(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Project the whole log into a new version, then serve it; return that version.

        Readers keep the served version while the new one is written. The switch (and the
        removal of the old version's rows and checkpoint) is one transaction. `progress` gets
        (facts done, facts in all) as the rebuild goes.
        """
        async with unavailable_as_store_error(), self.store.pool.acquire() as conn:
            served = await self._served_version(conn)
            new = int(await conn.fetchval(queries.LATEST_VERSION, self.name)) + 1
            total = int(await conn.fetchval(queries.COUNT_SESSION_FACTS))
        done = 0

        def advance(facts: int) -> None:
            nonlocal done
            done += facts
            if progress is not None:
                progress(done, max(total, done))

        builder = type(self)(self.store, name=self.name, version=new, batch_size=self.batch_size)
        await builder.run_once(advance)
        async with (
            unavailable_as_store_error(),
            self.store.pool.acquire() as conn,
            conn.transaction(),
        ):
            await conn.execute(queries.SWITCH_SERVED_VERSION, self.name, new)
            await conn.execute(queries.DELETE_VERSION_SAMPLES, served)
            await conn.execute(queries.DELETE_CHECKPOINT, self.name, served)
        log.info("projection %s: version %d rebuilt and served (was %d)", self.name, new, served)
        return new

    async def _project_batch(self, conn: asyncpg.Connection) -> tuple[int, int]:
        async with conn.transaction():
            version = self.version
            if version is None:
                version = await self._served_version(conn)
            checkpoint = await conn.fetchrow(queries.READ_CHECKPOINT, self.name, version)
            tx_id, position = (
                (checkpoint["tx_id"], checkpoint["position"]) if checkpoint else (0, 0)
            )
            # Only the facts that change a session's samples; its other events are read later.
            facts = await conn.fetch(queries.READ_FACTS, tx_id, position, self.batch_size)
            if not facts:
                return 0, 0
            sessions = list(dict.fromkeys(row["session_id"] for row in facts if row["session_id"]))
            await self._project_sessions(conn, sessions, version)
            last = facts[-1]
            await conn.execute(
                queries.WRITE_CHECKPOINT, self.name, version, last["tx_id"], last["position"]
            )
            await self.before_commit(conn)
        return len(sessions), len(facts)

    async def run_forever(self, poll_interval: float = 1.0) -> None:
        """Project what is there, then follow the log: woken by session facts, polling as truth."""
        steps = wake_ups(
            self.store.url,
            FACTS_CHANNEL,
            poll_interval=poll_interval,
            application_name="trajstore-projector",
        )
        async with contextlib.aclosing(steps):  # closes the LISTEN connection when cancelled
            async for _ in steps:
                try:
                    # Woken by a commit: wait for the horizon to pass it (usually at once).
                    projected = await self.run_once(settle=min(poll_interval, 5.0))
                except StoreUnavailable as exc:
                    log.warning("projector lost PostgreSQL (%s); retrying", exc)
                    projected = 0
                if projected:
                    log.info("projected %d sessions", projected)

    async def before_commit(self, conn: asyncpg.Connection) -> None:
        """Called inside the transaction, after everything is written (a hook for tests)."""

    async def _project_sessions(
        self, conn: asyncpg.Connection, session_ids: list[str], version: int
    ) -> None:
        """Replace these sessions' samples: one read, one delete, one COPY for them all."""
        by_session: dict[str, list[RecordedEvent]] = {s: [] for s in session_ids}
        for event in await conn.fetch(
            queries.READ_SESSIONS, session_ids, record_class=RecordedEvent
        ):
            by_session[event.session_id].append(event)
        await conn.execute(queries.DELETE_SESSION_SAMPLES, session_ids, version)

        async def rows() -> AsyncIterator[tuple[Any, ...]]:
            # Built while COPY streams: PostgreSQL stores one session's rows while the next
            # session is folded here.
            for session_id, events in by_session.items():
                session = rebuild_session(session_id, events, packed=True)
                if session.status == "active" or session.discarded is not None:
                    continue  # never samples: not finished yet, or excluded from training
                last_position = max(e.position for e in events)
                for sample in build_samples(session):
                    yield sample_row(sample, last_position, version)

        await conn.copy_records_to_table("samples", records=rows(), columns=queries.SAMPLE_COLUMNS)
