"""Appending and reading: every field round-trips, versions are enforced, retries are harmless."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest

from tests.support import chunk_event
from trajstore.store import (
    BadEvent,
    ConcurrencyError,
    DuplicateEventError,
    EventStore,
    EventType,
    ExpectedVersion,
    NewEvent,
    queries,
    request_stream,
    session_stream,
)


async def test_every_field_round_trips_bit_exact(store: EventStore) -> None:
    ids = np.array([0, 7, 151_643, 2**31 - 1], dtype=np.int64)
    logprobs = np.array([-np.inf, -0.0, -1.5e-7, -23.25], dtype=np.float32)
    event = NewEvent(
        EventType.COMPLETION_CHUNK,
        session_id="sess-1",
        run_id="run-7",
        payload={"text": "héllo 👋", "nested": {"n": [1, 2.5, None, True]}, "big": 2**53},
        token_ids=ids,
        logprobs=logprobs,
    )
    before = datetime.now(UTC) - timedelta(seconds=5)
    [position] = await store.append("request-r1", [event], expected_version=0)

    [got] = await store.read_stream("request-r1")
    assert got.position == position
    assert got.event_id == event.event_id
    assert (got.stream_id, got.stream_version) == ("request-r1", 1)
    assert (got.session_id, got.run_id) == ("sess-1", "run-7")
    assert got.type == EventType.COMPLETION_CHUNK
    assert got.payload == event.payload
    assert got.token_ids is not None and got.logprobs is not None
    assert got.token_ids.tolist() == ids.tolist()
    assert got.logprobs.tobytes() == logprobs.tobytes()
    assert before < got.recorded_at < datetime.now(UTC) + timedelta(seconds=5)
    assert got.tx_id > 0


async def test_events_without_tokens_read_back_as_none(store: EventStore) -> None:
    await store.append("session-s", [NewEvent(EventType.SESSION_CREATED, session_id="s")])
    [got] = await store.read_session("s")
    assert got.token_ids is None and got.logprobs is None and got.payload == {}


async def test_appends_number_versions_and_positions_in_order(store: EventStore) -> None:
    first = await store.append("stream", [chunk_event("s"), chunk_event("s")], expected_version=0)
    second = await store.append("stream", [chunk_event("s")], expected_version=2)
    assert first[0] < first[1] < second[0]
    assert [e.stream_version for e in await store.read_stream("stream")] == [1, 2, 3]
    assert [e.stream_version for e in await store.read_stream("stream", after_version=1)] == [2, 3]


async def test_wrong_expected_version_names_stream_expected_and_actual(store: EventStore) -> None:
    await store.append("stream", [chunk_event("s")], expected_version=ExpectedVersion.NO_STREAM)
    with pytest.raises(ConcurrencyError) as caught:
        await store.append("stream", [chunk_event("s")], expected_version=0)
    assert (caught.value.stream_id, caught.value.expected, caught.value.actual) == ("stream", 0, 1)
    assert "'stream' is at version 1, but the append expected 0" in str(caught.value)
    # A version ahead of the stream would leave a gap: refused too.
    with pytest.raises(ConcurrencyError):
        await store.append("stream", [chunk_event("s")], expected_version=5)
    assert len(await store.read_stream("stream")) == 1


async def test_retrying_the_same_batch_returns_the_original_positions(store: EventStore) -> None:
    batch = [chunk_event("s", seed=i) for i in range(3)]
    first = await store.append("stream", batch, expected_version=0)
    # The caller did not hear back (a timeout, say) and sends the identical batch again.
    again = await store.append("stream", batch, expected_version=0)
    also = await store.append("stream", batch, expected_version=ExpectedVersion.ANY)
    assert again == first == also
    assert len(await store.read_stream("stream")) == 3


async def test_a_batch_overlapping_stored_events_is_refused(store: EventStore) -> None:
    batch = [chunk_event("s", seed=i) for i in range(2)]
    await store.append("stream", batch)
    with pytest.raises(DuplicateEventError, match="resent whole and unchanged"):
        await store.append("stream", [batch[0], chunk_event("s", seed=9)])
    with pytest.raises(DuplicateEventError, match="not as this batch"):
        await store.append("other-stream", batch)


async def test_concurrent_any_appends_to_one_stream_all_land(store: EventStore) -> None:
    # Session-level facts may come from several proxy replicas at once.
    events = [
        NewEvent(EventType.REWARD_ASSIGNED, session_id="s", payload={"i": i}) for i in range(20)
    ]
    await asyncio.gather(*(store.append(session_stream("s"), [e]) for e in events))
    stored = await store.read_stream(session_stream("s"))
    assert [e.stream_version for e in stored] == list(range(1, 21))
    assert sorted(e.payload["i"] for e in stored) == list(range(20))


async def test_read_session_spans_its_streams_in_global_order(store: EventStore) -> None:
    await store.append(session_stream("s"), [NewEvent(EventType.SESSION_CREATED, session_id="s")])
    await store.append(request_stream("r1"), [chunk_event("s"), chunk_event("s")])
    await store.append(request_stream("other"), [chunk_event("not-s")])
    await store.append(request_stream("r2"), [chunk_event("s")])
    await store.append(session_stream("s"), [NewEvent(EventType.SESSION_FINISHED, session_id="s")])
    events = await store.read_session("s")
    assert [e.stream_id for e in events] == [
        "session-s",
        "request-r1",
        "request-r1",
        "request-r2",
        "session-s",
    ]
    assert [e.position for e in events] == sorted(e.position for e in events)


async def test_read_all_pages_through_everything(store: EventStore) -> None:
    for i in range(5):
        await store.append(f"stream-{i}", [chunk_event("s", seed=j) for j in range(3)])
    seen, after = [], 0
    while page := await store.read_all(after=after, limit=4):
        seen.extend(page)
        after = page[-1].position
    assert len(seen) == 15
    assert len({e.event_id for e in seen}) == 15
    assert after == await store.head()


async def test_read_all_from_a_position_never_read_is_refused(store: EventStore) -> None:
    with pytest.raises(BadEvent, match="no event at position 42"):
        await store.read_all(after=42)


@pytest.mark.parametrize(
    ("stream_id", "events", "message"),
    [
        ("", [NewEvent(EventType.SESSION_CREATED)], "stream_id"),
        ("s", [], "at least one event"),
        ("s", [{"type": "session_created"}], "NewEvent objects"),
    ],
)
async def test_bad_appends_are_refused(
    store: EventStore, stream_id: str, events: list[NewEvent], message: str
) -> None:
    with pytest.raises(BadEvent, match=message):
        await store.append(stream_id, events)


async def test_the_same_event_twice_in_one_batch_is_refused(store: EventStore) -> None:
    event = chunk_event("s")
    with pytest.raises(BadEvent, match="same event id twice"):
        await store.append("s", [event, event])


async def test_unknown_event_id_type_is_refused(store: EventStore) -> None:
    with pytest.raises(BadEvent):
        NewEvent(EventType.SESSION_CREATED, event_id=str(uuid.uuid4()))  # type: ignore[arg-type]


async def test_read_types_finds_the_session_facts_among_the_tokens_from_their_index(
    store: EventStore,
) -> None:
    # 40 sessions: each a stream of chunks, then a reward and a finish (every fourth discarded).
    expected = []
    for s in range(40):
        session = f"s{s}"
        chunks = [chunk_event(session, n_tokens=4, seed=s * 100 + i) for i in range(30)]
        await store.append(request_stream(f"r{s}"), chunks, expected_version=0)
        facts = [
            NewEvent(EventType.REWARD_ASSIGNED, payload={"value": 1.0}, session_id=session),
            NewEvent(
                EventType.SESSION_FINISHED, payload={"status": "completed"}, session_id=session
            ),
        ]
        if s % 4 == 0:
            facts.append(
                NewEvent(EventType.SESSION_DISCARDED, payload={"reason": "x"}, session_id=session)
            )
        await store.append(session_stream(session), facts, expected_version=0)
        expected += [(session, e.type) for e in facts]

    followed = [EventType.SESSION_FINISHED.value, EventType.SESSION_DISCARDED.value]
    read, after = [], (0, 0)
    while page := await store.read_types(followed, after=after, limit=7):
        read += page
        after = (page[-1].tx_id, page[-1].position)
    assert [(e.session_id, e.type) for e in read] == [f for f in expected if f[1] in followed]
    assert await store.read_types([], after=(0, 0)) == []

    # What keeps a projector's batch cheap on a long log: PostgreSQL goes to the partial index
    # on facts instead of walking the 1,200 chunks between them.
    async with store.pool.acquire() as conn:
        await conn.execute("ANALYZE events")
        for types in (followed, [*followed, EventType.REWARD_ASSIGNED.value]):
            plan = await conn.fetch("EXPLAIN " + queries.read_types(types), 0, 0, 100)
            assert "ix_events_session_facts" in "\n".join(r[0] for r in plan), plan
