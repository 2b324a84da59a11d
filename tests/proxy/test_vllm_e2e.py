"""End to end against a real vLLM (CPU build) serving the generated tiny model.

The agent is the official openai client; what it receives, what vLLM computed and what the store
keeps must agree token for token. Deselect with `-m "not vllm"` on a machine without vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy, made_whole
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.vllm_server import AGENT_CONTEXT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    }
]
SAMPLING: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "max_tokens": 12}
ASK_ALL: dict[str, Any] = {"logprobs": True, "extra_body": {"return_token_ids": True}}


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, vllm: str) -> RunningProxy:
    return await start_proxy([vllm])


def direct_client(vllm: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{vllm}/v1", api_key="none", max_retries=0)


async def session_record(proxy: RunningProxy, session_id: str) -> dict[str, Any]:
    response = await proxy.http.get(f"{proxy.url}/sessions/{session_id}")
    assert response.status_code == 200
    record: dict[str, Any] = made_whole(response.json())  # each turn's whole prompt too
    return record


def extra(obj: Any, key: str) -> Any:
    """A vLLM field the openai types do not declare (token ids)."""
    return (obj.model_extra or {}).get(key)


async def test_multi_turn_tool_session_is_stored_token_exact(
    proxy: RunningProxy, vllm: str
) -> None:
    session = await proxy.new_session(task_id="add")
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers with the add tool."},
        {"role": "user", "content": "add 2 and 3"},
    ]
    received: list[tuple[list[int], list[int], list[float]]] = []
    for turn in range(3):
        answer = await agent.chat.completions.create(
            messages=messages,
            tools=TOOLS,
            seed=turn,
            **SAMPLING,
            **ASK_ALL,  # type: ignore[arg-type]
        )
        choice = answer.choices[0]
        logprobs = [c.logprob for c in choice.logprobs.content]  # type: ignore[union-attr]
        received.append((extra(answer, "prompt_token_ids"), extra(choice, "token_ids"), logprobs))
        messages.append({"role": "assistant", "content": choice.message.content or ""})
        messages.append({"role": "tool", "tool_call_id": f"call-{turn}", "content": "5"})

    record = await session_record(proxy, session["session_id"])
    assert len(record["turns"]) == 3
    for turn, (prompt, completion, logprobs) in zip(record["turns"], received, strict=True):
        assert turn["prompt_token_ids"] == prompt  # exactly what vLLM saw
        [choice] = turn["choices"]
        assert choice["token_ids"] == completion  # exactly what vLLM produced
        # float32 on disk: equal to vLLM's value rounded to float32, bit for bit
        assert (
            np.array(choice["logprobs"], np.float32).tobytes()
            == np.array(logprobs, np.float32).tobytes()
        )
        assert turn["tools"] == TOOLS
        assert turn["engine"] == vllm

    # The same request sent straight to vLLM, with the same seed, samples the same tokens.
    again = await direct_client(vllm).chat.completions.create(
        messages=messages[:2],
        tools=TOOLS,
        seed=0,
        **SAMPLING,
        **ASK_ALL,  # type: ignore[arg-type]
    )
    assert extra(again.choices[0], "token_ids") == record["turns"][0]["choices"][0]["token_ids"]


async def test_what_the_agent_did_not_ask_for_is_not_sent_back(
    proxy: RunningProxy, vllm: str
) -> None:
    session = await proxy.new_session()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "seed": 7}
    via_proxy = await proxy.agent(session).chat.completions.create(**body, **SAMPLING)
    straight = await direct_client(vllm).chat.completions.create(**body, **SAMPLING)
    shape = via_proxy.model_dump(exclude={"id", "created"})
    assert shape == straight.model_dump(exclude={"id", "created"})
    assert via_proxy.choices[0].logprobs is None
    assert extra(via_proxy, "prompt_token_ids") is None
    # ... while the store has the tokens anyway.
    record = await session_record(proxy, session["session_id"])
    assert record["turns"][0]["choices"][0]["token_ids"]
    assert len(record["turns"][0]["choices"][0]["logprobs"]) == len(
        record["turns"][0]["choices"][0]["token_ids"]
    )


async def test_streaming_tokens_received_equal_tokens_stored(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    stream = await proxy.agent(session).chat.completions.create(
        messages=[{"role": "user", "content": "count"}], stream=True, seed=3,
        stream_options={"include_usage": True}, **{**SAMPLING, "max_tokens": 40}, **ASK_ALL,
    )  # fmt: skip
    prompt: list[int] | None = None
    tokens: list[int] = []
    logprobs: list[float] = []
    async for chunk in stream:
        prompt = prompt or extra(chunk, "prompt_token_ids")
        for choice in chunk.choices:
            tokens += extra(choice, "token_ids") or []
            logprobs += [c.logprob for c in (choice.logprobs.content if choice.logprobs else [])]
    record = await session_record(proxy, session["session_id"])
    [turn] = record["turns"]
    assert turn["prompt_token_ids"] == prompt
    assert turn["choices"][0]["token_ids"] == tokens
    assert len(tokens) == turn["usage"]["completion_tokens"]
    assert np.allclose(turn["choices"][0]["logprobs"], logprobs, atol=1e-6)
    assert turn["ttft_s"] is not None and turn["ttft_s"] <= turn["latency_s"]


async def test_completions_with_a_token_id_prompt(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    prompt = [1, 20, 30, 40, 50]
    answer = await proxy.agent(session).completions.create(
        prompt=prompt, seed=1, extra_body={"return_token_ids": True}, **SAMPLING
    )
    record = await session_record(proxy, session["session_id"])
    [turn] = record["turns"]
    assert turn["prompt_token_ids"] == prompt
    assert turn["choices"][0]["token_ids"] == extra(answer.choices[0], "token_ids")
    assert len(turn["choices"][0]["logprobs"]) == len(turn["choices"][0]["token_ids"])
    assert answer.choices[0].logprobs is None  # not asked, not sent


async def test_concurrent_sessions_stick_to_their_engine_and_lose_nothing(
    start_proxy: ProxyFactory, vllm: str
) -> None:
    async with FakeEngine() as fake:
        proxy = await start_proxy([vllm, fake.url])
        sessions = [await proxy.new_session() for _ in range(16)]

        async def run(session: dict[str, Any]) -> list[list[int]]:
            agent = proxy.agent(session)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            received = []
            for turn in range(3):
                stream = await agent.chat.completions.create(
                    messages=messages, stream=True, seed=turn,  # type: ignore[arg-type]
                    **{**SAMPLING, "max_tokens": 8}, extra_body={"return_token_ids": True},
                )  # fmt: skip
                ids: list[int] = []
                text = ""
                async for chunk in stream:
                    for choice in chunk.choices:
                        ids += extra(choice, "token_ids") or []
                        text += choice.delta.content or ""
                received.append(ids)
                messages += [{"role": "assistant", "content": text},
                             {"role": "user", "content": "more"}]  # fmt: skip
            return received

        results = await asyncio.gather(*(run(s) for s in sessions))
        used: set[str] = set()
        for session, received in zip(sessions, results, strict=True):
            url = f"{proxy.url}/sessions/{session['session_id']}/finish"
            assert (await proxy.http.post(url, json={"status": "completed"})).status_code == 200
            record = await session_record(proxy, session["session_id"])
            engines = {turn["engine"] for turn in record["turns"]}
            assert len(engines) == 1  # every turn of a session on the same engine
            used |= engines
            stored = [turn["choices"][0]["token_ids"] for turn in record["turns"]]
            assert stored == received  # tokens the agent got == tokens the store keeps
        assert used == {vllm, fake.url}  # and sessions spread over both


async def test_vllm_refusal_is_passed_on(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{session['base_url']}/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                  "max_tokens": AGENT_CONTEXT + 1},  # more than the context holds
            headers={"Authorization": f"Bearer {session['api_key']}"},
        )  # fmt: skip
    assert response.status_code == 400
    assert "max_tokens" in response.json()["error"]["message"]
    record = await session_record(proxy, session["session_id"])
    assert record["turns"][0]["status"] == "failed"


async def test_samples_built_from_a_real_session_hold_exactly_what_vllm_saw_and_produced(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session(task_id="add")
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    for turn in range(3):
        answer = await agent.chat.completions.create(
            messages=messages,
            tools=TOOLS,
            seed=10 + turn,
            **SAMPLING,  # type: ignore[arg-type]
        )
        messages.append({"role": "assistant", "content": answer.choices[0].message.content or ""})
        messages.append({"role": "tool", "tool_call_id": f"call-{turn}", "content": "5"})
    url = f"{proxy.url}/sessions/{session['session_id']}/finish"
    assert (await proxy.http.post(url, json={"status": "completed"})).status_code == 200
    turns = (await session_record(proxy, session["session_id"]))["turns"]

    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
        rows = await store.pool.fetch(
            "SELECT * FROM samples WHERE session_id = $1 ORDER BY branch", session["session_id"]
        )
    # A random model's text does not round-trip through the chat template, so the history may
    # diverge into branches; whatever the branching, every turn sits in exactly one sample,
    # preceded by exactly the prompt vLLM saw, its completion masked 1.
    placed = 0
    for row in rows:
        tokens = np.frombuffer(row["token_ids"], "<i4").tolist()
        mask = list(row["loss_mask"])
        end = 0
        for turn in turns:
            prompt, completion = turn["prompt_token_ids"], turn["choices"][0]["token_ids"]
            stop = len(prompt) + len(completion)
            if tokens[:stop] == prompt + completion and stop > end:
                assert mask[len(prompt) : stop] == [1] * len(completion)
                end = stop
                placed += 1
        assert end == len(tokens)  # the sample is nothing but its turns
    assert placed == len(turns) == 3
