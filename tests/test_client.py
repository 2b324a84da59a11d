"""`trajstore.client` against the real proxy (on the fake engine) and the real PostgreSQL: a
session made, used by an official OpenAI client, rewarded, finished on leaving its block, read
back; an exception in the block records the session as failed, with the exception's message."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.client import (
    AsyncClient,
    Client,
    ProxyRefused,
    ProxyUnreachable,
    SessionClosed,
    exit_status,
)
from trajstore.store import EventStore, EventType
from trajstore.store.recorded import recorded_session

CHAT: dict[str, Any] = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                        "max_tokens": 4}  # fmt: skip


async def finish_events(database_url: str, session_id: str) -> list[dict[str, Any]]:
    async with await EventStore.open(database_url) as store:
        events = await store.read_session(session_id)
    return [dict(e.payload) for e in events if e.type == EventType.SESSION_FINISHED]


async def test_a_session_block_records_the_agent_rewards_and_finishes(
    proxy: RunningProxy, database_url: str
) -> None:
    async with AsyncClient(proxy.url, database_url=database_url) as client:
        fields = {"task_id": "t1", "group_id": "g1", "metadata": {"tags": ["c"]}, "deadline_s": 60}
        async with client.session("r-client", **fields) as session:
            assert session.base_url == f"{proxy.url}/sessions/{session.session_id}/v1"
            assert session.env()["ANTHROPIC_BASE_URL"] == session.anthropic_base_url
            agent = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key,
                                       max_retries=0)  # fmt: skip
            reply = await agent.chat.completions.create(**CHAT)
            await agent.close()
            await session.reward(0.75, components={"correct": 1.0}, source="test")
        assert session.closed == "completed"
        recorded = await session.turns()
        samples = await session.samples()
        record = await session.record()
    assert recorded["status"] == "completed" and recorded["rewards"][-1]["value"] == 0.75
    assert len(recorded["turns"]) == 1
    [sample] = samples
    assert sample.session.reward == 0.75 and sample.session.task_id == "t1"
    assert sample.session.group_id == "g1" and record.status == "completed"
    # The sample holds what the agent was answered, token for token.
    assert sample.response_len == reply.usage.completion_tokens > 0  # type: ignore[union-attr]
    assert record.metadata == {"tags": ["c"]} and record.deadline_s == 60
    [finished] = await finish_events(database_url, session.session_id)
    assert finished["status"] == "completed"


async def test_an_exception_in_the_block_finishes_the_session_as_error_with_its_message(
    proxy: RunningProxy, database_url: str
) -> None:
    async with AsyncClient(proxy.url) as client:
        with pytest.raises(ValueError, match="the verifier crashed"):
            async with client.session("r-client") as session:
                raise ValueError("the verifier crashed")
        assert session.closed == "error"
        recorded = await session.turns()
    assert recorded["status"] == "error"
    [finished] = await finish_events(database_url, session.session_id)
    assert finished["status"] == "error"
    assert finished["reason"] == "ValueError: the verifier crashed"


async def test_the_sync_client_in_a_thread_does_the_same(
    proxy: RunningProxy, database_url: str
) -> None:
    def orchestrate() -> tuple[str, str, int]:
        with Client(proxy.url, database_url=database_url) as client:
            with client.session("r-sync", task_id="t") as done:
                agent = openai.OpenAI(base_url=done.base_url, api_key=done.api_key, max_retries=0)
                agent.chat.completions.create(**CHAT)
                done.reward(1.0)
            with pytest.raises(KeyError), client.session("r-sync") as failed:
                raise KeyError("no answer")
            return done.session_id, failed.session_id, len(done.samples())

    # In a thread: the proxy serves from this test's event loop.
    done, failed, samples = await asyncio.to_thread(orchestrate)
    assert samples == 1
    assert (await finish_events(database_url, done))[0]["status"] == "completed"
    [finished] = await finish_events(database_url, failed)
    assert (finished["status"], finished["reason"]) == ("error", "KeyError: 'no answer'")


async def test_discard_and_an_explicit_finish_are_not_finished_again(
    proxy: RunningProxy, database_url: str
) -> None:
    async with AsyncClient(proxy.url) as client:
        async with client.session("r-client") as kept_out:
            await kept_out.discard("flaky task")
        async with client.session("r-client") as aborted:
            assert await aborted.finish("aborted", reason="budget") == "aborted"
        with pytest.raises(SessionClosed) as closed:
            await aborted.finish()
    assert closed.value.status == 409 and "already finished" in closed.value.message
    assert (await finish_events(database_url, aborted.session_id))[0]["status"] == "aborted"
    assert await finish_events(database_url, kept_out.session_id) == []
    async with await EventStore.open(database_url) as store:
        assert (await recorded_session(store, kept_out.session_id)).discarded == "flaky task"


async def test_the_admin_key_and_what_the_proxy_refuses_are_clear_errors(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    locked = await start_proxy([engine.url], api_key="admin-secret")
    async with AsyncClient(locked.url) as anonymous:
        with pytest.raises(ProxyRefused) as refused:
            await anonymous.create_session("r")
    assert refused.value.status == 401 and "API key" in str(refused.value)
    async with AsyncClient(locked.url, api_key="admin-secret") as admin:
        session = await admin.create_session("r", session_id="chosen-1")
        again = await admin.create_session("r", session_id="chosen-1")
        assert again.info == session.info
        with pytest.raises(ProxyRefused) as bad:
            await session.finish("finished-ish")
        assert bad.value.status == 422
    async with AsyncClient("http://127.0.0.1:9") as nowhere:
        with pytest.raises(ProxyUnreachable):
            await nowhere.create_session("r")


def test_how_a_block_ends_names_the_status() -> None:
    assert exit_status(None) == ("completed", None)
    assert exit_status(TimeoutError("slow")) == ("timeout", "TimeoutError: slow")
    assert exit_status(asyncio.CancelledError())[0] == "aborted"
    assert exit_status(RuntimeError("x" * 900))[1] == "RuntimeError: " + "x" * 486


def test_a_misspelt_session_field_is_named_before_anything_is_sent() -> None:
    # The proxy's own model of the body checks it: no request leaves (the URL answers nothing).
    with Client("http://127.0.0.1:9") as client, pytest.raises(ValueError, match="colour"):
        client.create_session("r", colour="red")
