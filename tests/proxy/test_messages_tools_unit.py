"""Claude Code's whole request shape on Anthropic Messages (`proxy.apis.messages`,
`proxy.apis.messages_tools`): server tools left out and named, bash and the text editor served
with Anthropic's schemas, cache_control, thinking blocks, tool search results and the fields
that are not the engine's business; each tool checked against the `anthropic` package's own
param types and each answer validated with its `Message` (no I/O)."""

from __future__ import annotations

from typing import Any

import anthropic
import orjson
import pytest
from anthropic.types.beta import BetaToolUnionParam
from pydantic import TypeAdapter

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
    CHAT_CALLS,
    CLAUDE_CODE_FIRST,
    REQUEST_ID,
    bad_request,
    captured,
    chat_variant,
    messages_body,
)
from trajstore.proxy.apis import Dropped, as_chat
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.errors import BadRequest

TOOL = TypeAdapter(BetaToolUnionParam)

ADD = {"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA,
       "cache_control": {"type": "ephemeral"}}  # fmt: skip
BASH = {"type": "bash_20250124", "name": "bash"}
EDITOR = {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}
OLD_EDITOR = {"type": "text_editor_20250124", "name": "str_replace_editor"}
#: The tools that run on Anthropic's servers, or need what this API does not take.
SERVER = [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "web_fetch_20250910", "name": "web_fetch"},
    {"type": "code_execution_20250825", "name": "code_execution"},
    {"type": "computer_20250124", "name": "computer", "display_width_px": 1024,
     "display_height_px": 768},
    {"type": "memory_20250818", "name": "memory"},
    {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"},
]  # fmt: skip


def translated(*tools: dict[str, Any], **fields: Any) -> tuple[dict[str, Any], list[Dropped]]:
    for tool in tools:
        TOOL.validate_python(tool)  # each one as the anthropic package declares it
    return Messages().translate(messages_body(tools=list(tools), **fields))


def functions(chat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in chat.get("tools", ())}


@pytest.mark.parametrize("server", SERVER, ids=lambda tool: tool["type"])
def test_a_server_tool_is_left_out_and_named(server: dict[str, Any]) -> None:
    chat, dropped, _ = translated(ADD, server)
    assert list(functions(chat)) == ["add"]
    assert dropped == [Dropped("tools.1", server["type"], server["name"])]


def test_client_tools_drop_anthropics_own_fields() -> None:
    deferred = {**ADD, "name": "later", "defer_loading": True, "strict": True}
    chat, *_ = translated(ADD, deferred)
    assert functions(chat)["add"] == {
        "name": "add", "parameters": ADD_SCHEMA, "description": "Add two integers.",
    }  # fmt: skip
    assert "later" in functions(chat)  # served: every tool is, deferred or not


def test_bash_is_served_with_its_schema_under_its_name() -> None:
    chat, dropped, _ = translated(BASH)
    bash = functions(chat)["bash"]
    assert set(bash["parameters"]["properties"]) == {"command", "restart"} and dropped == []


@pytest.mark.parametrize(("editor", "undo"), [(EDITOR, False), (OLD_EDITOR, True)])
def test_the_text_editor_is_served_with_the_commands_of_its_version(
    editor: dict[str, Any], undo: bool
) -> None:
    chat, *_ = translated(editor)
    schema = functions(chat)[editor["name"]]["parameters"]
    assert ("undo_edit" in schema["properties"]["command"]["enum"]) is undo
    assert {"path", "old_str", "new_str", "insert_line", "view_range"} <= set(schema["properties"])


def test_a_bash_call_is_a_tool_use_the_agent_runs() -> None:
    call = {"id": "toolu_1", "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'}}  # fmt: skip
    chat = chat_variant(CHAT_CALLS, message={"tool_calls": [call]})
    body = messages_body(tools=[BASH])
    message = anthropic.types.Message.model_validate(Messages().answer(chat, body, REQUEST_ID))
    [use] = message.content
    assert use.type == "tool_use" and (use.name, use.input) == ("bash", {"command": "ls"})


def test_refuse_makes_a_server_tool_a_400_naming_it() -> None:
    raw = orjson.dumps(messages_body(tools=[ADD, BASH, SERVER[0]]))
    assert as_chat("messages", raw).dropped == [
        Dropped("tools.2", "web_search_20250305", "web_search")
    ]
    with pytest.raises(BadRequest) as caught:
        as_chat("messages", raw, hosted_tools="refuse")
    assert caught.value.param == "tools.2" and "'web_search_20250305'" in caught.value.message


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"name": "add", "description": "Add."}, "tools.0"),
        ({"input_schema": ADD_SCHEMA}, "tools.0"),
        ({"type": "custom", "name": "add", "input_schema": "object"}, "tools.0"),
        ({"type": 7, "name": "add"}, "tools.0"),
        ("add", "tools.0"),
    ],
    ids=["no-schema", "no-name", "schema-not-object", "type-not-string", "not-object"],
)
def test_a_malformed_tool_is_a_400_naming_it(tool: Any, param: str) -> None:
    error = bad_request(Messages(), messages_body(tools=[tool]))
    assert error.param == param and error.message.startswith(param)


def test_count_tokens_counts_the_served_tools_and_names_the_rest() -> None:
    body = messages_body(tools=[ADD, SERVER[0]])
    request, dropped, _ = Messages().count_tokens_request(body)
    assert list(functions(request)) == ["add"] and request["add_generation_prompt"] is True
    assert dropped == [Dropped("tools.1", "web_search_20250305", "web_search")]


def test_claude_codes_first_request_is_served_whole() -> None:
    request = captured(CLAUDE_CODE_FIRST)
    body = request["body"]
    assert "claude-code-20250219" in request["headers"]["anthropic-beta"]
    chat, dropped, _ = Messages().translate(body)
    assert dropped == []
    assert len(chat["tools"]) == len(body["tools"])
    # Its system blocks (two with cache_control) are one system message; its reminder a
    # mid-conversation system message, as it sends one.
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "system"]
    assert [p["text"] for p in chat["messages"][0]["content"]] == [
        b["text"] for b in body["system"]
    ]
    for field in ("metadata", "thinking", "context_management", "output_config"):
        assert field in body and field not in chat
    assert chat["max_tokens"] == 32000 and chat["stream"] is True


def test_a_later_turn_of_claude_code_keeps_what_the_engine_needs() -> None:
    cached = {"type": "ephemeral"}
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "list files", "cache_control": cached},
        ]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Use bash.", "signature": "EqQBCkgIARAB"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3p"},
            {"type": "text", "text": "Listing."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_2", "name": "ToolSearch", "input": {"query": "x"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "cache_control": cached,
             "content": [{"type": "text", "text": "a.txt"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2",
             "content": [{"type": "tool_reference", "tool_name": "Write"}]},
        ]},
    ]  # fmt: skip
    chat = Messages().to_chat(messages_body(messages=messages, tools=[BASH]))
    user, assistant, *results = chat["messages"]
    assert user == {"role": "user", "content": "list files"}
    assert assistant["content"] == "Listing."  # thinking left out, as templates strip it
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["bash", "ToolSearch"]
    assert [(m["tool_call_id"], m["content"]) for m in results] == [
        ("toolu_1", "a.txt"), ("toolu_2", "Write"),
    ]  # fmt: skip
