"""Anthropic Messages and OpenAI Responses through the proxy, with the agents' official clients,
against the fake engine answering with tool calls (a random tiny model never finishes one): the
tool round trips, their streams as each SDK parses them, continuation across them, the routes'
other forms, errors in each API's shape, and failures recorded as chat's are.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.proxy.apis_wire import ADD_SCHEMA
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy

CLAUDE_TOOLS: Any = [{"name": "add", "description": "Add two numbers.", "input_schema": ADD_SCHEMA}]
RESPONSES_TOOLS: Any = [{"type": "function", "name": "add", "parameters": ADD_SCHEMA}]


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, tool_engine: FakeEngine) -> RunningProxy:
    return await start_proxy([tool_engine.url])


def claude(session: dict[str, Any], **kwargs: Any) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0, **kwargs
    )


async def test_a_streamed_tool_use_round_trip_is_one_continued_sample(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    client = claude(session)
    history: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    async with client.messages.stream(
        model="tiny", max_tokens=16, system="You add.", messages=history, tools=CLAUDE_TOOLS
    ) as stream:
        kinds = [event.type async for event in stream]
        reply = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "input_json" in kinds  # the SDK's own event for streamed tool input
    [use] = [block for block in reply.content if block.type == "tool_use"]
    assert use.name == "add" and set(use.input) == {"a", "b"}  # type: ignore[arg-type]
    assert reply.stop_reason == "tool_use"

    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "5"},
            {"type": "text", "text": "and now 4?"},
        ]},
    ]  # fmt: skip
    second = await client.messages.create(
        model="tiny", max_tokens=16, system="You add.", messages=history, tools=CLAUDE_TOOLS
    )
    assert second.stop_reason == "tool_use"

    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["api"] for t in turns] == ["messages", "messages"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "continued"]
    [choice] = turns[0]["choices"]
    assert (choice["finish_reason"], choice["api_finish_reason"]) == ("tool_calls", "tool_use")
    [sample] = await proxy.finished_samples(database_url, session["session_id"])
    assert sample.turns == [0, 1] and sample.divergence is None


async def test_a_function_call_round_trip_through_responses_is_one_sample(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    items: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    first = await client.responses.create(
        model="tiny", instructions="You add.", input=items, tools=RESPONSES_TOOLS,
        max_output_tokens=16,
    )  # fmt: skip
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and first.status == "completed"
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})

    stream = await client.responses.create(
        model="tiny", instructions="You add.", input=items, tools=RESPONSES_TOOLS,
        max_output_tokens=16, stream=True,
    )  # fmt: skip
    kinds, arguments, final = [], "", None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final is not None
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert streamed_call.arguments == arguments and set(httpx.Response(200, text=arguments).json())
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "continued"]
    assert turns[1]["choices"][0]["api_finish_reason"] == "completed"
    [sample] = await proxy.finished_samples(database_url, session["session_id"])
    assert sample.turns == [0, 1] and sample.divergence is None


async def test_the_session_header_form_and_the_key_never_reaches_the_engine(
    proxy: RunningProxy, tool_engine: FakeEngine
) -> None:
    session = await proxy.new_session()
    client = anthropic.AsyncAnthropic(
        base_url=proxy.url, api_key=session["api_key"], max_retries=0,
        default_headers={"X-Session-Id": session["session_id"]},
    )  # fmt: skip
    await client.messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
    )
    responses = openai.AsyncOpenAI(
        base_url=proxy.url + "/v1", api_key=session["api_key"], max_retries=0,
        default_headers={"X-Session-Id": session["session_id"]},
    )  # fmt: skip
    await responses.responses.create(model="tiny", input="hi", max_output_tokens=4)
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["api"] for t in turns] == ["messages", "responses"]
    for headers in tool_engine.requests_headers:
        names = {name.lower() for name in headers}
        assert "x-api-key" not in names and "authorization" not in names
        assert session["api_key"] not in str(headers)


async def test_errors_come_in_each_apis_shape_before_and_after_the_engine(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    wrong = {**session, "api_key": "tss-not-this-one"}
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await claude(wrong).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.body["type"] == "error"  # type: ignore[index]
    assert refused.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    bad = await proxy.http.post(  # the SDK itself would not send it without max_tokens
        f"{session['anthropic_base_url']}/v1/messages",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"},
    )
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as malformed:
        await proxy.agent(session).responses.create(
            model="tiny",
            input="hi",
            tools=[{"type": "namespace", "tools": []}],  # type: ignore[list-item]
        )
    assert "tools.0: a namespace tool needs a 'name'" in str(malformed.value)
    # The engine's own refusal, passed on in the agent's API's shape and recorded.
    with pytest.raises(anthropic.BadRequestError) as engine:
        await claude(session, default_headers={"X-Fake-Fault": "error-400"}).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert "fake engine fault" in engine.value.body["error"]["message"]  # type: ignore[index]
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["api"] == "messages" and turn["status"] == "failed"
    # A finished session takes no more calls: the 409 in Anthropic's shape too.
    assert (await proxy.finish(session["session_id"])).status_code == 200
    with pytest.raises(anthropic.ConflictError) as finished:
        await claude(session).messages.create(
            model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert finished.value.body["type"] == "error"  # type: ignore[index]


async def test_a_stream_cut_by_the_engine_is_an_error_event_and_a_recorded_failure(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    client = claude(session, default_headers={"X-Fake-Fault": "drop-mid-stream"})

    async def read_all() -> None:
        async with client.messages.stream(
            model="tiny", max_tokens=16, messages=[{"role": "user", "content": "count"}]
        ) as stream:
            async for _ in stream:
                pass

    with pytest.raises(anthropic.APIStatusError) as cut:
        await read_all()
    assert "broke off" in str(cut.value) or "before" in str(cut.value)
    responses = proxy.agent(session).with_options(
        default_headers={"X-Fake-Fault": "drop-mid-stream"}
    )
    stream = await responses.responses.create(
        model="tiny", input="count", max_output_tokens=16, stream=True
    )
    kinds = [event.type async for event in stream]
    assert kinds[-1] == "response.failed"
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["status"] for t in turns] == ["failed", "failed"]
    assert all(t["failure"]["reason"] == "engine_error" for t in turns)


async def test_count_tokens_is_the_engines_count_of_the_prompt(
    proxy: RunningProxy, tool_engine: FakeEngine
) -> None:
    session = await proxy.new_session()
    messages: Any = [{"role": "user", "content": "add 2 and 3"}]
    counted = await claude(session).messages.count_tokens(
        model="tiny", system="You add.", messages=messages, tools=CLAUDE_TOOLS
    )
    await claude(session).messages.create(
        model="tiny", max_tokens=4, system="You add.", messages=messages, tools=CLAUDE_TOOLS
    )
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert counted.input_tokens == len(turn["prompt_token_ids"]) > 0
