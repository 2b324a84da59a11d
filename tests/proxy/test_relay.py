"""Engines that dial in: `trajstore relay` beside an engine, the proxy routing over its socket.

The relays whose death a test needs are real `python -m trajstore relay` processes, killed with
SIGKILL; the others run in this event loop (`proxy.relay.Relay`), which is the same code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy, serve_proxy
from tests.support import eventually
from trajstore.proxy import relay_protocol as rp
from trajstore.proxy.engines import Engine
from trajstore.proxy.relay import Relay
from trajstore.proxy.relay_channel import RelayChannel
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventType

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
TOKEN = "relay-secret"


@contextlib.asynccontextmanager
async def relay_process(
    proxy_url: str, engine_url: str, name: str, *args: str, token: str = TOKEN
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`trajstore relay` as a real process; killed at the end if still running."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "relay", "--proxy", proxy_url, "--engine", engine_url,
        "--token", token, "--name", name, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield child
    finally:
        if child.returncode is None:
            child.kill()
        await child.wait()


@contextlib.asynccontextmanager
async def relay_task(proxy_url: str, engine_url: str, name: str) -> AsyncIterator[Relay]:
    """A relay in this event loop, reconnecting quickly."""
    relay = Relay(proxy_url, engine_url, TOKEN, name, health_interval=0.2, max_backoff=0.5)
    task = asyncio.create_task(relay.run())
    try:
        yield relay
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def engine_of(proxy: RunningProxy, url: str) -> Engine | None:
    """The proxy's engine at `url`, if it has one."""
    engines: list[Engine] = proxy.app.state.proxy.engines.engines
    return next((e for e in engines if e.url == url), None)


async def dialled_in(proxy: RunningProxy, name: str) -> Engine:
    """Wait until the relay `name` is connected and healthy at the proxy."""

    def ready() -> bool:
        engine = engine_of(proxy, f"relay://{name}")
        return engine is not None and engine.healthy

    await eventually(ready, timeout=30)
    engine = engine_of(proxy, f"relay://{name}")
    assert engine is not None
    return engine


async def session_on(proxy: RunningProxy, url: str) -> dict[str, Any]:
    """A new session whose preferred engine is the one at `url`."""
    pool = proxy.app.state.proxy.engines
    for i in range(1000):
        session_id = f"s-{os.getpid()}-{free_port()}-{i}"
        if pool.preferred(session_id).url == url:
            return await proxy.new_session(session_id=session_id)
    raise AssertionError(f"no session hashes to {url}")


async def recorded(proxy: RunningProxy, events_of: Any, session_id: str) -> list[Any]:
    await proxy.app.state.proxy.registry.writer.flush()
    return list(await events_of(session_id))


def failures(events: list[Any]) -> list[dict[str, Any]]:
    return [e.payload for e in events if e.type == EventType.REQUEST_FAILED]


@pytest.fixture
async def relayed(start_proxy: ProxyFactory) -> RunningProxy:
    """A proxy with no engine of its own, taking relays with the token."""
    return await start_proxy([], relay_tokens=[TOKEN])


async def test_calls_through_a_relay_are_recorded_exactly_as_direct_ones(
    start_proxy: ProxyFactory, relayed: RunningProxy, engine: FakeEngine, database_url: str
) -> None:
    direct = await start_proxy([engine.url])
    async with relay_task(relayed.url, engine.url, "gpu-0"):
        await dialled_in(relayed, "gpu-0")
        samples = []
        for proxy in (direct, relayed):
            session = await proxy.new_session()
            agent = proxy.agent(session)
            whole = await agent.chat.completions.create(**CHAT, logprobs=True)
            messages = [*CHAT["messages"], {"role": "assistant",
                        "content": whole.choices[0].message.content},
                        {"role": "user", "content": "more"}]  # fmt: skip
            stream = await agent.chat.completions.create(
                **{**CHAT, "messages": messages}, stream=True, logprobs=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            assert text
            [sample] = await proxy.finished_samples(database_url, session["session_id"])
            samples.append(sample)
    via_direct, via_relay = samples
    assert via_relay.token_ids == via_direct.token_ids
    assert via_relay.logprobs == via_direct.logprobs
    assert via_relay.loss_mask == via_direct.loss_mask
    assert via_relay.engines == ["relay://gpu-0"] and via_direct.engines == [engine.url]


async def test_many_requests_share_one_socket(relayed: RunningProxy) -> None:
    async with FakeEngine(token_delay=0.01) as engine, relay_task(relayed.url, engine.url, "many"):
        await dialled_in(relayed, "many")
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, engine.in_flight)
                await asyncio.sleep(0.005)

        async def call(i: int) -> str:
            session = await relayed.new_session()
            agent = relayed.agent(session)
            body = {**CHAT, "max_tokens": 20, "seed": i}
            if i % 2:
                answer = await agent.chat.completions.create(**body)
                return answer.choices[0].message.content or ""
            stream = await agent.chat.completions.create(**body, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        watcher = asyncio.create_task(watch())
        try:
            texts = await asyncio.gather(*(call(i) for i in range(8)))
        finally:
            watcher.cancel()
        assert all(texts) and len(set(texts)) > 1  # each its own answer, none crossed
        assert most > 1  # they were in flight together, over the one socket


async def test_a_relay_killed_mid_stream_is_a_recorded_failure_and_leaves_rotation(
    start_proxy: ProxyFactory, events_of: Any
) -> None:
    async with FakeEngine(token_delay=0.05) as far, FakeEngine() as near:
        proxy = await start_proxy([near.url], relay_tokens=[TOKEN])
        async with relay_process(proxy.url, far.url, "doomed") as child:
            engine = await dialled_in(proxy, "doomed")
            session = await session_on(proxy, engine.url)
            stream = await proxy.agent(session).chat.completions.create(
                **{**CHAT, "max_tokens": 60}, stream=True
            )

            async def read_and_kill_the_relay() -> None:
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        child.send_signal(signal.SIGKILL)

            with pytest.raises(openai.APIError, match="relay://doomed"):
                await read_and_kill_the_relay()
        assert not engine.healthy
        [failure] = failures(await recorded(proxy, events_of, session["session_id"]))
        assert failure["reason"] == "engine_error" and "relay://doomed" in failure["message"]
        assert int(failure["partial_tokens"]["0"]) > 0
        listed = (await proxy.http.get(f"{proxy.url}/admin/engines")).json()
        [doomed] = [e for e in listed if e["url"] == "relay://doomed"]
        assert doomed["healthy"] is False and doomed["relay"]["connected"] is False
        # The session's next turn goes to the engine left, at once.
        answer = await proxy.agent(session).chat.completions.create(**CHAT)
        assert answer.choices[0].message.content and near.requests


async def test_a_request_whose_relay_died_before_answering_goes_to_another_engine(
    start_proxy: ProxyFactory, events_of: Any
) -> None:
    async with FakeEngine(fault="slow", delay=30) as far, FakeEngine() as near:
        proxy = await start_proxy([near.url], relay_tokens=[TOKEN])
        async with relay_process(proxy.url, far.url, "slow") as child:
            engine = await dialled_in(proxy, "slow")
            session = await session_on(proxy, engine.url)
            call = asyncio.create_task(proxy.agent(session).chat.completions.create(**CHAT))
            await eventually(lambda: len(far.requests) == 1)
            child.send_signal(signal.SIGKILL)
            answer = await call  # nothing had reached the agent: served by the other engine
        assert answer.choices[0].message.content
        events = await recorded(proxy, events_of, session["session_id"])
        [failure] = failures(events)
        assert failure["reason"] == "engine_unreachable"
        engines = [e.payload["engine"] for e in events if e.type == EventType.REQUEST_RECEIVED]
        assert engines == ["relay://slow", near.url]
        assert [e.type for e in events].count(EventType.COMPLETION_FINISHED) == 1


async def test_a_relay_dials_again_when_its_socket_drops(
    engine: FakeEngine, database_url: str
) -> None:
    settings = ProxySettings(engines=[], port=free_port(), relay_tokens=[TOKEN])
    async with relay_task(f"http://127.0.0.1:{settings.port}", engine.url, "back") as relay:
        async with serve_proxy(settings, database_url) as first:
            await dialled_in(first, "back")
        # The proxy went away (a restart): the relay keeps dialling, with backoff.
        await eventually(lambda: not relay.connected.is_set())
        async with serve_proxy(settings, database_url) as second:
            await dialled_in(second, "back")
            session = await second.new_session()
            answer = await second.agent(session).chat.completions.create(**CHAT)
            assert answer.choices[0].message.content


async def test_a_new_relay_of_the_same_name_takes_the_engine_back(
    relayed: RunningProxy, engine: FakeEngine
) -> None:
    async with relay_process(relayed.url, engine.url, "again") as child:
        first = await dialled_in(relayed, "again")
        child.send_signal(signal.SIGKILL)
        await eventually(lambda: not first.healthy)
    async with relay_task(relayed.url, engine.url, "again"):
        assert await dialled_in(relayed, "again") is first  # its entry, policy version kept
        session = await relayed.new_session()
        answer = await relayed.agent(session).chat.completions.create(**CHAT)
        assert answer.choices[0].message.content


async def test_a_wrong_token_is_refused(relayed: RunningProxy, engine: FakeEngine) -> None:
    async with relay_process(relayed.url, engine.url, "intruder", token="wrong") as child:
        _, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 1
    assert "refused the relay token" in err.decode()
    assert engine_of(relayed, "relay://intruder") is None


async def test_the_admin_key_also_lets_a_relay_in(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    proxy = await start_proxy([], api_key="admin-key")
    async with relay_process(proxy.url, engine.url, "by-admin", token="admin-key"):
        await dialled_in(proxy, "by-admin")


async def test_an_agent_leaving_cancels_the_engine_request(
    relayed: RunningProxy, events_of: Any
) -> None:
    async with FakeEngine(token_delay=0.05) as engine, relay_task(relayed.url, engine.url, "c"):
        await dialled_in(relayed, "c")
        session = await relayed.new_session()
        stream = await relayed.agent(session).chat.completions.create(
            **{**CHAT, "max_tokens": 200}, stream=True
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                break
        await stream.close()  # the agent hangs up
        await eventually(lambda: len(engine.disconnects) == 1)  # the engine saw it go
        [failure] = failures(await recorded(relayed, events_of, session["session_id"]))
        assert failure["reason"] == "client_disconnected"


async def test_admin_engines_lists_a_relay_with_its_engines_health(
    relayed: RunningProxy, engine: FakeEngine
) -> None:
    async with relay_task(relayed.url, engine.url, "listed"):
        await dialled_in(relayed, "listed")

        async def listed() -> dict[str, Any]:
            answer = (await relayed.http.get(f"{relayed.url}/admin/engines")).json()
            [entry] = answer
            return dict(entry)

        entry = await listed()
        assert entry["url"] == "relay://listed" and entry["healthy"] is True
        assert entry["transport"] == "relay"
        assert entry["relay"]["engine"] == engine.url and entry["relay"]["connected"] is True
        engine.healthy = False  # the relay's next check of /health reports it
        relay_engine = engine_of(relayed, "relay://listed")
        assert relay_engine is not None
        await eventually(lambda: not relay_engine.healthy)
        entry = await listed()
        assert entry["healthy"] is False and "503" in entry["last_error"]


async def test_a_slow_reader_holds_back_its_own_answer_and_no_other(
    relayed: RunningProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    window = 4096
    monkeypatch.setattr(RelayChannel, "window", window)
    async with FakeEngine() as engine, relay_task(relayed.url, engine.url, "flow"):
        channel = (await dialled_in(relayed, "flow")).transport
        assert isinstance(channel, RelayChannel)
        # The slow reader is forwarding's side of the channel, not an agent over HTTP: between
        # the proxy and an agent, loopback socket buffers hold megabytes, so when an agent that
        # reads nothing stalls the proxy would depend on the kernel.
        body = orjson.dumps({**CHAT, "max_tokens": 1500, "stream": True})
        headers = {"content-type": "application/json"}
        slow = await channel.send(
            "POST", "/v1/chat/completions", body, headers, timeout=30, stream=True
        )
        chunks = slow.chunks()
        first = await anext(chunks)
        # It reads nothing more: the relay sends up to the window and stops there.
        await eventually(lambda: slow.buffered == window)
        stream = await relayed.agent(await relayed.new_session()).chat.completions.create(
            **{**CHAT, "max_tokens": 100}, stream=True
        )
        fast = [c.choices[0].finish_reason async for c in stream if c.choices]
        assert fast[-1] == "length"  # the other request on the socket ran to its end
        assert not slow.done and slow.buffered == window  # while the slow one was held back
        [listed] = (await relayed.http.get(f"{relayed.url}/admin/engines")).json()
        assert listed["relay"]["open_requests"] == 1 and listed["relay"]["buffered_bytes"] == window
        rest = b"".join([chunk async for chunk in chunks])
    events = (first + rest).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]  # all of it came, once the reader read
    assert events[-3].count(b'"finish_reason":"length"') == 1 and len(events) > 1500
    assert slow.done and channel.peak_buffered == window


async def test_a_relay_without_flow_control_is_refused_with_the_reason(
    relayed: RunningProxy,
) -> None:
    async with aiohttp.ClientSession() as http, http.ws_connect(
        rp.websocket_url(relayed.url), headers={"Authorization": f"Bearer {TOKEN}"}
    ) as ws:  # fmt: skip
        await ws.send_str(rp.control(rp.HELLO, name="old", engine="http://e", healthy=True,
                                     error=None, protocol=1))  # fmt: skip
        message = await ws.receive()
    assert message.type == aiohttp.WSMsgType.CLOSE and ws.close_code == 1002
    assert "relay protocol 2" in message.extra and "not 1" in message.extra
    assert engine_of(relayed, "relay://old") is None


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_real_vllm_behind_a_relay(
    relayed: RunningProxy, vllm: str, database_url: str
) -> None:
    async with relay_process(relayed.url, vllm, "vllm-0"):
        await dialled_in(relayed, "vllm-0")
        session = await relayed.new_session()
        agent = relayed.agent(session)
        body = {**CHAT, "model": (await agent.models.list()).data[0].id, "temperature": 0}
        whole = await agent.chat.completions.create(**body)
        stream = await agent.chat.completions.create(**body, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert text == whole.choices[0].message.content
        [first, second] = (await relayed.session_record(session["session_id"]))["turns"]
        assert first["engine"] == second["engine"] == "relay://vllm-0"
        samples = await relayed.finished_samples(database_url, session["session_id"])
        assert samples and all(len(s.logprobs) == len(s.token_ids) for s in samples)
