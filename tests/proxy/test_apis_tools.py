"""Agents' tools beyond functions through the proxy, against the fake engine that calls the first
tool it is given: Codex 0.169's and Claude Code 2.1.328's first requests exactly as captured, the
namespace, custom and local_shell round trips through the `openai` client (continued as token-in,
one sample), hosted and server tools left out and recorded, or refused when the proxy is told to.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anthropic
import openai
import pytest

from tests.proxy.apis_wire import ADD_SCHEMA, CLAUDE_CODE_FIRST, CODEX_FIRST, captured, sse
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy

CALC: Any = {
    "type": "namespace", "name": "calc", "description": "Arithmetic.",
    "tools": [{"type": "function", "name": "add", "parameters": ADD_SCHEMA}],
}  # fmt: skip
NOTE: Any = {"type": "custom", "name": "note", "description": "Write a note."}
WEB_SEARCH: Any = {"type": "web_search", "external_web_access": False}
HEADER = "x-trajstore-dropped-tools"


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, tool_engine: FakeEngine) -> RunningProxy:
    return await start_proxy([tool_engine.url])


EventsOf = Callable[[str], Awaitable[list[Any]]]  #: the `events_of` fixture


async def received(proxy: RunningProxy, events_of: EventsOf, session_id: str) -> list[Any]:
    """The session's request_received payloads, in order, once the proxy stored them."""
    await proxy.session_record(session_id)  # the proxy writes what it recorded so far
    return [dict(e.payload) for e in await events_of(session_id) if e.type == "request_received"]


def as_sent(headers: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in ("host", "content-length")}


async def test_codexs_first_request_is_served_and_its_web_search_recorded_as_left_out(
    proxy: RunningProxy, tool_engine: FakeEngine, events_of: EventsOf
) -> None:
    session = await proxy.new_session()
    request = captured(CODEX_FIRST)
    headers = {**as_sent(request["headers"]), "Authorization": f"Bearer {session['api_key']}"}
    answer = await proxy.http.post(
        f"{session['base_url']}/responses", json=request["body"], headers=headers
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER] == "tools.8=web_search"
    events = sse(answer.content)
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    [call] = events[-1][1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "exec_command"

    sent = tool_engine.requests[-1]
    names = [tool["function"]["name"] for tool in sent["tools"]]
    assert "multi_agent_v1__spawn_agent" in names and len(names) == 12
    assert not {"store", "include", "client_metadata", "prompt_cache_key"} & set(sent)
    [turn] = await received(proxy, events_of, session["session_id"])
    assert turn["api"] == "responses" and turn["body"] == request["body"]
    assert turn["dropped_tools"] == [{"param": "tools.8", "type": "web_search"}]

    # Codex's next request: the same input, its call (as Codex writes it back) and the output.
    body = {**request["body"], "input": [
        *request["body"]["input"],
        {"type": "function_call", "name": call["name"], "arguments": call["arguments"],
         "call_id": call["call_id"]},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "hi"},
    ]}  # fmt: skip
    second = await proxy.http.post(f"{session['base_url']}/responses", json=body, headers=headers)
    assert second.status_code == 200, second.text
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "continued"]


async def test_a_namespaced_call_round_trips_through_the_openai_client(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    items: list[Any] = [{"role": "user", "content": "add 2 and 3"}]
    first = await client.responses.create(
        model="tiny", input=items, tools=[CALC, WEB_SEARCH], max_output_tokens=16
    )
    [call] = first.output
    assert call.type == "function_call" and (call.namespace, call.name) == ("calc", "add")
    items += [call.model_dump(exclude_none=True)]
    items.append({"type": "function_call_output", "call_id": call.call_id, "output": "5"})
    raw = await client.responses.with_raw_response.create(
        model="tiny", input=items, tools=[CALC, WEB_SEARCH], max_output_tokens=16
    )
    assert raw.headers[HEADER] == "tools.1=web_search"
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "continued"]
    [sample] = await proxy.finished_samples(database_url, session["session_id"])
    assert sample.turns == [0, 1] and sample.divergence is None


async def test_a_streamed_custom_call_goes_back_as_the_sdk_accumulates_it(
    proxy: RunningProxy,
) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    items: list[Any] = [{"role": "user", "content": "write it down"}]
    async with client.responses.stream(model="tiny", input=items, tools=[NOTE]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert "response.custom_tool_call_input.delta" in kinds
    [call] = final.output
    assert call.type == "custom_tool_call" and call.name == "note"
    # The fake engine fills {a, b}, not the tool's {input}: the input is its arguments as given.
    assert call.input.startswith('{"a": ')
    items += [call.model_dump(exclude_none=True)]
    items.append({"type": "custom_tool_call_output", "call_id": call.call_id, "output": "ok"})
    second = await client.responses.create(model="tiny", input=items, tools=[NOTE])
    assert second.status == "completed"
    # Sent back, the call is {"input": <those arguments>}: not the reply the engine gave, so the
    # turn is rendered from the messages, and says why (a model that follows the tool's schema
    # round-trips exactly: tests/proxy/test_responses_tools_unit.py).
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert turns[1]["continuation"] == {"fallback": "reply_changed"}


async def test_a_local_shell_call_round_trips(proxy: RunningProxy) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    items: list[Any] = [{"role": "user", "content": "list files"}]
    first = await client.responses.create(
        model="tiny", input=items, tools=[{"type": "local_shell"}]
    )
    [call] = first.output
    assert call.type == "local_shell_call" and call.action.type == "exec"
    items += [call.model_dump(exclude_none=True)]
    items.append({"type": "local_shell_call_output", "id": call.call_id, "output": "a.txt"})
    await client.responses.create(model="tiny", input=items, tools=[{"type": "local_shell"}])
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert len(turns) == 2 and turns[1]["status"] == "completed"


async def test_refuse_keeps_hosted_and_server_tools_a_400_naming_them(
    start_proxy: ProxyFactory, tool_engine: FakeEngine
) -> None:
    proxy = await start_proxy([tool_engine.url], hosted_tools="refuse")
    session = await proxy.new_session()
    with pytest.raises(openai.BadRequestError) as responses:
        await proxy.agent(session).responses.create(
            model="tiny", input="hi", tools=[CALC, WEB_SEARCH]
        )
    assert "tools.1" in str(responses.value) and "TRAJSTORE_HOSTED_TOOLS" in str(responses.value)
    claude = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    with pytest.raises(anthropic.BadRequestError) as messages:
        await claude.messages.create(
            model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "web_search_20250305", "name": "web_search"}],
        )  # fmt: skip
    assert messages.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert (await proxy.session_record(session["session_id"]))["turns"] == []


async def test_claude_codes_first_request_is_served_with_its_beta_headers(
    proxy: RunningProxy, tool_engine: FakeEngine, events_of: EventsOf
) -> None:
    session = await proxy.new_session()
    request = captured(CLAUDE_CODE_FIRST)
    body = {**request["body"], "tools": [
        *request["body"]["tools"], {"type": "web_search_20250305", "name": "web_search"},
    ]}  # fmt: skip
    headers = {**as_sent(request["headers"]), "x-api-key": session["api_key"]}
    answer = await proxy.http.post(
        f"{session['anthropic_base_url']}{request['path']}", json=body, headers=headers
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers[HEADER] == f"tools.{len(body['tools']) - 1}=web_search_20250305"
    events = sse(answer.content)
    assert events[0][0] == "message_start" and events[-1][0] == "message_stop"
    sent = tool_engine.requests[-1]
    assert len(sent["tools"]) == len(request["body"]["tools"])
    assert not {"metadata", "thinking", "context_management", "output_config"} & set(sent)
    [turn] = await received(proxy, events_of, session["session_id"])
    assert turn["dropped_tools"] == [
        {"param": f"tools.{len(body['tools']) - 1}", "type": "web_search_20250305",
         "name": "web_search"},
    ]  # fmt: skip

    counted = await proxy.http.post(
        f"{session['anthropic_base_url']}/v1/messages/count_tokens",
        json={k: body[k] for k in ("model", "system", "messages", "tools")}, headers=headers,
    )  # fmt: skip
    assert counted.status_code == 200, counted.text
    assert counted.json()["input_tokens"] > 0 and HEADER in counted.headers
