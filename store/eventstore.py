"""The event log: append with optimistic concurrency and idempotency, read, subscribe.

Appends made here are durable when they return (one transaction each). For the proxy's hot path
use `EventStore.writer()`, which batches many events into one transaction in the background.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import asyncpg

from trajstore.store import queries
from trajstore.store.connection import create_pool, unavailable_as_store_error
from trajstore.store.errors import BadEvent, ConcurrencyError, DuplicateEventError, SchemaNotReady
from trajstore.store.events import ExpectedVersion, NewEvent, RecordedEvent, check_stream_id
from trajstore.store.subscription import Subscription
from trajstore.store.writer import EventWriter

#: How often `append` retries after losing a race that may have been its own retry.
_APPEND_ATTEMPTS = 3


def insert_columns(
    stream_id: str, first_version: int, events: Sequence[NewEvent]
) -> list[list[Any]]:
    """The APPEND statement's parameters: one array per column, events in order."""
    return [
        [e.event_id for e in events],
        [stream_id] * len(events),
        list(range(first_version, first_version + len(events))),
        [e.session_id for e in events],
        [e.run_id for e in events],
        [e.type.value for e in events],
        [e.payload_json for e in events],
        [e.token_bytes for e in events],
        [e.logprob_bytes for e in events],
        [e.side_data for e in events],
    ]


log = logging.getLogger(__name__)


class EventStore:
    """The append-only event log in PostgreSQL.

    Open it with `await EventStore.open(url)` (or `async with await EventStore.open(url)`).
    """

    def __init__(self, pool: asyncpg.Pool, url: str) -> None:
        self.pool = pool
        self.url = url

    @classmethod
    async def open(cls, url: str, *, min_size: int = 1, max_size: int = 10) -> EventStore:
        """Connect to the store at `url`; `SchemaNotReady` when it has not been migrated."""
        pool = await create_pool(url, min_size=min_size, max_size=max_size)
        store = cls(pool, url)
        try:
            async with unavailable_as_store_error():
                present = await pool.fetchval(queries.SCHEMA_PRESENT)
            if not present:
                raise SchemaNotReady()
        except BaseException:
            await pool.close()
            raise
        return store

    async def close(self) -> None:
        """Close every connection of the pool."""
        await self.pool.close()

    async def __aenter__(self) -> EventStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- the parts' own queries ------------------------------------------------------------------
    # Each part keeps its SQL in one place and runs it here, by name: the pool and the mapping of
    # its failures to `StoreUnavailable` stay the store's (nothing else touches the pool).

    async def fetch(self, query: str, *arguments: Any) -> list[asyncpg.Record]:
        """The rows of one query."""
        async with unavailable_as_store_error():
            return list(await self.pool.fetch(query, *arguments))

    async def fetchrow(self, query: str, *arguments: Any) -> asyncpg.Record | None:
        """The first row of one query, or None."""
        async with unavailable_as_store_error():
            row: asyncpg.Record | None = await self.pool.fetchrow(query, *arguments)
            return row

    async def fetchval(self, query: str, *arguments: Any) -> Any:
        """The first column of the first row of one query."""
        async with unavailable_as_store_error():
            return await self.pool.fetchval(query, *arguments)

    async def execute(self, query: str, *arguments: Any) -> str:
        """Run one statement; its status."""
        async with unavailable_as_store_error():
            status: str = await self.pool.execute(query, *arguments)
            return status

    # -- appending ----------------------------------------------------------------------------

    async def append(
        self,
        stream_id: str,
        events: Sequence[NewEvent],
        *,
        expected_version: int = ExpectedVersion.ANY,
    ) -> list[int]:
        """Append `events` to a stream in one transaction and return their global positions.

        `expected_version` is the stream's version before this append: `ExpectedVersion.ANY`
        appends at the end, `ExpectedVersion.NO_STREAM` (0) requires a new stream, and any other
        number must equal the stream's current version or `ConcurrencyError` is raised.
        Retrying a batch that was already stored (same event ids, same stream, same order)
        returns the original positions and stores nothing again.
        """
        check_stream_id(stream_id)
        if not events:
            raise BadEvent("append needs at least one event")
        for e in events:
            if not isinstance(e, NewEvent):
                raise BadEvent(f"append takes NewEvent objects, got {type(e).__name__}")
        ids = [e.event_id for e in events]
        if len(set(ids)) != len(ids):
            raise BadEvent("the batch contains the same event id twice")
        if expected_version < ExpectedVersion.ANY:
            raise BadEvent(f"expected_version must be >= -1, got {expected_version}")

        for attempt in range(_APPEND_ATTEMPTS):
            try:
                async with unavailable_as_store_error(), self.pool.acquire() as conn:
                    return await self._append_once(conn, stream_id, events, expected_version)
            except asyncpg.UniqueViolationError:
                # Someone appended to the stream, or stored one of these ids, between our check
                # and our insert. The next attempt tells an idempotent retry from a conflict.
                if attempt == _APPEND_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    async def _append_once(
        self,
        conn: asyncpg.Connection,
        stream_id: str,
        events: Sequence[NewEvent],
        expected_version: int,
    ) -> list[int]:
        ids = [e.event_id for e in events]
        async with conn.transaction():
            stored = await conn.fetch(queries.FIND_EVENTS, ids)
            if stored:
                return _positions_of_stored_batch(stream_id, ids, stored)
            if expected_version == ExpectedVersion.ANY:
                await conn.execute(queries.LOCK_STREAM, stream_id)
            current = await conn.fetchval(queries.STREAM_VERSION, stream_id)
            if expected_version != ExpectedVersion.ANY and current != expected_version:
                raise ConcurrencyError(stream_id, expected_version, current)
            rows = await conn.fetch(queries.APPEND, *insert_columns(stream_id, current + 1, events))
        by_id = {row[0]: row[1] for row in rows}
        return [by_id[i] for i in ids]

    # -- reading ------------------------------------------------------------------------------

    async def read_stream(
        self, stream_id: str, *, after_version: int = 0, limit: int | None = None
    ) -> list[RecordedEvent]:
        """The events of one stream in version order, after `after_version`."""
        async with unavailable_as_store_error():
            events: list[RecordedEvent] = await self.pool.fetch(
                queries.READ_STREAM, stream_id, after_version, limit, record_class=RecordedEvent
            )
        return events

    async def read_session(self, session_id: str) -> list[RecordedEvent]:
        """Every event of a session, across all its streams, in the log's global order."""
        async with unavailable_as_store_error():
            events: list[RecordedEvent] = await self.pool.fetch(
                queries.READ_SESSION, session_id, record_class=RecordedEvent
            )
        return events

    async def count_session_events(self, session_id: str) -> int:
        """How many events the session has (it changed since when this changed)."""
        async with unavailable_as_store_error():
            return int(await self.pool.fetchval(queries.COUNT_SESSION_EVENTS, session_id))

    async def read_all(self, *, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """Up to `limit` events in global order, after the event at position `after` (0: start).

        Never passes a transaction still in flight: what it returns is final, so the last
        position returned is a safe checkpoint for the next call.
        """
        async with unavailable_as_store_error(), self.pool.acquire() as conn:
            tx_id = await queries.tx_id_of(conn, after)
            events: list[RecordedEvent] = await conn.fetch(
                queries.READ_ALL, tx_id, after, limit, record_class=RecordedEvent
            )
        return events

    async def horizon(self) -> tuple[int, int]:
        """The point in global order (tx_id, position) below which nothing can appear any more."""
        async with unavailable_as_store_error():
            return int(await self.pool.fetchval(queries.SNAPSHOT_XMIN)), 0

    async def read_types(
        self, types: list[str], *, after: tuple[int, int], limit: int = 1000
    ) -> list[RecordedEvent]:
        """Events of these types after the point `after` = (tx_id, position), in global order
        and below the horizon (the read_all rules); session facts come from an index of their
        own, so following them skips the tokens in between."""
        if not types:
            return []
        async with unavailable_as_store_error():
            events: list[RecordedEvent] = await self.pool.fetch(
                queries.read_types(types), after[0], after[1], limit, record_class=RecordedEvent
            )
        return events

    async def settle(self, timeout: float = 10.0) -> bool:
        """Wait until everything committed before this call is below the readers' horizon.

        Readers stop below the oldest write transaction in flight *in the whole PostgreSQL
        cluster* (see `queries.READ_ALL`), so an unrelated long transaction, even in another
        database, holds them back. Returns False (and logs who is in the way) after `timeout`.
        """
        async with unavailable_as_store_error(), self.pool.acquire() as conn:
            target = await conn.fetchval(queries.SNAPSHOT_XMAX)
            deadline = asyncio.get_running_loop().time() + timeout
            while await conn.fetchval(queries.SNAPSHOT_XMIN) < target:
                if asyncio.get_running_loop().time() > deadline:
                    blockers = await conn.fetch(queries.OLDEST_WRITERS)
                    log.warning(
                        "readers are held back by transactions still open: %s",
                        ", ".join(
                            f"pid {r['pid']} in {r['datname']} ({r['age']})" for r in blockers
                        )
                        or "(gone)",
                    )
                    return False
                await asyncio.sleep(0.02)
        return True

    async def head(self) -> int:
        """The highest position stored so far (0 when empty)."""
        async with unavailable_as_store_error():
            return int(await self.pool.fetchval(queries.HEAD_POSITION))

    def subscribe(self, *, after: int = 0, **options: Any) -> Subscription:
        """Every event after position `after`: first those stored, then live ones as they commit.

        See `store.subscription.Subscription` for the options and guarantees.
        """
        return Subscription(self.url, after=after, **options)

    def writer(self, **options: Any) -> EventWriter:
        """A batched background writer on this store; see `store.writer.EventWriter`."""
        return EventWriter(self.url, **options)


def _positions_of_stored_batch(
    stream_id: str, ids: list[uuid.UUID], stored: Sequence[asyncpg.Record]
) -> list[int]:
    """Positions of a batch that is already stored, or an error if it is a different batch."""
    found = {row["event_id"]: row for row in stored}
    rows = [found.get(i) for i in ids]
    if any(r is None for r in rows):
        raise DuplicateEventError(
            f"{len(found)} of the {len(ids)} event ids are already stored; "
            "a retried batch must be resent whole and unchanged"
        )
    versions = [r["stream_version"] for r in rows if r is not None]
    same_stream = all(r is not None and r["stream_id"] == stream_id for r in rows)
    consecutive = versions == list(range(versions[0], versions[0] + len(versions)))
    if not (same_stream and consecutive):
        raise DuplicateEventError(
            f"the event ids are already stored, but not as this batch on stream {stream_id!r}"
        )
    return [r["position"] for r in rows if r is not None]
