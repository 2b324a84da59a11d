"""Time travel and the timeline on a real PostgreSQL, with sessions written as the proxy would."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg
import numpy as np
import pytest

from trajstore.store import (
    BadEvent,
    EventStore,
    EventType,
    NewEvent,
    SessionNotFound,
    request_stream,
    session_stream,
)
from trajstore.store.projection import Projector
from trajstore.store.timeline import (
    samples_as_of,
    session_as_of,
    session_events,
    timeline,
)

SYSTEM = {"role": "system", "content": "You add numbers with the add tool."}
USER = {"role": "user", "content": "add 2 and 3"}


class Recorder:
    """Writes one session's events through `EventStore.append`, remembering their positions."""

    def __init__(self, store: EventStore, session_id: str) -> None:
        self.store = store
        self.session_id = session_id
        self.positions: dict[str, int] = {}  # a label -> the position of the event it names

    def event(self, kind: EventType, payload: dict[str, Any], **arrays: Any) -> NewEvent:
        return NewEvent(kind, session_id=self.session_id, run_id="run-1", payload=payload, **arrays)

    async def session_fact(self, label: str, kind: EventType, payload: dict[str, Any]) -> None:
        [self.positions[label]] = await self.store.append(
            session_stream(self.session_id), [self.event(kind, payload)]
        )

    async def created(self) -> None:
        await self.session_fact(
            "created", EventType.SESSION_CREATED, {"task_id": "add", "group_id": "g1"}
        )

    async def turn(
        self,
        n: int,
        messages: list[dict[str, Any]],
        prompt: list[int],
        completion: list[int],
        *,
        text: str = "",
        fail: str | None = None,
    ) -> None:
        """One model request; its chunks in two events so a position can fall in between."""
        request_id = f"{self.session_id}-{n}"
        stream = request_stream(request_id)
        half = len(completion) // 2
        body = {"messages": messages, "tools": [{"type": "function"}]}
        events = [
            self.event(
                EventType.REQUEST_RECEIVED,
                {
                    "request_id": request_id,
                    "api": "chat",
                    "body": body,
                    "engine": "e1",
                    "policy_version": "3",
                    "sampling": {"temperature": 1.0},
                },
            ),
            self.event(EventType.PROMPT_TOKENS, {"choice": None}, token_ids=prompt),
            self.event(
                EventType.COMPLETION_CHUNK,
                {"choice": 0, "text": text[: len(text) // 2]},
                token_ids=completion[:half],
                logprobs=[-0.5] * half,
            ),
        ]
        positions = await self.store.append(stream, events)
        self.positions[f"request {n}"] = positions[0]
        self.positions[f"first chunk {n}"] = positions[2]
        rest = [
            self.event(
                EventType.COMPLETION_CHUNK,
                {"choice": 0, "text": text[len(text) // 2 :]},
                token_ids=completion[half:],
                logprobs=[-0.5] * (len(completion) - half),
            )
        ]
        if fail is None:
            rest.append(
                self.event(
                    EventType.COMPLETION_FINISHED,
                    {
                        "choices": [{"index": 0, "finish_reason": "stop"}],
                        "latency_s": 0.25,
                        "ttft_s": 0.01,
                        "usage": {"completion_tokens": len(completion)},
                    },
                )
            )
        else:
            rest.append(
                self.event(
                    EventType.REQUEST_FAILED,
                    {"reason": fail, "status": 502, "message": "engine went away"},
                )
            )
        *_, self.positions[f"end {n}"] = await self.store.append(stream, rest)


async def record_tool_session(store: EventStore, session_id: str = "s1") -> Recorder:
    """Two turns with a tool result in between, a failed third turn, a reward, a finish."""
    recorder = Recorder(store, session_id)
    await recorder.created()
    first = [SYSTEM, USER]
    await recorder.turn(0, first, [1, 10, 11], [20, 21, 22, 2], text="call add")
    second = [
        *first,
        {"role": "assistant", "content": "call add"},
        {"role": "tool", "tool_call_id": "c0", "content": "5"},
    ]
    await recorder.turn(1, second, [1, 10, 11, 20, 21, 22, 2, 30], [40, 41, 2], text="five")
    third = [*second, {"role": "assistant", "content": "five"}, {"role": "user", "content": "?"}]
    await recorder.turn(2, third, [1, 10, 11, 20, 21, 22, 2, 30, 40, 41, 2, 50], [60, 61],
                        fail="engine_error")  # fmt: skip
    await recorder.session_fact("reward", EventType.REWARD_ASSIGNED, {"value": 1.0})
    await recorder.session_fact("finished", EventType.SESSION_FINISHED, {"status": "completed"})
    return recorder


async def test_a_session_as_of_each_position_is_what_had_happened_by_then(
    store: EventStore,
) -> None:
    recorder = await record_tool_session(store)
    at = recorder.positions

    mid_turn = await session_as_of(store, "s1", at["first chunk 1"])
    assert mid_turn.status == "active"
    assert [t.status for t in mid_turn.turns] == ["completed", "in_progress"]
    assert mid_turn.turns[1].choices[0].token_ids == [40]  # the first chunk only
    assert mid_turn.turns[1].choices[0].text == "fi"

    before_reward = await session_as_of(store, "s1", at["end 2"])
    assert [t.status for t in before_reward.turns] == ["completed", "completed", "failed"]
    assert before_reward.reward is None and before_reward.status == "active"

    rewarded = await session_as_of(store, "s1", at["reward"])
    assert rewarded.reward == 1.0 and rewarded.status == "active"

    now = await session_as_of(store, "s1")
    assert now.status == "completed"
    assert now.as_json() == (await session_as_of(store, "s1", at["finished"])).as_json()


async def test_as_of_follows_the_logs_commit_order_not_the_bare_position(
    store: EventStore, database_url: str
) -> None:
    """An event with a smaller position that committed later is not there as of a larger one.

    Positions are handed out at insert; the log's order is (tx_id, position). Here transaction B
    takes its id first, A then inserts and commits (smaller position, later tx_id), and B inserts
    and commits after it. A reader at B's position has not seen A's event yet.
    """
    recorder = Recorder(store, "s1")
    await recorder.created()
    async with store.pool.acquire() as b, b.transaction():
        await b.fetchval("SELECT pg_current_xact_id()")
        # A: on another connection, a later transaction than b; it commits at once.
        await recorder.session_fact("a", EventType.REWARD_ASSIGNED, {"value": 0.25})
        await b.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, session_id, event_type,"
            " payload) VALUES (gen_random_uuid(), 'other-stream', 1, 's1', 'reward_assigned',"
            " '{\"value\": 0.5}')"
        )
        position_b = await b.fetchval("SELECT max(position) FROM events")
    position_a = recorder.positions["a"]
    assert position_a < position_b

    as_of_b = await session_as_of(store, "s1", position_b)
    assert [r.value for r in as_of_b.rewards] == [0.5]  # A committed after B in log order
    as_of_a = await session_as_of(store, "s1", position_a)
    assert [r.value for r in as_of_a.rewards] == [0.5, 0.25]


async def projected(store: EventStore, n_rows: int) -> list[asyncpg.Record]:
    """The samples table once the projector has caught up.

    The projector reads below the horizon, which a transaction open anywhere on the server (other
    tests) holds back for a moment; so project until the rows are there, or fail after 30 s.
    """
    projector = Projector(store)
    rows: list[asyncpg.Record] = []

    async def caught_up() -> bool:
        nonlocal rows
        await projector.run_once()
        rows = await store.pool.fetch("SELECT * FROM samples ORDER BY session_id, branch")
        return len(rows) >= n_rows

    for _ in range(300):
        if await caught_up():
            return rows
        await asyncio.sleep(0.1)
    raise AssertionError(f"the projector wrote {len(rows)} of {n_rows} samples within 30 s")


async def test_the_samples_projection_as_of_a_position(store: EventStore) -> None:
    early = await record_tool_session(store, "early")
    late = Recorder(store, "late")
    await late.created()
    await late.turn(0, [USER], [1, 5], [7, 2])
    await late.session_fact("finished", EventType.SESSION_FINISHED, {"status": "completed"})
    await early.session_fact("correction", EventType.REWARD_ASSIGNED, {"value": -1.0})
    await late.session_fact("discarded", EventType.SESSION_DISCARDED, {"reason": "leak"})

    before_any = await samples_as_of(store, early.positions["reward"])
    assert before_any == []  # rewarded, not finished: the projection has nothing yet

    first = await samples_as_of(store, early.positions["finished"])
    assert [(s.session.session_id, s.session.reward) for s in first] == [("early", 1.0)]
    assert first[0].token_ids == [1, 10, 11, 20, 21, 22, 2, 30, 40, 41, 2]  # the failed turn: out

    both = await samples_as_of(store, late.positions["finished"])
    assert [s.session.session_id for s in both] == ["early", "late"]

    now = await samples_as_of(store, late.positions["discarded"])
    assert [(s.session.session_id, s.session.reward) for s in now] == [("early", -1.0)]

    # As of the head, time travel and the real projection agree sample for sample.
    rows = await projected(store, len(now))
    assert [r["sample_id"] for r in rows] == [s.sample_id for s in now]
    assert [np.frombuffer(r["token_ids"], "<i4").tolist() for r in rows] == [
        s.token_ids for s in now
    ]
    assert [r["reward"] for r in rows] == [s.session.reward for s in now]


async def test_an_unknown_session_or_position_is_refused_clearly(store: EventStore) -> None:
    recorder = await record_tool_session(store)
    with pytest.raises(SessionNotFound, match="no session 'nope' in the store"):
        await session_as_of(store, "nope")
    other = Recorder(store, "s2")
    await other.created()
    with pytest.raises(SessionNotFound, match=r"no session 's2' .* as of position"):
        await session_as_of(store, "s2", recorder.positions["finished"])
    with pytest.raises(BadEvent, match="no event at position 999999"):
        await session_as_of(store, "s1", 999_999)


async def test_the_timeline_reads_as_the_session_went(store: EventStore) -> None:
    await record_tool_session(store)
    events = await session_events(store, "s1")
    session = await session_as_of(store, "s1")
    entries = timeline(session, events)
    assert [(e.kind, e.turn) for e in entries] == [
        ("created", None),
        ("request", 0), ("completion", 0),
        ("request", 1), ("completion", 1),
        ("request", 2), ("failure", 2),
        ("reward", None), ("finished", None),
    ]  # fmt: skip
    request_1 = entries[3].details
    assert request_1["new_messages"] == [{"role": "tool", "tool_call_id": "c0", "content": "5"}]
    assert request_1["prompt_tokens"] == 8 and request_1["n_tools"] == 1
    completion_1 = entries[4].details
    assert completion_1["choices"][0]["text"] == "five"
    assert completion_1["choices"][0]["tokens"] == 3
    assert completion_1["latency_s"] == 0.25
    failure = entries[6].details
    assert failure["reason"] == "engine_error" and failure["completion_tokens"] == 2
    assert entries[7].details["value"] == 1.0
    assert all(e.at_s >= 0 for e in entries)
    assert [e.position for e in entries] == sorted(e.position for e in entries)
