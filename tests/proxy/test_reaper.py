"""Turns lost with their replica, and sessions nobody finishes (`proxy.reaper`): a replica killed
mid-stream has its open request recorded as failed by another replica, with the tokens that
reached the log, and an idle session is finished as `timeout`."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy

pytestmark = pytest.mark.slow

SECRET = "shared-between-replicas"
REAPING = {"reap_interval": 0.2, "replica_lost_after": 1.0, "session_secret": SECRET}


@pytest.fixture
async def slow_engine() -> AsyncIterator[FakeEngine]:
    """An engine that takes 50 ms a token: a stream of 64 tokens lasts about 3 s."""
    async with FakeEngine(token_delay=0.05) as fake:
        yield fake


@pytest.fixture
async def replica(slow_engine: FakeEngine, database_url: str) -> AsyncIterator[tuple[Any, str]]:
    """A second replica (its process, its URL), killed after the test if it still runs."""
    process, url = await start_replica(slow_engine, database_url)
    try:
        yield process, url
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def start_replica(engine: FakeEngine, database_url: str) -> tuple[Any, str]:
    """`trajstore proxy` in a process of its own, which the test can kill."""
    port = free_port()
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url,
           "TRAJSTORE_SESSION_SECRET": SECRET, "TRAJSTORE_WRITER_LINGER": "0.01"}  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "proxy", "--engine", engine.url, "--port", str(port),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        for _ in range(300):
            try:
                if (await http.get(url + "/health")).status_code == 200:
                    return process, url
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    process.kill()
    raise AssertionError("the second replica did not start")


async def stream_then_kill(
    replica: Any, url: str, session: dict[str, Any], *, after_tokens: int
) -> int:
    """Stream a turn of `session` through the replica at `url`, SIGKILL it once the agent has
    `after_tokens` tokens (and its writer had a moment to store them); the tokens received."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "count"}],
            "max_tokens": 64, "stream": True}  # fmt: skip
    path = f"{url}/sessions/{session['session_id']}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {session['api_key']}"}
    received = 0
    async with (
        httpx.AsyncClient(timeout=30) as http,
        http.stream("POST", path, json=body, headers=headers) as stream,
    ):
        async for line in stream.aiter_lines():
            received += line.startswith("data:") and '"content"' in line
            if received == after_tokens:
                await asyncio.sleep(0.3)  # its writer stores what it has
                replica.send_signal(signal.SIGKILL)
                break
    await replica.wait()
    return received


async def settled_turn(proxy: RunningProxy, session_id: str) -> dict[str, Any]:
    """The session's one turn, once it is no longer in progress (10 s at most)."""
    for _ in range(100):
        [turn] = (await proxy.session_record(session_id))["turns"]
        if turn["status"] != "in_progress":
            break
        await asyncio.sleep(0.1)
    return turn


async def test_a_replica_killed_mid_stream_leaves_a_failed_turn_not_an_open_one(
    start_proxy: ProxyFactory, slow_engine: FakeEngine, replica: tuple[Any, str]
) -> None:
    a = await start_proxy([slow_engine.url], **REAPING)
    session = await a.new_session()
    sid = session["session_id"]
    received = await stream_then_kill(*replica, session, after_tokens=24)

    turn = await settled_turn(a, sid)
    assert turn["status"] == "failed"
    assert turn["failure"]["reason"] == "replica_lost"
    stored = len(turn["choices"][0]["token_ids"])
    assert 0 < stored <= received + 1  # what reached the log, never more than was sent
    assert turn["failure"]["partial_tokens"] == {"0": stored}
    # The session goes on without the dead replica: the next turn and the finish work.
    await a.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=4
    )
    finished = await a.finish(sid)
    assert finished.status_code == 200


async def test_a_cut_turn_is_recorded_even_when_its_session_was_finished_at_once(
    start_proxy: ProxyFactory, slow_engine: FakeEngine, replica: tuple[Any, str]
) -> None:
    a = await start_proxy([slow_engine.url], **REAPING)
    session = await a.new_session()
    sid = session["session_id"]
    await stream_then_kill(*replica, session, after_tokens=1)
    # The orchestrator gives up at once, long before the replica counts as lost.
    finished = await a.finish(sid, "error")
    assert finished.status_code == 200
    turn = await settled_turn(a, sid)
    assert turn["status"] == "failed"
    assert turn["failure"]["reason"] == "replica_lost"


async def test_requests_of_live_replicas_are_left_alone_however_slow(
    start_proxy: ProxyFactory, slow_engine: FakeEngine
) -> None:
    proxy = await start_proxy([slow_engine.url], **REAPING)
    session = await proxy.new_session()
    answer = await proxy.agent(session).chat.completions.create(  # ~3 s, lost_after 1 s
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=64,
        extra_headers={"X-Fake-Fault": "slow"},
    )  # fmt: skip
    assert answer.choices[0].finish_reason == "length"
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["status"] == "completed"


async def test_a_session_nobody_finishes_is_finished_as_timeout(
    start_proxy: ProxyFactory, slow_engine: FakeEngine
) -> None:
    proxy = await start_proxy([slow_engine.url], session_idle_timeout=1.0, **REAPING)
    idle, busy = await proxy.new_session(), await proxy.new_session()
    await proxy.agent(idle).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    # `busy` keeps calling the model meanwhile (0.2 s a call): activity keeps a session open.
    record = await proxy.session_record(idle["session_id"])
    for _ in range(50):
        if record["status"] != "active":
            break
        await proxy.agent(busy).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        record = await proxy.session_record(idle["session_id"])
    assert record["status"] == "timeout"
    assert "no activity" in record["finish_reason"]
    assert (await proxy.session_record(busy["session_id"]))["status"] == "active"
