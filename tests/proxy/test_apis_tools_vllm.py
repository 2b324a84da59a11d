"""Codex's and Claude Code's request shapes against a real vLLM (CPU build, generated tiny model),
through the `openai` and `anthropic` clients: every tool kind and field they send is served, each
turn is recorded with its prompt and completion ids, token for token what the engine gives for
the chat request the translation means, and the tools left out are recorded with the turn.

The captured requests are 24-32 k tokens on the tiny model's vocabulary; the tests' engine serves
2,048. So the Codex request here is the captured one with its texts cut short, four of its plain
function tools and three of its namespace's left out: every field, every kind of tool (functions,
the `multi_agent_v1` namespace, web_search with external_web_access false) and both developer
messages stay, plus the apply_patch custom tool and local_shell that Codex sends other models.
The whole captured requests are served through the proxy in tests/proxy/test_apis_tools.py.
"""

from __future__ import annotations

import copy
from typing import Any

import anthropic
import pytest

from tests.proxy.apis_wire import CODEX_FIRST, captured
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from tests.proxy.test_apis_tools import EventsOf, received
from tests.proxy.test_apis_vllm import assert_same_tokens, engine_answer, recorded
from trajstore.proxy.apis import TRANSLATIONS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

APPLY_PATCH = {
    "type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark",
               "definition": 'start: "*** Begin Patch" /(.|\\n)*/ "*** End Patch"'},
}  # fmt: skip
LEFT_OUT = {"write_stdin", "request_user_input", "create_goal", "update_goal", "close_agent",
            "resume_agent", "send_input"}  # fmt: skip


@pytest.fixture
async def proxy(start_proxy: ProxyFactory, vllm: str) -> RunningProxy:
    return await start_proxy([vllm])


def cut(value: Any, in_schema: bool = False) -> Any:
    """`value` with its texts cut to 24 characters and its schemas' descriptions left out."""
    if isinstance(value, list):
        return [cut(v, in_schema) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        if key == "description" and in_schema:
            continue
        short = key in ("description", "text") and isinstance(v, str)
        out[key] = v[:24] if short else cut(v, in_schema or key in ("parameters", "properties"))
    return out


def codex_body() -> dict[str, Any]:
    """Codex 0.169's first request, cut to fit the engine's context (see the module's doc)."""
    body: dict[str, Any] = cut(copy.deepcopy(captured(CODEX_FIRST)["body"]))
    body["tools"] = [t for t in body["tools"] if t.get("name") not in LEFT_OUT]
    [namespace] = [t for t in body["tools"] if t["type"] == "namespace"]
    namespace["tools"] = [t for t in namespace["tools"] if t["name"] not in LEFT_OUT]
    body["tools"] += [APPLY_PATCH, {"type": "local_shell"}]
    return body


async def direct_tokens(vllm: str, api: str, body: dict[str, Any], turn: dict[str, Any]) -> None:
    """The turn as recorded is the engine's own greedy answer to the chat the request means
    (rendered from it: the later turns here send back calls the engine did not make)."""
    assert turn["prompt_source"] == "rendered"
    chat = TRANSLATIONS[api].to_chat(body)
    chat.pop("stream", None)
    assert_same_tokens(turn, await engine_answer(vllm, chat))


async def test_a_codex_shaped_session_is_served_and_recorded_with_ids(
    proxy: RunningProxy, vllm: str, events_of: EventsOf
) -> None:
    session = await proxy.new_session()
    client = proxy.agent(session)
    body = codex_body()
    assert [m["role"] for m in body["input"]] == ["developer", "developer", "user", "user"]
    fields = {k: body[k] for k in ("model", "input", "tools", "tool_choice",
                                   "parallel_tool_calls", "reasoning", "store", "include",
                                   "prompt_cache_key")}  # fmt: skip
    extra = {"client_metadata": body["client_metadata"], "temperature": 0.0}
    stream = await client.responses.create(
        **fields, stream=True, max_output_tokens=8, extra_body=extra
    )
    events = [event async for event in stream]
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    first = events[-1].response  # type: ignore[union-attr]

    # The next turn, as Codex sends it: what it got, then what it sends back of earlier turns:
    # reasoning with its encrypted content, calls of each kind and their outputs.
    items = [
        *body["input"],
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": [{"type": "input_text", "text": "go on"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB..."},
        {"type": "function_call", "call_id": "call_1", "namespace": "multi_agent_v1",
         "name": "wait_agent", "arguments": '{"targets": ["a1"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "done"},
        {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch"},
        {"type": "custom_tool_call_output", "call_id": "call_2", "output": "patched"},
        {"type": "local_shell_call", "call_id": "call_3", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}}},
        {"type": "local_shell_call_output", "id": "call_3", "output": "a.txt"},
    ]  # fmt: skip
    second = await client.responses.with_raw_response.create(
        **{**fields, "input": items}, max_output_tokens=8, extra_body=extra
    )
    assert (
        second.headers["x-trajstore-dropped-tools"] == "tools.4=web_search, tools.5.format=grammar"
    )
    assert second.parse().status in ("completed", "incomplete")

    turns = (await recorded(proxy, session["session_id"]))["turns"]
    assert [(t["api"], t["status"]) for t in turns] == [("responses", "completed")] * 2
    for turn in turns:
        assert turn["prompt_token_ids"] and turn["choices"][0]["token_ids"]
    payloads = await received(proxy, events_of, session["session_id"])
    for payload in payloads:
        assert payload["dropped_tools"] == [
            {"param": "tools.4", "type": "web_search"},
            {"param": "tools.5.format", "type": "grammar", "name": "apply_patch"},
        ]
    greedy = {**body, "max_output_tokens": 8, "temperature": 0.0}
    await direct_tokens(vllm, "responses", greedy, turns[0])
    await direct_tokens(vllm, "responses", {**greedy, "input": items}, turns[1])


async def test_a_claude_code_shaped_session_is_served_and_recorded_with_ids(
    proxy: RunningProxy, vllm: str, events_of: EventsOf
) -> None:
    session = await proxy.new_session()
    client = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0,
        default_headers={"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"},
    )  # fmt: skip
    cached: Any = {"type": "ephemeral"}
    tools: Any = [
        {"name": "Read", "description": "Read a file.", "cache_control": cached,
         "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                          "required": ["file_path"]}},
        {"type": "bash_20250124", "name": "bash"},
        {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
    ]  # fmt: skip
    system: Any = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328;"},
        {"type": "text", "text": "You are a coding agent.", "cache_control": cached},
    ]
    request: dict[str, Any] = {
        "model": "tiny", "max_tokens": 8, "system": system, "tools": tools,
        "metadata": {"user_id": '{"device_id":"aa49","session_id":"7b4c"}'},
        "thinking": {"type": "adaptive"},
        "extra_body": {"temperature": 0.0, "context_management": {"edits": [
            {"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"}},
    }  # fmt: skip
    history: list[Any] = [{"role": "user", "content": [
        {"type": "text", "text": "list the files", "cache_control": cached}]}]  # fmt: skip
    async with client.messages.stream(messages=history, **request) as stream:
        first = await stream.get_final_message()
    history += [
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use bash.", "signature": "EqQBCkgIARAB"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3p"},
            *[block.model_dump(exclude_none=True) for block in first.content],
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "cache_control": cached,
             "content": [{"type": "text", "text": "a.txt"}]},
        ]},
    ]  # fmt: skip
    raw = await client.messages.with_raw_response.create(messages=history, **request)
    assert raw.headers["x-trajstore-dropped-tools"] == "tools.3=web_search_20250305"
    assert (await raw.parse()).type == "message"

    turns = (await recorded(proxy, session["session_id"]))["turns"]
    assert [(t["api"], t["status"]) for t in turns] == [("messages", "completed")] * 2
    payloads = await received(proxy, events_of, session["session_id"])
    assert all(p["dropped_tools"][0]["type"] == "web_search_20250305" for p in payloads)
    body = {k: v for k, v in request.items() if k != "extra_body"} | request["extra_body"]
    await direct_tokens(vllm, "messages", {**body, "messages": history[:1]}, turns[0])
    await direct_tokens(vllm, "messages", {**body, "messages": history}, turns[1])


async def test_count_tokens_counts_the_served_tools_and_names_the_rest(
    proxy: RunningProxy, vllm: str
) -> None:
    session = await proxy.new_session()
    headers = {"x-api-key": session["api_key"], "anthropic-version": "2023-06-01"}
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "list the files"}],
        "tools": [{"type": "bash_20250124", "name": "bash"},
                  {"type": "web_search_20250305", "name": "web_search"}],
    }  # fmt: skip
    counted = await proxy.http.post(
        f"{session['anthropic_base_url']}/v1/messages/count_tokens", json=body, headers=headers
    )
    assert counted.status_code == 200, counted.text
    assert counted.headers["x-trajstore-dropped-tools"] == "tools.1=web_search_20250305"
    chat = TRANSLATIONS["messages"].to_chat({**body, "max_tokens": 1})
    direct = await engine_answer(vllm, chat)
    assert counted.json()["input_tokens"] == len(direct["prompt_token_ids"])
