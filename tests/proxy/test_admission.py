"""Fair admission across runs, through the proxy: a flooding run under a global cap, per-run
limits from the session and the admin call, 429 in each API's shape and recorded, /metrics by
run, and an agent leaving the queue. Order and counts are asserted, never times (the latency
claim is benchmarks/fairness.py's)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from tests.support import eventually
from trajstore.proxy.admission import Admission
from trajstore.store import EventType

ADMIN = "admin-sekret"


def chat(text: str) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4}


def admission_of(proxy: RunningProxy) -> Admission:
    admission: Admission = proxy.app.state.proxy.admission
    return admission


def queued(proxy: RunningProxy, run_id: str) -> int:
    return int(admission_of(proxy).describe(run_id)["queued"])


def in_flight(proxy: RunningProxy, run_id: str) -> int:
    return int(admission_of(proxy).describe(run_id)["in_flight"])


async def call(proxy: RunningProxy, session: dict[str, Any], text: str) -> httpx.Response:
    return await proxy.http.post(
        f"{session['base_url']}/chat/completions", json=chat(text),
        headers={"Authorization": f"Bearer {session['api_key']}"},
    )  # fmt: skip


def admin(key: str = ADMIN) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_a_flooding_run_delays_another_by_at_most_one_slot(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    engine.fault, engine.delay = "slow", 0.2  # every answer takes a while: the queue fills
    proxy = await start_proxy([engine.url], admission_max_in_flight=1)
    flooder = await proxy.new_session(run_id="run-a")
    other = await proxy.new_session(run_id="run-b")
    flood = [asyncio.create_task(call(proxy, flooder, f"a{i}")) for i in range(8)]
    await eventually(lambda: queued(proxy, "run-a") == 7)
    late = [asyncio.create_task(call(proxy, other, f"b{i}")) for i in range(3)]
    await eventually(lambda: queued(proxy, "run-b") == 3)
    ahead = 8 - queued(proxy, "run-a")  # run-a's requests admitted before run-b's were queued
    answers = await asyncio.gather(*flood, *late)
    assert all(a.status_code == 200 for a in answers)
    order = [r["messages"][0]["content"] for r in engine.requests]
    for k in range(3):
        before = order[: order.index(f"b{k}")]
        # run-b's first goes in the next free slot, then the runs take turns: run-a's backlog
        # of seven costs run-b no more than one slot per request.
        assert sum(o.startswith("a") for o in before) <= ahead + k
    assert order[-1].startswith("a")


async def test_a_runs_in_flight_cap_holds(start_proxy: ProxyFactory, engine: FakeEngine) -> None:
    engine.fault, engine.delay = "slow", 0.15
    proxy = await start_proxy([engine.url])
    session = await proxy.new_session(run_id="run-capped", rate_limit={"max_in_flight": 2})
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(engine.in_flight)
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch())
    try:
        answers = await asyncio.gather(*(call(proxy, session, f"q{i}") for i in range(6)))
    finally:
        watcher.cancel()
    assert all(a.status_code == 200 for a in answers)
    assert len(engine.requests) == 6
    assert max(seen) == 2


async def test_a_full_queue_is_a_429_in_each_apis_shape_recorded_and_counted(
    start_proxy: ProxyFactory, engine: FakeEngine, events_of: Any
) -> None:
    engine.delay = 1.0
    proxy = await start_proxy([engine.url])
    limit = {"max_in_flight": 1, "max_queued": 0}
    session = await proxy.new_session(run_id="run-full", rate_limit=limit)
    key = {"Authorization": f"Bearer {session['api_key']}"}
    slow = asyncio.create_task(
        proxy.http.post(f"{session['base_url']}/chat/completions", json=chat("slow"),
                        headers={**key, "X-Fake-Fault": "slow"})
    )  # fmt: skip
    await eventually(lambda: in_flight(proxy, "run-full") == 1)
    refused_chat = await call(proxy, session, "chat")
    refused_messages = await proxy.http.post(
        f"{session['anthropic_base_url']}/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "m"}]},
        headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"},
    )
    refused_responses = await proxy.http.post(
        f"{session['base_url']}/responses", json={"model": "tiny", "input": "r"}, headers=key
    )
    assert (await slow).status_code == 200
    for refused in (refused_chat, refused_messages, refused_responses):
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
    assert refused_chat.json()["error"]["type"] == "rate_limit_error"
    assert refused_responses.json()["error"]["type"] == "rate_limit_error"
    assert refused_messages.json()["type"] == "error"
    assert refused_messages.json()["error"]["type"] == "rate_limit_error"
    assert "run-full" in refused_chat.json()["error"]["message"]
    assert len(engine.requests) == 1  # the refused never reached the engine

    await proxy.app.state.proxy.registry.writer.flush()
    events = await events_of(session["session_id"])
    failed = [e.payload for e in events if e.type == EventType.REQUEST_FAILED]
    assert [(f["reason"], f["status"]) for f in failed] == [("rate_limited", 429)] * 3
    received = [e.payload["api"] for e in events if e.type == EventType.REQUEST_RECEIVED]
    assert sorted(received) == ["chat", "chat", "messages", "responses"]

    scraped = (await proxy.http.get(f"{proxy.url}/metrics")).text
    assert 'trajstore_admission_rate_limited_total{run="run-full"} 3.0' in scraped
    assert 'trajstore_admission_admitted_total{run="run-full"} 1.0' in scraped
    assert 'trajstore_admission_wait_seconds_count{run="run-full"} 1.0' in scraped
    assert 'trajstore_admission_in_flight{run="run-full"} 0.0' in scraped


async def test_limits_come_from_the_session_and_the_admin_call_overrides_them(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    engine.delay = 1.0
    proxy = await start_proxy([engine.url], api_key=ADMIN)
    session = await proxy.new_session(run_id="run-x", rate_limit={"max_in_flight": 4})
    url = f"{proxy.url}/admin/runs/run-x/limits"
    shown = (await proxy.http.get(url, headers=admin())).json()
    assert shown["limits"]["max_in_flight"] == 4 and shown["set_by"] == "session"

    tight = {"max_in_flight": 1, "max_queued": 0}
    for key in (session["api_key"], session["orchestrator_key"]):  # the agent, its orchestrator
        refused = await proxy.http.put(url, json=tight, headers=admin(key))
        assert refused.status_code == 401
    assert (await proxy.http.put(url, json=tight)).status_code == 401  # no key at all
    changed = await proxy.http.put(url, json=tight, headers=admin())
    assert changed.status_code == 200 and changed.json()["set_by"] == "admin"
    # A later session's own limits do not undo the admin's.
    later = await proxy.new_session(run_id="run-x", rate_limit={"max_in_flight": 8})
    assert (await proxy.http.get(url, headers=admin())).json()["limits"] == {
        "requests_per_second": None, "burst": None, "max_in_flight": 1, "max_queued": 0,
    }  # fmt: skip

    key = {"Authorization": f"Bearer {session['api_key']}", "X-Fake-Fault": "slow"}
    slow = asyncio.create_task(
        proxy.http.post(f"{session['base_url']}/chat/completions", json=chat("s"), headers=key)
    )
    await eventually(lambda: in_flight(proxy, "run-x") == 1)
    assert (await call(proxy, later, "refused")).status_code == 429  # the admin's max_queued 0
    assert (await slow).status_code == 200

    cleared = await proxy.http.delete(url, headers=admin())
    assert cleared.json()["limits"] is None
    assert (await call(proxy, later, "free")).status_code == 200
    # The sessions' limits apply again: the newest session's.
    assert (await proxy.http.get(url, headers=admin())).json()["limits"]["max_in_flight"] == 8


async def test_an_agent_hanging_up_while_queued_leaves_the_queue(
    start_proxy: ProxyFactory, engine: FakeEngine, events_of: Any
) -> None:
    engine.delay = 1.0
    proxy = await start_proxy([engine.url])
    session = await proxy.new_session(run_id="run-q", rate_limit={"max_in_flight": 1})
    key = {"Authorization": f"Bearer {session['api_key']}"}
    url = f"{session['base_url']}/chat/completions"
    slow = asyncio.create_task(
        proxy.http.post(url, json=chat("slow"), headers={**key, "X-Fake-Fault": "slow"})
    )
    await eventually(lambda: in_flight(proxy, "run-q") == 1)
    async with httpx.AsyncClient(timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(url, json=chat("gives up"), headers=key)
    await eventually(lambda: queued(proxy, "run-q") == 0)
    assert (await slow).status_code == 200
    assert (await call(proxy, session, "next")).status_code == 200
    assert [r["messages"][0]["content"] for r in engine.requests] == ["slow", "next"]
    await proxy.app.state.proxy.registry.writer.flush()
    failed = [e.payload for e in await events_of(session["session_id"])
              if e.type == EventType.REQUEST_FAILED]  # fmt: skip
    assert [f["reason"] for f in failed] == ["client_disconnected"]
