"""The Anthropic Messages and OpenAI Responses APIs through a session, against a real vLLM (CPU
build) on the generated tiny model, with the agents' official clients: the `anthropic` SDK, the
`openai` client's `responses`, and the OpenAI Agents SDK's default (Responses) model.

What the agent receives is its API's own shape; what the store keeps is what the engine saw and
sampled, token for token (asked of the engine directly, greedy); and multi-turn sessions of each
become training samples like chat ones do.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.proxy.apis_wire import ADD_SCHEMA
from tests.proxy.fixtures import ProxyFactory, RunningProxy, made_whole
from trajstore.store import EventStore
from trajstore.store.samples import build_samples
from trajstore.store.sessions import rebuild_session

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SYSTEM = "You add numbers with the add tool."
TWO_TEXTS = [{"type": "text", "text": "add 2"}, {"type": "text", "text": "and 3"}]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "Add.", "parameters": ADD_SCHEMA},
    }
]


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, vllm: str) -> RunningProxy:
    return await start_proxy([vllm])


def claude(proxy: RunningProxy, session: dict[str, Any]) -> anthropic.AsyncAnthropic:
    """The Anthropic SDK as a Claude-Code-style agent sets it up (ANTHROPIC_BASE_URL and key)."""
    return anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )


async def recorded(proxy: RunningProxy, session_id: str) -> dict[str, Any]:
    response = await proxy.http.get(f"{proxy.url}/sessions/{session_id}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = made_whole(response.json())  # each turn's whole prompt too
    return result


async def engine_answer(vllm: str, body: dict[str, Any]) -> dict[str, Any]:
    """The same request sent straight to vLLM's chat completions, with token ids."""
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(
            f"{vllm}/v1/chat/completions",
            json={**body, "model": "tiny", "return_token_ids": True, "logprobs": True},
        )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def assert_same_tokens(turn: dict[str, Any], direct: dict[str, Any]) -> None:
    """The turn as stored is the engine's own answer to the same greedy request."""
    [choice] = turn["choices"]
    assert turn["prompt_token_ids"] == direct["prompt_token_ids"]
    assert choice["token_ids"] == direct["choices"][0]["token_ids"]
    logprobs = [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]]
    np.testing.assert_allclose(choice["logprobs"], logprobs, atol=1e-5)


async def finish_and_sample(proxy: RunningProxy, database_url: str, session_id: str) -> list[Any]:
    response = await proxy.http.post(
        f"{proxy.url}/sessions/{session_id}/finish", json={"status": "completed"}
    )
    assert response.status_code == 200, response.text
    async with await EventStore.open(database_url) as store:
        events = await store.read_session(session_id)
    return build_samples(rebuild_session(session_id, events, packed=True))


# -- Anthropic Messages ------------------------------------------------------------------------


async def test_anthropic_sdk_create_is_recorded_token_exact(proxy: RunningProxy, vllm: str) -> None:
    session = await proxy.new_session()
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": TWO_TEXTS},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I will call add."},
            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"}
        ]},
    ]  # fmt: skip
    tools = [{"name": "add", "description": "Add.", "input_schema": ADD_SCHEMA}]
    message = await claude(proxy, session).messages.create(
        model="tiny", system=SYSTEM, messages=messages, tools=tools,  # type: ignore[arg-type]
        max_tokens=12, extra_body={"temperature": 0.0},  # SDK 2.x no longer takes temperature
    )  # fmt: skip
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert message.usage.output_tokens >= 1
    turn = (await recorded(proxy, session["session_id"]))["turns"][0]
    assert turn["api"] == "messages"
    # The engine's own answer to the chat request the Messages request means.
    direct = await engine_answer(vllm, {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": TWO_TEXTS},
            {"role": "assistant", "content": "I will call add.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        ],
        "tools": CHAT_TOOLS, "max_tokens": 12, "temperature": 0.0,
    })  # fmt: skip
    assert_same_tokens(turn, direct)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == direct["choices"][0]["message"]["content"]


async def test_anthropic_sdk_streams_in_its_own_grammar(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    events: list[str] = []
    async with claude(proxy, session).messages.stream(
        model="tiny", max_tokens=16, messages=[{"role": "user", "content": "count"}]
    ) as stream:
        async for event in stream:
            events.append(event.type)
        final = await stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "content_block_delta" in events
    turn = (await recorded(proxy, session["session_id"]))["turns"][0]
    assert turn["api"] == "messages" and turn["stream"] is True
    assert final.usage.output_tokens == len(turn["choices"][0]["token_ids"])
    assert "".join(b.text for b in final.content if b.type == "text") == turn["choices"][0]["text"]


async def test_anthropic_errors_come_in_its_own_shape(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    client = claude(proxy, session)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(  # documents need Anthropic's servers: a 400 that says so
            model="tiny", max_tokens=8,
            messages=[{"role": "user", "content": [{"type": "document", "source": {
                "type": "text", "media_type": "text/plain", "data": "a note"}}]}],
        )  # fmt: skip
    assert "document" in str(refused.value.body)
    bad = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key="not-the-key", max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError):
        await bad.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
        )


async def test_anthropic_count_tokens_is_the_engines_count(proxy: RunningProxy, vllm: str) -> None:
    session = await proxy.new_session()
    counted = await claude(proxy, session).messages.count_tokens(
        model="tiny", system=SYSTEM, messages=[{"role": "user", "content": "add 2 and 3"}]
    )
    direct = await engine_answer(vllm, {
        "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "add 2 and 3"}
        ],
        "max_tokens": 1,
    })  # fmt: skip
    assert counted.input_tokens == len(direct["prompt_token_ids"])


# -- OpenAI Responses --------------------------------------------------------------------------


async def test_responses_create_is_recorded_token_exact(proxy: RunningProxy, vllm: str) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    tools = [{"type": "function", "name": "add", "description": "Add.", "parameters": ADD_SCHEMA}]
    items: list[Any] = [
        {"role": "user", "content": "add 2 and 3"},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":2,"b":3}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
    ]
    response = await client.responses.create(
        model="tiny", instructions=SYSTEM, input=items, tools=tools,  # type: ignore[arg-type]
        max_output_tokens=12, temperature=0.0,
    )  # fmt: skip
    assert response.object == "response" and response.status in ("completed", "incomplete")
    turn = (await recorded(proxy, session["session_id"]))["turns"][0]
    assert turn["api"] == "responses"
    direct = await engine_answer(vllm, {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "add 2 and 3"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
        "tools": CHAT_TOOLS, "max_tokens": 12, "temperature": 0.0,
    })  # fmt: skip
    assert_same_tokens(turn, direct)
    assert response.output_text == (direct["choices"][0]["message"]["content"] or "")


async def test_responses_stream_in_its_own_grammar(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    stream = await proxy.agent(session).responses.create(
        model="tiny", input="count", max_output_tokens=16, stream=True
    )
    kinds: list[str] = []
    final = None
    async for event in stream:
        kinds.append(event.type)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[0] == "response.created" and final is not None
    assert "response.output_text.delta" in kinds
    turn = (await recorded(proxy, session["session_id"]))["turns"][0]
    assert turn["api"] == "responses" and turn["stream"] is True
    assert final.output_text == turn["choices"][0]["text"]
    assert final.usage is not None
    assert final.usage.output_tokens == len(turn["choices"][0]["token_ids"])


async def test_previous_response_id_is_refused_with_the_alternative(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    first = await client.responses.create(model="tiny", input="hi", max_output_tokens=4)
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as refused:
        await client.responses.create(
            model="tiny", input="again", previous_response_id=first.id, max_output_tokens=4
        )
    assert "input" in str(refused.value)


async def test_agents_sdk_default_model_runs_through_a_session(proxy: RunningProxy) -> None:
    import agents

    agents.set_tracing_disabled(True)  # nothing leaves the machine
    session = await proxy.new_session()
    model = agents.OpenAIResponsesModel(
        model="tiny",
        openai_client=AsyncOpenAI(
            base_url=session["base_url"], api_key=session["api_key"], max_retries=0
        ),
    )
    agent = agents.Agent(
        name="adder",
        instructions=SYSTEM,
        model=model,
        # A random model rarely ends a turn by itself, and the SDK fails a response cut by
        # length: common letters as stop strings end it within a few tokens.
        model_settings=agents.ModelSettings(
            max_tokens=48, temperature=1.0, extra_body={"stop": list("aeo ")}
        ),
    )
    result = await agents.Runner.run(agent, "add 2 and 3", max_turns=2)
    turns = (await recorded(proxy, session["session_id"]))["turns"]
    assert turns and all(t["api"] == "responses" and t["status"] == "completed" for t in turns)
    assert isinstance(result.final_output, str)
    assert result.final_output == turns[-1]["choices"][0]["text"]


# -- several turns, mixed APIs: samples --------------------------------------------------------


async def test_multi_turn_sessions_of_each_api_become_one_sample(
    proxy: RunningProxy, database_url: str
) -> None:
    # Anthropic: the agent sends back the content blocks it was given.
    session = await proxy.new_session()
    client = claude(proxy, session)
    history: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    for k in range(3):
        reply = await client.messages.create(
            model="tiny",
            max_tokens=10,
            system=SYSTEM,
            messages=history,  # type: ignore[arg-type]
        )
        history += [
            {
                "role": "assistant",
                "content": [b.model_dump(exclude_none=True) for b in reply.content],
            },
            {"role": "user", "content": f"and {k}?"},
        ]
    samples = await finish_and_sample(proxy, database_url, session["session_id"])
    turns = (await recorded(proxy, session["session_id"]))["turns"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "continued", "continued"]
    [sample] = samples
    assert len(sample.turns) == 3 and sample.divergence is None

    # Responses, with the chat API in the same session: one recording path, one sample.
    session = await proxy.new_session()
    openai_client = proxy.agent(session)
    items: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    response = await openai_client.responses.create(
        model="tiny", instructions=SYSTEM, input=items, max_output_tokens=10
    )
    items += [o.model_dump(exclude_none=True) for o in response.output]
    items.append({"role": "user", "content": "and 4?"})
    second = await openai_client.responses.create(
        model="tiny", instructions=SYSTEM, input=items, max_output_tokens=10
    )
    chat = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": response.output_text},
        {"role": "user", "content": "and 4?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "thanks"},
    ]
    await openai_client.chat.completions.create(model="tiny", messages=chat, max_tokens=10)  # type: ignore[arg-type]
    samples = await finish_and_sample(proxy, database_url, session["session_id"])
    turns = (await recorded(proxy, session["session_id"]))["turns"]
    assert [t["api"] for t in turns] == ["responses", "responses", "chat"]
    assert [t["prompt_source"] for t in turns][:2] == ["rendered", "continued"]
    assert samples[0].turns[:2] == [0, 1]  # the Responses turns make one sample
    assert sorted(t for s in samples for t in s.turns) == [0, 1, 2]  # and the chat turn is in
