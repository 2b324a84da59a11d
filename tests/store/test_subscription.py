"""Subscriptions: catch up, follow live appends, survive a dropped connection without gaps."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from tests.support import chunk_event, eventually
from trajstore.store import EventStore, EventType, NewEvent, RecordedEvent, StoreUnavailable
from trajstore.store.events import session_stream
from trajstore.store.schema import FACTS_CHANNEL
from trajstore.store.subscription import APPLICATION_NAME, wake_ups

TERMINATE = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database()
"""

LISTENERS = """
SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database()
"""


class Consumer:
    """Runs a subscription in the background and keeps what it delivers."""

    def __init__(self, store: EventStore, after: int = 0, **options: float) -> None:
        self.subscription = store.subscribe(after=after, **options)  # type: ignore[arg-type]
        self.events: list[RecordedEvent] = []
        self.task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        async for event in self.subscription:
            self.events.append(event)

    async def stop(self) -> None:
        await self.subscription.close()
        await asyncio.wait_for(self.task, 5)


async def test_catches_up_then_follows_live_appends_promptly(store: EventStore) -> None:
    for i in range(30):
        await store.append(f"old-{i}", [chunk_event("s", seed=i)])
    # A long poll interval: live events must arrive through NOTIFY, not the poll.
    consumer = Consumer(store, poll_interval=30.0, batch_size=7)
    await eventually(lambda: len(consumer.events) == 30)
    for i in range(10):
        await store.append(f"new-{i}", [chunk_event("s", seed=100 + i)])
    await eventually(lambda: len(consumer.events) == 40, timeout=5)
    await consumer.stop()
    assert [e.stream_id for e in consumer.events] == (
        [f"old-{i}" for i in range(30)] + [f"new-{i}" for i in range(10)]
    )


async def test_resumes_after_a_checkpoint(store: EventStore) -> None:
    positions = [(await store.append(f"s-{i}", [chunk_event("s", seed=i)]))[0] for i in range(6)]
    consumer = Consumer(store, after=positions[2])
    await eventually(lambda: len(consumer.events) == 3)
    await consumer.stop()
    assert [e.position for e in consumer.events] == positions[3:]
    assert consumer.subscription.position == positions[-1]


async def test_dropped_connection_mid_stream_gives_no_gap_and_no_duplicate(
    store: EventStore,
) -> None:
    consumer = Consumer(store, poll_interval=0.2)
    appended: list[int] = []

    async def produce() -> None:
        for i in range(60):
            appended.extend(await store.append(f"s-{i}", [chunk_event("s", seed=i)] * 1))
            await asyncio.sleep(0.01)

    producer = asyncio.create_task(produce())
    killed = 0
    for round_ in range(1, 4):
        await eventually(lambda: len(consumer.events) > 10 * round_, timeout=10)  # noqa: B023
        # The subscriber may be between connections right now: kill it once it is back.
        for _ in range(100):
            if await store.pool.fetchval(TERMINATE, APPLICATION_NAME):
                killed += 1
                break
            await asyncio.sleep(0.02)
    await producer
    await eventually(lambda: len(consumer.events) >= 60, timeout=15)
    await asyncio.sleep(0.3)  # a duplicate, if any, would arrive now
    await consumer.stop()
    assert killed == 3
    assert consumer.subscription.reconnects >= 3
    assert [e.position for e in consumer.events] == appended


async def test_gives_up_with_a_clear_error_when_the_server_stays_away() -> None:
    subscription = EventStore.subscribe(
        EventStore(pool=None, url="postgresql://nobody@127.0.0.1:1/none"),  # type: ignore[arg-type]
        reconnect_timeout=0.3,
    )
    with pytest.raises(StoreUnavailable, match="subscription lost PostgreSQL"):
        async for _ in subscription:
            pass


async def test_session_facts_wake_their_listeners_and_tokens_do_not(store: EventStore) -> None:
    """The projector and proxy replicas sleep through token batches, and wake for a finish."""
    steps = 0

    async def listen() -> None:
        nonlocal steps
        # A long poll: every step after the first must come from a notification.
        wakes = wake_ups(store.url, FACTS_CHANNEL, poll_interval=30.0, application_name="facts")
        async with contextlib.aclosing(wakes):
            async for _ in wakes:
                steps += 1

    listener = asyncio.create_task(listen())
    try:
        await eventually(lambda: steps == 1)
        await asyncio.sleep(0.2)  # the LISTEN is in place
        consumer = Consumer(store, poll_interval=30.0)  # every event, woken by the other channel
        for i in range(5):
            await store.append(f"tokens-{i}", [chunk_event("s-1", seed=i)])
        await eventually(lambda: len(consumer.events) == 5, timeout=5)
        await consumer.stop()
        await asyncio.sleep(0.3)
        assert steps == 1, "a token batch woke a session-facts listener"

        finished = NewEvent(
            EventType.SESSION_FINISHED, session_id="s-1", payload={"status": "completed"}
        )
        await store.append(session_stream("s-1"), [finished])
        await eventually(lambda: steps == 2, timeout=5)
    finally:
        listener.cancel()
        with pytest.raises(asyncio.CancelledError):
            await listener
    # Cancelled, the listener has closed its LISTEN connection (its backend ends a moment later).
    for _ in range(100):
        if await store.pool.fetchval(LISTENERS, "facts") == 0:
            break
        await asyncio.sleep(0.05)
    else:
        raise AssertionError("the LISTEN connection outlived its cancelled listener")
