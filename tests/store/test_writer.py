"""The batched background writer: durable on flush, back-pressure, retries without duplicates."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tests.support import chunk_event
from trajstore.store import (
    EventStore,
    EventType,
    EventWriter,
    NewEvent,
    WriteFailed,
    WriterBackpressure,
    WriterClosed,
)
from trajstore.store.connection import connect
from trajstore.store.writer import APPLICATION_NAME

TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database()
"""


async def stored_ids(store: EventStore) -> Counter[str]:
    rows = await store.pool.fetch("SELECT event_id FROM events")
    return Counter(str(r[0]) for r in rows)


async def test_everything_appended_is_durable_after_flush(store: EventStore) -> None:
    async with store.writer(flush_interval=0.002, batch_size=64) as writer:
        events = {
            f"request-{r}": [chunk_event(f"s{r % 3}", seed=r * 100 + i) for i in range(20)]
            for r in range(10)
        }
        for stream, stream_events in events.items():
            writer.append_many(stream, 1, stream_events)
        await writer.flush()
        assert writer.pending == 0
        assert writer.stats.events_written == 200
        assert writer.stats.tokens_written == 200 * 16
        assert writer.stats.batches >= 200 // 64
    for stream, stream_events in events.items():
        got = await store.read_stream(stream)
        assert [e.event_id for e in got] == [e.event_id for e in stream_events]
        assert got[3].token_ids is not None
        assert got[3].token_ids.tobytes() == stream_events[3].token_bytes


async def test_flush_is_a_barrier_for_a_single_session(store: EventStore) -> None:
    async with store.writer(flush_interval=1.0) as writer:  # would linger a whole second
        writer.append("request-1", 1, chunk_event("s1"))
        await asyncio.wait_for(writer.flush(session_id="s1"), timeout=0.5)
        assert len(await store.read_session("s1")) == 1


async def test_a_full_batch_is_written_without_lingering(store: EventStore) -> None:
    # The linger gathers a light load's events into one transaction; a batch that is already
    # full has nothing to wait for, and no flush() is needed to get it written.
    async with store.writer(flush_interval=60.0, batch_size=8) as writer:
        events = [chunk_event("s1", seed=i) for i in range(8)]
        writer.append("request-1", 1, events[0])
        await asyncio.sleep(0.2)  # the writer is lingering over its one event
        assert writer.pending == 1
        writer.append_many("request-1", 2, events[1:])  # now a full batch
        for _ in range(100):
            if writer.pending == 0:
                break
            await asyncio.sleep(0.05)
        assert writer.pending == 0, "a full batch waited for the linger"
        assert len(await store.read_session("s1")) == 8
        writer.append("request-2", 1, chunk_event("s2"))  # less than a batch: it lingers
        await asyncio.sleep(0.3)
        assert writer.pending == 1
        await writer.flush()


async def test_a_full_queue_pushes_back_and_put_waits(store: EventStore, database_url: str) -> None:
    # Another session holds a lock the writer's COPY needs, as a stalled database would.
    blocker = await connect(database_url)
    transaction = blocker.transaction()
    await transaction.start()
    await blocker.execute("LOCK TABLE events IN EXCLUSIVE MODE")
    writer = await store.writer(max_pending=50, batch_size=10, admit_fraction=0.5).start()
    try:
        for i in range(50):
            writer.append(f"request-{i}", 1, chunk_event("s", seed=i))
        assert writer.saturated
        with pytest.raises(WriterBackpressure) as caught:
            writer.append("request-x", 1, chunk_event("s"))
        assert caught.value.retry_after > 0
        assert "50 events behind" in str(caught.value)
        waiting = asyncio.create_task(writer.put("request-late", 1, chunk_event("s")))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        assert writer.lag > 0.1
    finally:
        await transaction.rollback()
        await blocker.close()
    await asyncio.wait_for(waiting, 5)
    await writer.close()
    assert sum((await stored_ids(store)).values()) == 51
    assert not writer.saturated and writer.lag == 0


async def test_killed_connections_mid_stream_store_every_event_exactly_once(
    store: EventStore,
) -> None:
    writer = await store.writer(batch_size=200, flush_interval=0.001).start()
    expected: list[str] = []

    async def produce() -> None:
        for r in range(100):
            events = [chunk_event("s", seed=r * 50 + i) for i in range(40)]
            expected.extend(str(e.event_id) for e in events)
            writer.append_many(f"request-{r}", 1, events)
            await asyncio.sleep(0.003)

    producer = asyncio.create_task(produce())
    kills = 0
    while not producer.done():
        kills += await store.pool.fetchval(TERMINATE, APPLICATION_NAME)
        await asyncio.sleep(0.03)
    await producer
    await writer.close()
    assert kills >= 3
    assert writer.stats.retries >= 1
    counts = await stored_ids(store)
    assert sum(counts.values()) == len(expected) == 4000
    assert set(counts) == set(expected)
    assert max(counts.values()) == 1


async def test_a_resent_event_is_stored_once(store: EventStore) -> None:
    event = chunk_event("s")
    async with store.writer() as writer:
        writer.append("request-1", 1, event)
        await writer.flush()
        writer.append("request-1", 1, event)  # a producer retrying after a timeout
        await writer.flush()
    assert sum((await stored_ids(store)).values()) == 1


async def test_a_refused_event_fails_its_session_and_only_it(store: EventStore) -> None:
    async with store.writer(flush_interval=0.05) as writer:
        good = [chunk_event("good", seed=i) for i in range(30)]
        writer.append_many("request-good", 1, good[:15])
        # A different event claiming a stream version that is already taken.
        writer.append("request-bad", 1, chunk_event("bad", seed=1))
        writer.append("request-bad", 1, chunk_event("bad", seed=2))
        writer.append_many("request-good", 16, good[15:])
        with pytest.raises(WriteFailed, match=r"1 events could not be stored.*UniqueViolation"):
            await writer.flush(session_id="bad")
        await writer.flush(session_id="good")
        with pytest.raises(WriteFailed):
            await writer.flush()
        await writer.flush()  # reported once; nothing new failed since
    assert len(await store.read_session("good")) == 30
    assert len(await store.read_session("bad")) == 1
    assert writer.stats.events_failed == 1


async def test_a_closed_writer_refuses_events(store: EventStore) -> None:
    writer = await store.writer().start()
    await writer.close()
    with pytest.raises(WriterClosed):
        writer.append("request-1", 1, NewEvent(EventType.SESSION_CREATED))


async def test_stream_versions_start_at_one(store: EventStore) -> None:
    async with store.writer() as writer:
        with pytest.raises(ValueError, match="start at 1"):
            writer.append("request-1", 0, chunk_event("s"))


def test_writer_needs_start_before_appends() -> None:
    writer = EventWriter("postgresql://nobody@127.0.0.1:1/none")
    with pytest.raises(WriterClosed, match="not started"):
        writer.append("request-1", 1, chunk_event("s"))
