"""The proxy in front of a fake engine: what agents get back, and what the store keeps.

These tests drive a real uvicorn-served proxy with the official openai client, against a real
PostgreSQL; only the engine is a fake (tests/proxy/fake_engine.py), for the wire details.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import chat_prompt_ids
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.store import EventType
from trajstore.store.connection import connect

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "add 2 and 3"}], "max_tokens": 8}


def without_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer minus what differs between two calls (ids, timestamps)."""
    answer = dict(answer)
    for key in ("id", "created"):
        answer.pop(key, None)
    return answer


async def direct(engine: FakeEngine, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(f"{engine.url}/v1/{path}", json=body)


async def finish(proxy: RunningProxy, session: dict[str, Any]) -> None:
    response = await proxy.finish(session["session_id"])
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "asked", [{}, {"logprobs": True, "extra_body": {"return_token_ids": True}}]
)
async def test_agent_gets_exactly_the_engines_answer_and_the_store_keeps_the_tokens(
    proxy: RunningProxy, engine: FakeEngine, asked: dict[str, Any]
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    answer = await agent.chat.completions.create(**CHAT, **asked)  # type: ignore[call-overload]

    # The same request straight to the engine, as the agent would have made it without us.
    direct_body = {**CHAT, **{k: v for k, v in asked.items() if k != "extra_body"}}
    direct_body.update(asked.get("extra_body", {}))
    expected = (await direct(engine, "chat/completions", direct_body)).json()
    assert without_ids(answer.model_dump(exclude_unset=True)) == without_ids(expected)

    # The engine was always asked for what training needs.
    sent = engine.requests[0]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True

    record = await proxy.session_record(session["session_id"])
    [turn] = record["turns"]
    full = (await direct(engine, "chat/completions", {**CHAT, "return_token_ids": True,
                                                      "logprobs": True})).json()  # fmt: skip
    assert turn["prompt_token_ids"] == full["prompt_token_ids"]
    [choice] = turn["choices"]
    assert choice["token_ids"] == full["choices"][0]["token_ids"]
    assert choice["logprobs"] == pytest.approx(
        [c["logprob"] for c in full["choices"][0]["logprobs"]["content"]], abs=1e-6
    )
    assert choice["finish_reason"] == full["choices"][0]["finish_reason"]
    assert turn["messages"] == CHAT["messages"]
    assert turn["engine"] == engine.url
    assert turn["policy_version"] == "0"
    assert turn["logprobs_mode"] == "raw_logprobs"
    assert turn["sampling"]["max_tokens"] == 8


async def test_streaming_relays_chunks_and_records_them_coalesced(
    proxy: RunningProxy, engine: FakeEngine, events_of: Any
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    body = {**CHAT, "max_tokens": 40}
    chunks = [c async for c in await agent.chat.completions.create(**body, stream=True)]
    texts = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert texts  # content arrived chunk by chunk
    assert all(c.usage is None for c in chunks)  # the agent did not ask for usage
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)

    await finish(proxy, session)
    events = await events_of(session["session_id"])
    chunk_events = [e for e in events if e.type == EventType.COMPLETION_CHUNK]
    tokens = [t for e in chunk_events for t in e.token_ids.tolist()]
    full = (await direct(engine, "chat/completions", {**body, "return_token_ids": True})).json()
    assert tokens == full["choices"][0]["token_ids"]
    assert 1 < len(chunk_events) < len(tokens)  # coalesced: several tokens per event
    finished = next(e for e in events if e.type == EventType.COMPLETION_FINISHED)
    assert finished.payload["usage"]["completion_tokens"] == len(tokens)
    assert finished.payload["ttft_s"] is not None
    assert finished.payload["choices"][0]["message"]["content"] == texts


async def test_streaming_with_everything_asked_passes_usage_and_ids(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    stream = await agent.chat.completions.create(
        **CHAT, stream=True, stream_options={"include_usage": True}, logprobs=True,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    chunks = [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
    ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get(
        "token_ids") or []]  # fmt: skip
    assert len(ids) == 8
    assert (chunks[0].model_extra or {}).get("prompt_token_ids")


async def test_completions_with_a_token_id_prompt(proxy: RunningProxy, engine: FakeEngine) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    answer = await agent.completions.create(model="tiny", prompt=[1, 7, 9, 11], max_tokens=5)
    assert answer.choices[0].logprobs is None
    record = await proxy.session_record(session["session_id"])
    [turn] = record["turns"]
    assert turn["api"] == "completions"
    assert turn["prompt_token_ids"] == [1, 7, 9, 11]
    assert len(turn["choices"][0]["token_ids"]) == 5
    assert len(turn["choices"][0]["logprobs"]) == 5
    assert engine.requests[0]["logprobs"] == 0  # the sampled token's logprob, nothing more


async def test_every_choice_of_n_is_recorded(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    answer = await agent.chat.completions.create(**CHAT, n=2)
    assert len(answer.choices) == 2
    record = await proxy.session_record(session["session_id"])
    choices = record["turns"][0]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert all(len(c["token_ids"]) == 8 for c in choices)


async def test_unknown_fields_pass_through_both_ways(
    proxy: RunningProxy, engine: FakeEngine
) -> None:
    session = await proxy.new_session()
    response = await proxy.http.post(
        f"{session['base_url']}/chat/completions",
        json={**CHAT, "vendor_knob": {"x": 1}},
        headers={"Authorization": f"Bearer {session['api_key']}"},
    )
    assert response.status_code == 200
    assert engine.requests[0]["vendor_knob"] == {"x": 1}
    assert "kv_transfer_params" in response.json()  # a field only the engine knows


async def test_multi_turn_session_with_tools_is_rebuilt_turn_by_turn(proxy: RunningProxy) -> None:
    session = await proxy.new_session(task_id="add", group_id="g1", metadata={"k": "v"})
    agent = proxy.agent(session)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    first = await agent.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                                max_tokens=6)  # type: ignore[arg-type]  # fmt: skip
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "tool", "tool_call_id": "call-1", "content": "5"},
    ]
    await agent.chat.completions.create(model="tiny", messages=messages, tools=tools,
                                        max_tokens=6, stream=False)  # type: ignore[arg-type]  # fmt: skip
    await finish(proxy, session)
    record = await proxy.session_record(session["session_id"])
    assert record["status"] == "completed"
    assert (record["task_id"], record["group_id"], record["metadata"]) == ("add", "g1", {"k": "v"})
    assert len(record["turns"]) == 2
    first_turn, second_turn = record["turns"]
    assert second_turn["tools"] == tools
    assert second_turn["messages"][-1]["role"] == "tool"
    # Turn 2's prompt extends turn 1's prompt and completion, token for token.
    so_far = first_turn["prompt_token_ids"] + first_turn["choices"][0]["token_ids"]
    assert second_turn["prompt_token_ids"][: len(so_far)] == so_far


async def test_session_header_route_for_agents_that_cannot_change_the_path(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    response = await proxy.http.post(
        f"{proxy.url}/v1/chat/completions",
        content=orjson.dumps(CHAT),
        headers={"X-Session-Id": session["session_id"],
                 "Authorization": f"Bearer {session['api_key']}"},
    )  # fmt: skip
    assert response.status_code == 200
    record = await proxy.session_record(session["session_id"])
    assert len(record["turns"]) == 1


async def test_a_slow_stream_shares_few_transactions(
    start_proxy: ProxyFactory, events_of: Callable[[str], Awaitable[list[Any]]]
) -> None:
    # A real engine streams a token every few ms, so a request's events come tens of ms apart;
    # each transaction costs the proxy and PostgreSQL CPU whatever it holds. The recorder
    # lingers (TRAJSTORE_WRITER_LINGER) so that they share one, and finish() does not wait.
    async with FakeEngine(token_delay=0.003) as engine:  # 48 tokens: about 0.15 s
        proxy = await start_proxy([engine.url], writer_linger=1.0, chunk_tokens=8)
        session = await proxy.new_session()
        stream = await proxy.agent(session).chat.completions.create(
            **{**CHAT, "max_tokens": 48}, stream=True
        )
        received = [chunk async for chunk in stream]
        assert received
        started = time.monotonic()
        await finish(proxy, session)
        assert time.monotonic() - started < 0.9, "finish() waited for the linger"
    events = await events_of(session["session_id"])
    turn = [e for e in events if e.stream_id.startswith("request-")]
    assert sum(e.type == EventType.COMPLETION_CHUNK for e in turn) == 6
    assert len({e.tx_id for e in turn}) <= 2, "a request's events went in many transactions"


async def test_a_turn_that_continues_the_last_is_stored_as_its_new_tokens_and_messages(
    proxy: RunningProxy, events_of: Callable[[str], Awaitable[list[Any]]], database_url: str
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    words = " ".join(f"w{i}" for i in range(40))  # a long first prompt, as an agent's is
    messages: list[dict[str, Any]] = [{"role": "user", "content": words}]
    for n in range(3):
        if n == 1:  # streamed: the prompt ids arrive in the first chunk
            stream = await agent.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=6,
                stream=True,  # type: ignore[arg-type]
            )
            content = "".join([c.choices[0].delta.content or "" async for c in stream])
        else:
            answer = await agent.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=6,  # type: ignore[arg-type]
            )
            content = answer.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": content},
            {"role": "user", "content": f"tool output {n}"},
        ]
    # A new conversation in the same session shares no prefix: stored whole.
    await agent.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "start over"}], max_tokens=6
    )
    await finish(proxy, session)

    events = await events_of(session["session_id"])
    stored = [e for e in events if e.type == EventType.PROMPT_TOKENS]
    rebuilt = (await proxy.session_record(session["session_id"]))["turns"]
    whole = [t["prompt_token_ids"] for t in rebuilt]
    # What the agent's requests tokenise to, as the engine saw them.
    expected = [chat_prompt_ids(m) for m in engine_messages(messages)]
    assert whole == expected
    first, *continuing, unrelated = stored
    assert "prefix" not in first.payload
    assert unrelated.payload == {"choice": None, "prompt_source": "rendered", "v": 2}
    for event, previous, prompt in zip(continuing, rebuilt, whole[1:3], strict=False):
        so_far = len(previous["prompt_token_ids"]) + len(previous["choices"][0]["token_ids"])
        assert event.payload["prefix"] == {"request_id": previous["request_id"], "n_tokens": so_far}
        assert event.payload["n_tokens"] == len(prompt)
        assert event.token_ids.tolist() == prompt[so_far:]  # only the new tokens are stored
    assert len(unrelated.token_ids) == len(whole[3])
    # The messages too: each continuing request stores the messages after the last turn's.
    sent = engine_messages(messages)
    bodies = [e for e in events if e.type == EventType.REQUEST_RECEIVED]
    assert "messages_prefix" not in bodies[0].payload
    assert "messages_prefix" not in bodies[3].payload  # a new conversation: stored whole
    for n in (1, 2):
        assert bodies[n].payload["messages_prefix"] == {
            "request_id": rebuilt[n - 1]["request_id"],
            "n_messages": len(sent[n - 1]),
        }
        assert bodies[n].payload["body"]["messages"] == sent[n][len(sent[n - 1]) :]
    assert [t["messages"] for t in rebuilt] == sent
    # SQL readers count whole prompts and see whole messages.
    conn = await connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT prompt_tokens, messages FROM turns WHERE session_id = $1 ORDER BY position",
            session["session_id"],
        )
    finally:
        await conn.close()
    assert [r["prompt_tokens"] for r in rows] == list(map(len, whole))
    assert [orjson.loads(r["messages"]) for r in rows] == sent


def engine_messages(messages: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The message lists of the test's four requests: three growing turns, then a fresh one."""
    return [messages[: 1 + 2 * n] for n in range(3)] + [[{"role": "user", "content": "start over"}]]
