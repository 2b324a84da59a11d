"""Request messages stored as a reference to an earlier turn's plus the new ones (the
request_received contract in `store.sessions`): every reader sees the whole list, or none."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from tests.support import RecordedSession
from trajstore.store import EventStore, migrations
from trajstore.store.export import export
from trajstore.store.projection import Projector
from trajstore.store.sessions import rebuild_session

SYSTEM = {"role": "system", "content": "You fix bugs."}


def said(n: int) -> list[dict[str, Any]]:
    """The assistant's reply to turn n and the tool's result after it."""
    return [{"role": "assistant", "content": f"call {n}"}, {"role": "tool", "content": f"out {n}"}]


async def record(store: EventStore, turns: list[tuple[list[Any], dict[str, Any] | None]]) -> None:
    """A session of chat turns r0, r1, ...: each (stored messages, messages_prefix or None)."""

    recorded = RecordedSession(store)
    await recorded.created()
    context: list[int] = []  # the tokens so far: a turn with a reference extends them
    for n, (messages, prefix) in enumerate(turns):
        prompt = [*(context if prefix is not None else [1]), 10 + n]
        context = [*prompt, 20]
        received: dict[str, Any] = {"request_id": f"r{n}", "api": "chat"}
        received["body"] = {"model": "m", "messages": messages, "tool_choice": "auto"}
        if prefix is not None:
            received["messages_prefix"] = prefix
        message = said(n)[0]
        finished = {"choices": [{"index": 0, "finish_reason": "stop", "message": message}]}
        await recorded.turn(
            received, prompt, [20], chunk={"choice": 0}, logprob=-1.0, finished=finished
        )
    await recorded.finished()


def ref(n: int, count: int) -> dict[str, Any]:
    return {"request_id": f"r{n}", "n_messages": count}


async def view_messages(store: EventStore) -> list[Any]:
    rows = await store.pool.fetch("SELECT messages FROM turns ORDER BY position")
    return [None if r["messages"] is None else orjson.loads(r["messages"]) for r in rows]


async def test_messages_are_rebuilt_whole_through_a_chain_by_every_reader(
    store: EventStore, tmp_path: Path
) -> None:
    sent = [[SYSTEM], [SYSTEM, *said(0)], [SYSTEM, *said(0), *said(1)], [{"role": "user"}]]
    await record(
        store,
        [
            (sent[0], None),
            (said(0), ref(0, 1)),
            (said(1), ref(1, 3)),  # a chain: r1's messages are themselves a reference
            (sent[3], None),  # a new conversation, stored whole
        ],
    )
    session = rebuild_session("s1", await store.read_session("s1"))
    assert [t.messages for t in session.turns] == sent
    assert all(t.body["tool_choice"] == "auto" for t in session.turns)  # the rest of the body
    assert await view_messages(store) == sent
    await Projector(store).run_once()
    out = tmp_path / "samples.jsonl"
    assert await export(store, out, fmt="jsonl") == 2  # a branch per conversation
    records = [orjson.loads(line) for line in out.read_bytes().splitlines()]
    conversations = [orjson.loads(r["messages"]) for r in records]  # a JSON column
    # A sample's conversation: its last request's whole messages, then the model's reply.
    assert sorted(conversations, key=len) == [
        [{"role": "user"}, said(3)[0]],
        [*sent[2], said(2)[0]],
    ]


async def test_a_reference_the_log_cannot_satisfy_shows_no_messages_but_keeps_the_turn(
    store: EventStore,
) -> None:
    await record(
        store,
        [
            ([SYSTEM], None),
            (said(0), ref(0, 2)),  # r0 sent 1 message, not 2
            (said(1), ref(7, 1)),  # no request r7 in the log
            (said(2), ref(3, 1)),  # itself
        ],
    )
    session = rebuild_session("s1", await store.read_session("s1"))
    assert [t.messages for t in session.turns] == [[SYSTEM], None, None, None]
    for turn in session.turns[1:]:
        assert "do not hold" in turn.body["messages_unresolved"]
    assert [t.status for t in session.turns] == ["completed"] * 4  # the tokens are not affected
    assert await view_messages(store) == [[SYSTEM], None, None, None]


async def test_migration_0009_makes_an_existing_turns_view_show_whole_messages(
    store: EventStore, database_url: str
) -> None:
    await record(store, [([SYSTEM], None), (said(0), ref(0, 1))])
    await asyncio.to_thread(migrations.downgrade, database_url, "0008_prompt_references")
    assert await view_messages(store) == [[SYSTEM], said(0)]  # as stored
    await asyncio.to_thread(migrations.upgrade, database_url)
    assert await view_messages(store) == [[SYSTEM], [SYSTEM, *said(0)]]
