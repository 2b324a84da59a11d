"""Uniqueness across days since migration 0017: each day's partition checks its own keys, the
writer's batch is checked against the other days in one statement, closed days are sealed into
`event_keys`, and two writers of one stream across midnight take turns."""

from __future__ import annotations

import asyncio
import datetime as dt

import asyncpg
import pytest

from tests.store.partition_clock import days_ago, days_with_partitions, recorded_on
from trajstore.store import EventStore, EventType, NewEvent, keys, migrations
from trajstore.store.errors import SchemaNotReady, WriteFailed
from trajstore.store.events import new_event_id
from trajstore.store.keys import stream_runs
from trajstore.store.partitions import ensure_partitions, seal_closed_days
from trajstore.store.writer import copy_row


def chunk(session: str = "s1") -> NewEvent:
    return NewEvent(EventType.COMPLETION_CHUNK, session_id=session, token_ids=[1, 2])


async def sealed_keys(store: EventStore, stream: str) -> list[int]:
    rows = await store.pool.fetch(
        "SELECT stream_version FROM event_keys WHERE stream_id = $1 ORDER BY 1", stream
    )
    return [r[0] for r in rows]


def test_a_batch_is_checked_as_its_streams_runs_of_versions() -> None:
    rows = [copy_row(s, v, chunk()) for s, v in [("a", 1), ("a", 2), ("b", 5), ("a", 3), ("a", 5)]]
    assert stream_runs(rows) == (["a", "b", "a", "a"], [1, 5, 3, 5], [2, 5, 3, 5])
    assert stream_runs([]) == ([], [], [])


def test_event_ids_are_time_ordered_uuid7() -> None:
    ids = [new_event_id() for _ in range(1000)]
    assert {i.version for i in ids} == {7} and len(set(ids)) == 1000
    # Sorted by their leading milliseconds, ids made later never sort before earlier ones.
    millis = [i.int >> 80 for i in ids]
    assert millis == sorted(millis)


async def test_sealing_moves_closed_days_keys_and_the_checks_still_refuse_them(
    store: EventStore,
) -> None:
    d1 = days_ago(2)
    await days_with_partitions(store, d1)
    async with recorded_on(store, d1):
        first = await store.append("session-s1", [chunk(), chunk()])
        async with store.writer() as writer:
            writer.append_many("request-r1", 1, [chunk(), chunk(), chunk()])
    assert await sealed_keys(store, "request-r1") == []
    async with store.pool.acquire() as conn:
        through = await seal_closed_days(conn)
        assert await seal_closed_days(conn) is None  # nothing more to seal today
    assert through == dt.datetime.combine(dt.datetime.now(dt.UTC).date(), dt.time(), dt.UTC)
    assert await sealed_keys(store, "request-r1") == [1, 2, 3]
    # Today: the writer's check finds the sealed versions, append finds the sealed ids.
    writer = await store.writer(retry_timeout=1).start()
    writer.append_many("request-r1", 3, [chunk()])
    with pytest.raises(WriteFailed):
        await writer.flush()
    writer.append_many("request-r1", 4, [chunk()])  # the next version is fine
    await writer.close()
    assert [e.stream_version for e in await store.read_stream("request-r1")] == [1, 2, 3, 4]
    batch = await store.read_stream("session-s1")
    assert [e.position for e in batch] == first
    with pytest.raises(asyncpg.UniqueViolationError):  # a plain INSERT: the row trigger
        await store.pool.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type) "
            "VALUES ($1, 'session-other', 1, 'session_created')",
            batch[0].event_id,
        )


async def test_a_row_dated_into_a_sealed_day_is_sealed_at_once(store: EventStore) -> None:
    async with store.pool.acquire() as conn:
        await ensure_partitions(conn, days_ahead=1)  # seals through today's start
        yesterday = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)
        await conn.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, recorded_at) "
            "VALUES ($1, 'request-late', 1, 'completion_chunk', $2)",
            new_event_id(),
            yesterday,
        )
    assert await sealed_keys(store, "request-late") == [1]
    writer = await store.writer(retry_timeout=1).start()
    writer.append_many("request-late", 1, [chunk()])
    with pytest.raises(WriteFailed):
        await writer.flush()
    await writer.close()


async def test_two_writers_of_one_stream_across_midnight_take_turns(store: EventStore) -> None:
    # A transaction stamped yesterday, checked and holding version 1 of the stream, not yet
    # committed; the writer's batch of today (another partition) must wait for it, then see it.
    d1 = days_ago(1)
    await days_with_partitions(store, d1)
    late = await store.pool.acquire()
    try:
        tx = late.transaction()
        await tx.start()
        await late.execute(keys.CHECK_KEYS, ["request-m"], [1], [1])
        await late.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type, recorded_at) "
            "VALUES ($1, 'request-m', 1, 'completion_chunk', $2)",
            new_event_id(),
            dt.datetime.combine(d1, dt.time(23, 59, 59), dt.UTC),
        )
        writer = await store.writer(retry_timeout=1).start()
        writer.append_many("request-m", 1, [chunk()])
        flushed = asyncio.ensure_future(writer.flush())
        await asyncio.sleep(0.5)
        assert not flushed.done()  # waiting for the stream's other writer
        await tx.commit()
        with pytest.raises(WriteFailed):
            await flushed
        await writer.close()
    finally:
        await store.pool.release(late)
    assert [e.stream_version for e in await store.read_stream("request-m")] == [1]


async def test_a_writer_refuses_to_start_on_a_store_not_migrated_for_it(database_url: str) -> None:
    await asyncio.to_thread(migrations.downgrade, database_url, "0016_lineages")
    async with await EventStore.open(database_url) as store:
        with pytest.raises(SchemaNotReady):
            await store.writer().start()
