"""The samples projection: finished sessions of the log, turned into training samples.

The projector follows the log like any consumer, in (tx_id, position) order below the horizon,
but reads only the facts that change a session's samples (finished, discarded, rewarded). For
each session they touch it rebuilds the session from all its events (`store.sessions`), builds
its samples (`store.samples`) and replaces that session's rows, then moves its checkpoint: all in
one transaction, so a projector killed at any point resumes with no sample lost or doubled.

Discarded and unfinished sessions have no samples; failed, aborted and timed-out ones do, with
their status (the trainer leaves them out by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import asyncpg

from store import queries
from store.connection import close_quietly, connect, unavailable_as_store_error
from store.errors import StoreUnavailable
from store.events import EventType, RecordedEvent
from store.eventstore import EventStore
from store.samples import PROJECTION_VERSION, Sample, build_samples
from store.schema import NOTIFY_CHANNEL
from store.sessions import rebuild_session
from store.tokens import encode_logprobs, encode_token_ids

log = logging.getLogger(__name__)

#: The facts after which a session's samples must be (re)built.
SESSION_FACTS = [
    EventType.SESSION_FINISHED.value,
    EventType.SESSION_DISCARDED.value,
    EventType.REWARD_ASSIGNED.value,
]


def sample_row(sample: Sample, last_position: int) -> tuple[Any, ...]:
    """A `samples` row, in `queries.SAMPLE_COLUMNS` order."""
    session = sample.session
    return (
        sample.sample_id,
        PROJECTION_VERSION,
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
        encode_token_ids(sample.token_ids),
        bytes(sample.loss_mask),
        encode_logprobs(sample.logprobs),
        sample.prompt_len,
        sample.response_len,
        len(sample.turns),
        sample.tool_turns,
        sample.policy_versions,
        sample.engines,
        None if sample.divergence is None else sample.divergence.as_json(),
        last_position,
    )


class Projector:
    """Keeps the `samples` table up to date with the log (one checkpoint per name/version)."""

    def __init__(self, store: EventStore, *, name: str = "samples", batch_size: int = 500) -> None:
        self.store = store
        self.name = name
        self.version = PROJECTION_VERSION
        self.batch_size = batch_size

    async def run_once(self) -> int:
        """Project everything committed so far; return how many session projections it made.

        A session counts once per batch that touched it (its reward and its finish may fall in
        two batches); projecting a session again replaces its rows.
        """
        total = 0
        while True:
            async with unavailable_as_store_error(), self.store.pool.acquire() as conn:
                done = await self._project_batch(conn)
            total += done
            if done == 0:
                return total

    async def _project_batch(self, conn: asyncpg.Connection) -> int:
        async with conn.transaction():
            checkpoint = await conn.fetchrow(queries.READ_CHECKPOINT, self.name, self.version)
            tx_id, position = (
                (checkpoint["tx_id"], checkpoint["position"]) if checkpoint else (0, 0)
            )
            facts = await conn.fetch(
                queries.READ_SESSION_FACTS, tx_id, position, SESSION_FACTS, self.batch_size
            )
            if not facts:
                return 0
            sessions = list(dict.fromkeys(row["session_id"] for row in facts if row["session_id"]))
            for session_id in sessions:
                await self._project_session(conn, session_id)
            last = facts[-1]
            await conn.execute(
                queries.WRITE_CHECKPOINT, self.name, self.version, last["tx_id"], last["position"]
            )
            await self.before_commit(conn)
        return len(sessions)

    async def run_forever(self, poll_interval: float = 1.0) -> None:
        """Project what is there, then follow the log: woken by NOTIFY, polling as the truth."""
        wake = asyncio.Event()
        listener: asyncpg.Connection | None = None
        try:
            while True:
                if listener is None or listener.is_closed():
                    try:
                        listener = await connect(
                            self.store.url, application_name="trajstore-projector"
                        )
                        await listener.add_listener(NOTIFY_CHANNEL, lambda *_: wake.set())
                    except StoreUnavailable as exc:
                        log.warning("projector cannot listen (%s); polling", exc)
                        listener = None
                wake.clear()
                try:
                    projected = await self.run_once()
                except StoreUnavailable as exc:
                    log.warning("projector lost PostgreSQL (%s); retrying", exc)
                    projected = 0
                if projected:
                    log.info("projected %d sessions", projected)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), timeout=poll_interval)
        finally:
            await close_quietly(listener)

    async def before_commit(self, conn: asyncpg.Connection) -> None:
        """Called inside the transaction, after everything is written (a hook for tests)."""

    async def _project_session(self, conn: asyncpg.Connection, session_id: str) -> None:
        events = [RecordedEvent(r) for r in await conn.fetch(queries.READ_SESSION, session_id)]
        session = rebuild_session(session_id, events)
        await conn.execute(queries.DELETE_SESSION_SAMPLES, session_id, self.version)
        if session.status == "active" or session.discarded is not None:
            return  # never samples: not finished yet, or excluded from training
        last_position = max(e.position for e in events)
        records = [sample_row(s, last_position) for s in build_samples(session)]
        if records:
            await conn.copy_records_to_table(
                "samples", records=records, columns=queries.SAMPLE_COLUMNS
            )
