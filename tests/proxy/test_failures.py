"""Failures: each is recorded as an event and answered clearly; nothing is dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from tests.support import eventually
from trajstore.store import EventType
from trajstore.store.connection import connect

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def failures(events_of: Any, session_id: str) -> list[dict[str, Any]]:
    return [e.payload for e in await events_of(session_id) if e.type == EventType.REQUEST_FAILED]


async def settle(proxy: RunningProxy) -> None:
    """Wait until the proxy's writer has stored everything (GET /sessions flushes)."""
    state = proxy.app.state.proxy
    await state.registry.writer.flush()


async def failed_call(
    proxy: RunningProxy, events_of: Any, fault: str
) -> tuple[int, dict[str, Any]]:
    """A chat call the fake engine fails with `fault`: the status the agent got, and the failure
    the proxy recorded for it."""
    session = await proxy.new_session()
    with pytest.raises(openai.APIStatusError) as caught:
        await proxy.agent(session).chat.completions.create(
            **CHAT, extra_headers={"X-Fake-Fault": fault}
        )
    await settle(proxy)
    [failure] = await failures(events_of, session["session_id"])
    return caught.value.status_code, failure


async def test_engine_refusal_is_passed_on_and_recorded(
    proxy: RunningProxy, events_of: Any
) -> None:
    status, failure = await failed_call(proxy, events_of, "error-400")
    assert status == 400
    assert failure["reason"] == "engine_error" and failure["status"] == 400


async def test_engine_down_gives_503_with_retry_after(start_proxy: ProxyFactory) -> None:
    proxy = await start_proxy([f"http://127.0.0.1:{free_port()}"])  # nobody listens there
    session = await proxy.new_session()
    response = await proxy.http.post(
        f"{session['base_url']}/chat/completions", json=CHAT,
        headers={"Authorization": f"Bearer {session['api_key']}"},
    )  # fmt: skip
    assert response.status_code == 503
    assert int(response.headers["Retry-After"]) >= 1
    assert "engine" in response.json()["error"]["message"].lower()


async def test_engine_timeout_is_recorded_as_failed(
    start_proxy: ProxyFactory, engine: FakeEngine, events_of: Any
) -> None:
    engine.delay = 5.0
    proxy = await start_proxy([engine.url], request_timeout=0.3)
    status, failure = await failed_call(proxy, events_of, "slow")
    assert status == 504
    assert failure["reason"] == "engine_timeout"


async def test_agent_hanging_up_mid_stream_is_recorded_with_its_partial_tokens(
    proxy: RunningProxy, engine: FakeEngine, events_of: Any
) -> None:
    session = await proxy.new_session()
    headers = {"Authorization": f"Bearer {session['api_key']}", "X-Fake-Fault": "stall-mid-stream"}
    body = {**CHAT, "max_tokens": 20, "stream": True}
    received = 0
    url = f"{session['base_url']}/chat/completions"
    async with (
        httpx.AsyncClient() as http,
        http.stream("POST", url, json=body, headers=headers) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                received += 1
            if received == 5:
                break  # the agent gives up and closes the connection
    await eventually(lambda: bool(engine.disconnects), timeout=5)  # the engine was told too
    found: list[dict[str, Any]] = []
    for _ in range(50):  # the relay records the abort as it unwinds
        await settle(proxy)
        if found := await failures(events_of, session["session_id"]):
            break
        await asyncio.sleep(0.05)
    [failure] = found
    assert failure["reason"] == "client_disconnected"
    chunks = [e for e in await events_of(session["session_id"])
              if e.type == EventType.COMPLETION_CHUNK]  # fmt: skip
    assert sum(e.n_tokens for e in chunks) == int(failure["partial_tokens"]["0"]) > 0


async def test_engine_dropping_mid_stream_is_an_error_to_the_agent_and_a_record(
    proxy: RunningProxy, events_of: Any
) -> None:
    session = await proxy.new_session()
    stream = await proxy.agent(session).chat.completions.create(
        **{**CHAT, "max_tokens": 20}, stream=True,
        extra_headers={"X-Fake-Fault": "drop-mid-stream"},
    )  # fmt: skip
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    await settle(proxy)
    [failure] = await failures(events_of, session["session_id"])
    assert failure["reason"] == "engine_error"
    assert int(failure["partial_tokens"]["0"]) > 0


async def test_a_live_engine_whose_stream_broke_serves_the_next_request(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    stream = await proxy.agent(session).chat.completions.create(
        **CHAT, stream=True, extra_headers={"X-Fake-Fault": "drop-mid-stream"}
    )
    with pytest.raises(openai.APIError):
        async for _ in stream:
            pass
    # The broken stream made the engine a suspect; it answers its health check, so it is back.
    await eventually(lambda: all(e.healthy for e in proxy.app.state.proxy.engines.engines))
    await proxy.agent(session).chat.completions.create(**CHAT)


async def test_an_engine_killed_mid_stream_gets_no_more_requests(
    start_proxy: ProxyFactory,
) -> None:
    async with FakeEngine(token_delay=0.05) as first, FakeEngine(token_delay=0.05) as second:
        proxy = await start_proxy([first.url, second.url])
        pool = proxy.app.state.proxy.engines
        session = await proxy.new_session()
        doomed = pool.choose(session["session_id"])
        stream = await proxy.agent(session).chat.completions.create(
            **{**CHAT, "max_tokens": 40}, stream=True
        )

        async def read_and_kill_its_engine() -> None:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    await (first if doomed.url == first.url else second).stop()

        with pytest.raises(openai.APIError):
            await read_and_kill_its_engine()
        # The next request of the session goes to the other engine at once, not to the dead
        # one (which would be a 502 and a failed turn until the next health check).
        answer = await proxy.agent(session).chat.completions.create(**CHAT)
        assert answer.choices[0].message.content
        assert not doomed.healthy


async def test_a_saturated_recorder_refuses_new_requests_with_503(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str
) -> None:
    proxy = await start_proxy([engine.url], writer_max_pending=4)
    session = await proxy.new_session()
    blocker = await connect(database_url)
    transaction = blocker.transaction()
    await transaction.start()
    await blocker.execute("LOCK TABLE events IN EXCLUSIVE MODE")  # the store stalls
    try:
        agent = proxy.agent(session)
        await agent.chat.completions.create(**CHAT)  # its 4 events fill the queue
        with pytest.raises(openai.APIStatusError) as caught:
            await agent.chat.completions.create(**CHAT)
        assert caught.value.status_code == 503
        assert caught.value.response.headers["Retry-After"]
    finally:
        await transaction.rollback()
        await blocker.close()
    await settle(proxy)
    record = (await proxy.http.get(f"{proxy.url}/sessions/{session['session_id']}")).json()
    assert len(record["turns"]) == 1 and record["turns"][0]["status"] == "completed"


async def test_a_session_past_its_deadline_is_timed_out(
    proxy: RunningProxy, events_of: Any
) -> None:
    session = await proxy.new_session(deadline_s=0.2)
    await asyncio.sleep(0.3)
    with pytest.raises(openai.ConflictError, match="deadline"):
        await proxy.agent(session).chat.completions.create(**CHAT)
    finished = [e for e in await events_of(session["session_id"])
                if e.type == EventType.SESSION_FINISHED]  # fmt: skip
    assert finished[0].payload["status"] == "timeout"


async def test_a_bug_in_a_model_call_is_a_logged_500_in_openai_shape(
    proxy: RunningProxy, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The model calls are served in front of FastAPI's stack, so its error pages are not there:
    # an unexpected exception must still reach the agent as an error it can read, and the log.
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(proxy.app.state.proxy.forwarder, "handle", broken)
    session = await proxy.new_session()
    with pytest.raises(openai.InternalServerError) as caught:
        await proxy.agent(session).chat.completions.create(**CHAT)
    assert caught.value.status_code == 500
    assert "RuntimeError: a bug" in caught.value.message
    assert "serving a model call failed" in caplog.text
