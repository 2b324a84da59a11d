"""Global order for consumers: racing writers, and transactions that commit late."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import asyncpg

from tests.support import chunk_event
from trajstore.store import EventStore, EventType, NewEvent
from trajstore.store.connection import asyncpg_dsn, connect
from trajstore.store.eventstore import insert_columns
from trajstore.store.queries import APPEND


async def read_everything(store: EventStore) -> list:  # type: ignore[type-arg]
    events, after = [], 0
    while page := await store.read_all(after=after, limit=500):
        events.extend(page)
        after = page[-1].position
    return events


async def test_two_replicas_racing_batches_lose_nothing_and_keep_each_batch_together(
    store: EventStore, database_url: str
) -> None:
    # Two proxy replicas (two pools) record the same session concurrently, each batch its own
    # request stream, plus session-level facts into the shared session stream.
    replicas = [await EventStore.open(database_url, max_size=3) for _ in range(2)]
    batches: dict[str, list[int]] = {}

    async def replica(n: int, replica_store: EventStore) -> None:
        for b in range(25):
            stream = f"request-{n}-{b}"
            events = [chunk_event("shared", n_tokens=4, seed=b * 10 + i) for i in range(8)]
            batches[stream] = [e.event_id.int for e in events]
            await replica_store.append(stream, events, expected_version=0)
            await replica_store.append(
                "session-shared",
                [NewEvent(EventType.REWARD_ASSIGNED, session_id="shared", payload={"n": n})],
            )

    try:
        await asyncio.gather(*(replica(n, r) for n, r in enumerate(replicas)))
    finally:
        for r in replicas:
            await r.close()

    events = await read_everything(store)
    assert len(events) == 2 * 25 * 9
    assert len({e.event_id for e in events}) == len(events)
    # Readers see each batch (one transaction) as one contiguous run, in its own order.
    index_of = {e.event_id.int: i for i, e in enumerate(events)}
    for stream, ids in batches.items():
        indices = [index_of[i] for i in ids]
        assert indices == list(range(indices[0], indices[0] + len(ids))), stream
    assert [e.stream_version for e in await store.read_stream("session-shared")] == list(
        range(1, 51)
    )
    # The order every reader sees is the same, and read_session agrees with read_all.
    session = await store.read_session("shared")
    assert [e.event_id for e in session] == [e.event_id for e in events]


async def test_reads_never_pass_a_transaction_still_in_flight(
    store: EventStore, database_url: str
) -> None:
    await store.append("early", [chunk_event("s", seed=1)])
    slow = await connect(database_url)
    try:
        transaction = slow.transaction()
        await transaction.start()
        # This append takes its position now but commits last.
        await slow.execute(APPEND, *insert_columns("late", 1, [chunk_event("s", seed=2)]))
        await store.append("after-1", [chunk_event("s", seed=3)])
        await store.append("after-2", [chunk_event("s", seed=4)])

        visible = await read_everything(store)
        assert [e.stream_id for e in visible] == ["early"]

        subscription = store.subscribe(after=0, poll_interval=0.05)
        received: list[str] = []

        async def consume() -> None:
            async for event in subscription:
                received.append(event.stream_id)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.5)  # several polls and the NOTIFYs of the two later commits
        assert received == ["early"]

        await transaction.commit()
        for _ in range(100):
            if len(received) == 4:
                break
            await asyncio.sleep(0.05)
        await subscription.close()
        await consumer
    finally:
        await slow.close()

    # Once committed, the slow event is delivered, ahead of those its transaction preceded.
    assert received == ["early", "late", "after-1", "after-2"]
    assert [e.stream_id for e in await read_everything(store)] == received


async def test_an_aborted_transaction_does_not_stall_readers(
    store: EventStore, database_url: str
) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        transaction = conn.transaction()
        await transaction.start()
        await conn.execute("SELECT pg_current_xact_id()")
        await store.append("after", [chunk_event("s")])
        assert await read_everything(store) == []
        await transaction.rollback()
    finally:
        await conn.close()
    assert await store.settle()  # (other databases' writers on the same server count too)
    assert [e.stream_id for e in await read_everything(store)] == ["after"]


async def test_positions_may_interleave_but_read_order_follows_transactions(
    store: EventStore,
) -> None:
    counts: dict[str, int] = defaultdict(int)
    await asyncio.gather(
        *(store.append(f"s-{i}", [chunk_event("s", seed=j) for j in range(20)]) for i in range(6))
    )
    events = await read_everything(store)
    for e in events:
        counts[e.stream_id] += 1
    assert counts == {f"s-{i}": 20 for i in range(6)}
    keys = [(e.tx_id, e.position) for e in events]
    assert keys == sorted(keys)
