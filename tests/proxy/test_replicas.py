"""Several proxy replicas serving one session: references, finish as a barrier on every replica,
turns in request order (real uvicorn-served proxies, real PostgreSQL, a fake engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import chat_prompt_ids
from tests.proxy.fixtures import ProxyFactory, RunningProxy, serve_proxy
from trajstore.proxy.replicas import connection_name
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventStore, EventType
from trajstore.store.connection import connect
from trajstore.store.projection import Projector

EventsOf = Callable[[str], Awaitable[list[Any]]]


def agent_on(proxy: RunningProxy, session: dict[str, Any], created_on: RunningProxy) -> AsyncOpenAI:
    """The session's agent, sending its model calls to `proxy`."""
    return proxy.agent(
        {**session, "base_url": session["base_url"].replace(created_on.url, proxy.url)}
    )


async def converse(agents: list[AsyncOpenAI], turns: int) -> list[dict[str, Any]]:
    """`turns` model calls of one growing conversation, the n-th through `agents[n % len]`."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": " ".join(["w"] * 30)}]
    for n in range(turns):
        answer = await agents[n % len(agents)].chat.completions.create(
            model="tiny",
            messages=messages,  # type: ignore[arg-type]
            max_tokens=6,
        )
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content or ""},
            {"role": "user", "content": f"result {n}"},
        ]
    return messages


def in_log_order(events: list[Any]) -> list[Any]:
    return sorted(events, key=lambda e: (e.tx_id, e.position))


async def alternated(a: RunningProxy, b: RunningProxy, turns: int) -> str:
    """A session created on `a` whose `turns` model calls alternate between a and b: its id."""
    session = await a.new_session()
    await converse([a.agent(session), agent_on(b, session, a)], turns)
    return str(session["session_id"])


async def finished(proxy: RunningProxy, events_of: EventsOf, session_id: str) -> list[Any]:
    """Finish the session on `proxy`: its events in log order, session_finished the last."""
    assert (await proxy.finish(session_id)).status_code == 200
    events = in_log_order(await events_of(session_id))
    assert events[-1].type == EventType.SESSION_FINISHED
    return events


@pytest.fixture
async def lingering(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> tuple[RunningProxy, RunningProxy]:
    """Two replicas of one proxy; the second lingers 5 s over a batch before it writes it."""
    prompt = await start_proxy([engine.url], session_secret="shared")
    late = await start_proxy([engine.url], session_secret="shared", writer_linger=5)
    return prompt, late


async def projected_samples(database_url: str, columns: str) -> list[Any]:
    """Run the projector once over the log; `columns` of every sample it built."""
    store = await EventStore.open(database_url)
    try:
        await Projector(store).run_once()
        return await store.pool.fetch(f"SELECT {columns} FROM samples")
    finally:
        await store.close()


async def test_turns_alternating_between_replicas_reference_what_each_replica_saw(
    start_proxy: ProxyFactory, engine: FakeEngine, events_of: EventsOf
) -> None:
    # Each replica remembers only the turns it served, so the turn a request continues is read
    # from the log, and the whole prompt must still come out exact.
    a = await start_proxy([engine.url], session_secret="shared")
    b = await start_proxy([engine.url], session_secret="shared")
    session = await a.new_session()
    messages = await converse([a.agent(session), agent_on(b, session, a)], 4)
    assert (await a.finish(session["session_id"])).status_code == 200

    record = await a.session_record(session["session_id"])
    turns = record["turns"]
    assert [(len(t["messages"]) - 1) // 2 for t in turns] == [0, 1, 2, 3]  # request order
    for n, turn in enumerate(turns):
        assert turn["prompt_token_ids"] == chat_prompt_ids(messages[: 1 + 2 * n])
    events = await events_of(session["session_id"])
    prefix = {
        e.stream_id: e.payload.get("prefix") for e in events if e.type == EventType.PROMPT_TOKENS
    }
    referenced = [prefix[f"request-{turns[n]['request_id']}"] for n in range(4)]
    # Neither replica remembers the turn before (the other served it): each reads the turn its
    # request continues from the log, and references it.
    assert referenced[0] is None
    assert [r["request_id"] for r in referenced[1:]] == [t["request_id"] for t in turns[:3]]


async def test_finish_on_one_replica_waits_for_the_turns_another_replica_still_holds(
    lingering: tuple[RunningProxy, RunningProxy], events_of: EventsOf, database_url: str
) -> None:
    # b lingers 5 s over a batch: its turns are not in the log when the agent finishes on a.
    a, b = lingering
    sid = await alternated(a, b, 4)

    # finish answered: every turn, b's included, is in the log before session_finished.
    events = await finished(a, events_of, sid)
    assert sum(e.type == EventType.COMPLETION_FINISHED for e in events) == 4
    # So the projector, which builds a session when it finishes, sees all four turns.
    rows = await projected_samples(database_url, "n_turns, divergence")
    assert [(r["n_turns"], r["divergence"]) for r in rows] == [(4, None)]


async def test_turns_a_slower_replica_commits_later_are_still_one_sample_in_request_order(
    lingering: tuple[RunningProxy, RunningProxy], events_of: EventsOf, database_url: str
) -> None:
    fast, slow = lingering
    session = await fast.new_session()
    sid = session["session_id"]
    messages = await converse([agent_on(slow, session, fast), fast.agent(session)], 2)
    for _ in range(100):  # the fast replica commits turn 1 while turn 0 lingers on the slow one
        if any(e.type == EventType.COMPLETION_FINISHED for e in await events_of(sid)):
            break
        await asyncio.sleep(0.02)
    assert (await fast.finish(sid)).status_code == 200

    received = [e for e in in_log_order(await events_of(sid)) if e.type == "request_received"]
    assert [len(e.payload["body"]["messages"]) for e in received] == [3, 1]  # committed 1, 0
    record = await fast.session_record(sid)
    assert [len(t["messages"]) for t in record["turns"]] == [1, 3]  # shown in request order
    [row] = await projected_samples(database_url, "token_ids, n_turns, divergence")
    assert (row["n_turns"], row["divergence"]) == (2, None)
    tokens = np.frombuffer(row["token_ids"], "<i4").tolist()
    assert tokens[: len(chat_prompt_ids(messages[:3]))] == chat_prompt_ids(messages[:3])


async def test_a_replica_whose_listen_connection_dropped_is_still_waited_for(
    lingering: tuple[RunningProxy, RunningProxy], events_of: EventsOf, database_url: str
) -> None:
    a, b = lingering
    sid = await alternated(a, b, 2)
    # b's LISTEN connection goes (an idle timeout somewhere, say); its writer, holding b's turn
    # for 5 s, stays connected, so b is still live, and answers once it listens again.
    conn = await connect(database_url)
    try:
        dropped = await conn.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE application_name = $1",
            connection_name(b.app.state.proxy.registry.replicas.id, "listener"),
        )
    finally:
        await conn.close()
    assert dropped == 1
    events = await finished(a, events_of, sid)
    assert sum(e.type == EventType.COMPLETION_FINISHED for e in events) == 2


async def test_a_replica_that_does_not_confirm_fails_the_finish_with_503_until_it_leaves(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str
) -> None:
    proxy = await start_proxy([engine.url], finish_timeout=1)
    session = await proxy.new_session()
    sid = session["session_id"]
    await converse([proxy.agent(session)], 1)
    # A replica that is connected (so it may hold the session's events) but never answers.
    silent = await connect(database_url, application_name="trajstore-proxy:silent:listener")
    try:
        refused = await proxy.finish(sid)
        assert refused.status_code == 503
        assert refused.headers["Retry-After"] == "1"
        message = refused.json()["error"]["message"]
        assert "replica(s) silent did not confirm within 1s" in message and "retry" in message
        record = await proxy.session_record(sid)
        assert record["status"] == "active"  # not finished: nothing was decided without it
    finally:
        await silent.close()
    assert (await proxy.finish(sid)).status_code == 200  # it left: nothing to wait for


async def test_a_replica_that_stopped_is_not_waited_for(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str, events_of: EventsOf
) -> None:
    a = await start_proxy([engine.url], session_secret="shared", finish_timeout=5)
    session = await a.new_session()
    settings = ProxySettings(engines=[engine.url], port=free_port(), session_secret="shared")
    async with serve_proxy(settings, database_url) as b:
        await converse([a.agent(session), agent_on(b, session, a)], 2)
    # b stopped (storing what it held first); a finish does not wait the 5 s for it.
    finished = await a.finish(session["session_id"])
    assert finished.status_code == 200, finished.text
    events = await events_of(session["session_id"])
    assert sum(e.type == EventType.COMPLETION_FINISHED for e in events) == 2
