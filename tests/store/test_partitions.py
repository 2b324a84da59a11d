"""The daily partitions of `events`: routing, one global order across them, uniqueness across
them, partitions made ahead, and the migration that partitions an existing log."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid

import asyncpg
import pytest

from tests.store.partition_clock import days_ago, days_with_partitions, recorded_on
from tests.store.test_schema import catalog
from trajstore.store import ConcurrencyError, EventStore, EventType, NewEvent, migrations
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.errors import DuplicateEventError, WriteFailed
from trajstore.store.partitions import ensure_partitions, list_partitions, partition_name


def event(session: str = "s1", kind: EventType = EventType.SESSION_CREATED) -> NewEvent:
    return NewEvent(kind, session_id=session, payload={"n": 1})


async def insert_raw(store: EventStore, event_id: uuid.UUID) -> None:
    await store.pool.execute(
        "INSERT INTO events (event_id, stream_id, stream_version, event_type) "
        "VALUES ($1, 'session-other', 1, 'session_created')",
        event_id,
    )


async def partition_of(store: EventStore, position: int) -> str:
    return str(
        await store.pool.fetchval(
            "SELECT tableoid::regclass::text FROM events WHERE position = $1", position
        )
    )


async def test_events_land_in_the_partition_of_their_day(store: EventStore) -> None:
    d1, d2 = days_ago(3), days_ago(2)
    await days_with_partitions(store, d1, d2)
    async with recorded_on(store, d1):
        [p1] = await store.append("session-a", [event("a")])
        async with store.writer() as writer:  # the writer's COPY routes alike
            writer.append("session-w", 1, event("w"))
    async with recorded_on(store, d2, hour=23):
        [p2] = await store.append("session-b", [event("b")])
    [p3] = await store.append("session-c", [event("c")])  # today: no partition yet

    assert await partition_of(store, p1) == partition_name(d1)
    [w] = await store.read_stream("session-w")
    assert await partition_of(store, w.position) == partition_name(d1)
    assert await partition_of(store, p2) == partition_name(d2)
    assert await partition_of(store, p3) == "events_default"


async def test_a_reader_spanning_partitions_sees_one_global_order(store: EventStore) -> None:
    # Days written out of order: the global order is the log's (tx_id, position), not the days'.
    days = [days_ago(1), days_ago(4), days_ago(2)]
    await days_with_partitions(store, *days)
    positions = []
    for i, day in enumerate(days * 2):
        async with recorded_on(store, day):
            positions += await store.append(f"session-{i}", [event(str(i)), event(str(i))])
    await store.settle()
    read = await store.read_all(limit=100)
    assert [e.position for e in read] == positions
    assert len({await partition_of(store, p) for p in positions}) == 3
    # A reader resuming mid-way, from a position in another partition, continues in order.
    assert [e.position for e in await store.read_all(after=positions[3])] == positions[4:]
    subscription = store.subscribe()
    seen = []
    try:
        async for e in subscription:
            seen.append(e.position)
            if len(seen) == len(positions):
                break
    finally:
        await subscription.close()
    assert seen == positions


async def test_ids_and_stream_versions_stay_unique_across_partitions(store: EventStore) -> None:
    d1, d2 = days_ago(3), days_ago(2)
    await days_with_partitions(store, d1, d2)
    batch = [event(), event()]
    async with recorded_on(store, d1):
        first = await store.append("session-s1", batch)
    async with recorded_on(store, d2):
        # A retried batch, a day later: the same positions, nothing stored twice.
        assert await store.append("session-s1", batch) == first
        with pytest.raises(ConcurrencyError):
            await store.append("session-s1", [event()], expected_version=1)
        # The writer's COPY of an existing (stream, version) in another partition is refused.
        writer = await store.writer(retry_timeout=1).start()
        writer.append("session-s1", 2, event())
        with pytest.raises(WriteFailed):
            await writer.flush()
        await writer.close()
        # An id stored in another partition is a duplicate, for append and for the table.
        with pytest.raises(DuplicateEventError):
            await store.append("session-other", [batch[0]])
        with pytest.raises(asyncpg.UniqueViolationError):
            await insert_raw(store, batch[0].event_id)
    assert [e.stream_version for e in await store.read_stream("session-s1")] == [1, 2]
    assert await store.pool.fetchval("SELECT count(*) FROM events") == 2


async def test_partitions_are_made_ahead_and_a_day_already_in_default_is_skipped(
    store: EventStore,
) -> None:
    today = dt.datetime.now(dt.UTC).date()
    await store.append("session-a", [event("a")])  # today's, into events_default
    async with store.pool.acquire() as conn:
        created = await ensure_partitions(conn, days_ahead=3)
        assert created == [partition_name(today + dt.timedelta(days=n)) for n in (1, 2, 3)]
        assert await ensure_partitions(conn, days_ahead=3) == []
        names = [p.name for p in await list_partitions(conn)]
    assert names[0] == "events_default" and partition_name(today) not in names
    # The created partitions carry the parent's triggers: an event there is immutable too.
    tomorrow = today + dt.timedelta(days=1)
    async with recorded_on(store, tomorrow):
        [position] = await store.append("session-b", [event("b")])
    assert await partition_of(store, position) == partition_name(tomorrow)
    with pytest.raises(asyncpg.RestrictViolationError):
        await store.pool.execute(f"DELETE FROM {partition_name(tomorrow)}")


async def test_the_migration_partitions_a_log_keeping_positions(database_url: str) -> None:
    expected = await catalog(database_url)
    await asyncio.to_thread(migrations.downgrade, database_url, "0012_process_roles")
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        # An existing log over three days, with a gap in positions (a rolled-back append).
        for i, day in enumerate(["2026-11-01", "2026-11-01", "2026-11-03", "2026-11-07"]):
            if i == 2:
                async with conn.transaction():
                    await conn.execute("SELECT nextval('events_position_seq')")
            await conn.execute(
                "INSERT INTO events (event_id, stream_id, stream_version, session_id, event_type,"
                " recorded_at, payload, token_ids) VALUES ($1, $2, $3, 's1', $4, $5, '{}', $6)",
                uuid.uuid4(), "session-s1", i + 1, "session_created",
                dt.datetime.fromisoformat(day + "T10:00:00+00:00"), b"\x01\x00\x00\x00",
            )  # fmt: skip
        before = await conn.fetch("SELECT * FROM events ORDER BY position")
    finally:
        await conn.close()

    await asyncio.to_thread(migrations.upgrade, database_url)
    migrated = await catalog(database_url)
    assert migrated.pop("partitions") == [
        ("events", f"events_{day}") for day in ("20261101", "20261103", "20261107", "default")
    ]
    expected.pop("partitions")
    assert migrated == expected  # otherwise the schema of a new store, exactly
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        after = await conn.fetch("SELECT * FROM events ORDER BY position")
    finally:
        await conn.close()
    async with await EventStore.open(database_url) as store:
        # The columns the log had before, unchanged (later migrations add columns of their own);
        # a Record iterates over its values, hence keys().
        columns = list(before[0].keys())
        assert [tuple(r[k] for k in columns) for r in after] == [tuple(b) for b in before]
        assert [await partition_of(store, r["position"]) for r in after] == [
            "events_20261101", "events_20261101", "events_20261103", "events_20261107"
        ]  # fmt: skip
        # Appends continue after the highest position, at the stream's next version.
        [position] = await store.append("session-s1", [event()])
        assert position > after[-1]["position"]
        assert (await store.read_stream("session-s1"))[-1].stream_version == 5
        with pytest.raises(asyncpg.UniqueViolationError):  # the keys were moved too
            await insert_raw(store, after[0]["event_id"])
        # The views read the new table: one row per session_created, the new one included.
        assert await store.pool.fetchval("SELECT count(*) FROM trajectories") == 5
