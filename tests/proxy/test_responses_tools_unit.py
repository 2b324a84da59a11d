"""The Responses API's tools beyond functions (`proxy.apis.responses_tools`): namespace, custom,
local_shell and hosted tools, the calls the engine makes of them as output items and the items
an agent sends back, reasoning it may send again; each request checked against the `openai`
package's own param types and each answer validated with its output types (no I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai.types.responses import (
    ResponseInputItemParam,
    ResponseReasoningItem,
    ToolParam,
)
from openai.types.responses.response_input_item_param import LocalShellCallAction
from openai.types.responses.response_output_item import LocalShellCall
from pydantic import TypeAdapter

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
    CHAT_CALLS,
    CHAT_TEXT,
    CODEX_FIRST,
    FUNCTION_TOOL,
    REQUEST_ID,
    STREAM_CHUNKS,
    bad_request,
    captured,
    chat_variant,
    collapsed,
    openai_response,
    responses_body,
    responses_stream,
    validated_response,
)
from trajstore.proxy.apis import Dropped, as_chat, dropped_header
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import BadRequest

TOOL = TypeAdapter(ToolParam)
INPUT_ITEM = TypeAdapter(ResponseInputItemParam)

NAMESPACE = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Tools for spawning and managing sub-agents.",
    "tools": [
        {"type": "function", "name": "spawn_agent", "description": "Spawn one.",
         "strict": False, "parameters": {"type": "object", "properties": {
             "message": {"type": "string"}}, "required": ["message"]}},
        {"type": "function", "name": "wait_agent", "parameters": {"type": "object"}},
    ],
}  # fmt: skip
GRAMMAR = 'start: "*** Begin Patch" LF hunk+ "*** End Patch"\nhunk: /[^\\n]+/ LF\n%import common.LF'
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMAR},
}
FREEFORM = {"type": "custom", "name": "note", "format": {"type": "text"}}
LOCAL_SHELL = {"type": "local_shell"}
#: The hosted tools, as the SDK's own param types have them.
HOSTED: list[dict[str, Any]] = [
    {"type": "web_search", "external_web_access": False},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "code_interpreter", "container": {"type": "auto"}},
    {"type": "image_generation"},
    {"type": "computer_use_preview", "display_width": 1024, "display_height": 768,
     "environment": "linux"},
    {"type": "mcp", "server_label": "deepwiki", "server_url": "https://mcp.deepwiki.com/mcp"},
]  # fmt: skip


def translated(*tools: dict[str, Any], **fields: Any) -> tuple[dict[str, Any], list[Dropped]]:
    for tool in tools:
        TOOL.validate_python(tool)  # each one as the openai package declares it
    body = responses_body(tools=list(tools), **fields)
    for item in body["input"] if isinstance(body["input"], list) else ():
        INPUT_ITEM.validate_python(item)
    return Responses().translate(body)


def engine_calls(*calls: tuple[str, str]) -> dict[str, Any]:
    """A chat answer calling (name, arguments), as vLLM's hermes parser gives it."""
    tool_calls = [
        {"id": f"chatcmpl-tool-{k}", "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for k, (name, arguments) in enumerate(calls)
    ]  # fmt: skip
    return chat_variant(CHAT_CALLS, message={"tool_calls": tool_calls})


# -- the request: what the engine sees ----------------------------------------------------------


def test_a_namespace_is_its_functions_under_flat_names() -> None:
    chat, dropped, _ = translated(FUNCTION_TOOL, NAMESPACE)
    names = [tool["function"]["name"] for tool in chat["tools"]]
    assert names == ["add", "multi_agent_v1__spawn_agent", "multi_agent_v1__wait_agent"]
    spawn = chat["tools"][1]["function"]
    assert spawn["parameters"] == NAMESPACE["tools"][0]["parameters"]  # type: ignore[index]
    assert spawn["description"] == "Spawn one." and dropped == []


@pytest.mark.parametrize(
    ("namespace", "name", "flat"),
    [("mcp__node_repl", "js", "mcp__node_repl__js"), ("crm_", "_lookup", "crm__lookup")],
)
def test_flat_names_are_codexs(namespace: str, name: str, flat: str) -> None:
    tool = {"type": "namespace", "name": namespace, "description": "d",
            "tools": [{"type": "function", "name": name, "parameters": ADD_SCHEMA}]}  # fmt: skip
    chat, *_ = translated(tool)
    assert chat["tools"][0]["function"]["name"] == flat


def test_a_custom_tool_is_a_function_of_one_string_and_its_grammar_is_recorded_as_dropped() -> None:
    chat, dropped, _ = translated(APPLY_PATCH, FREEFORM)
    patch, note = (tool["function"] for tool in chat["tools"])
    assert patch["name"] == "apply_patch" and patch["description"] == "Edit files with a patch."
    assert patch["parameters"]["required"] == ["input"]
    assert GRAMMAR in patch["parameters"]["properties"]["input"]["description"]
    assert note["parameters"]["properties"]["input"]["type"] == "string"
    # Only the grammar is not enforced: the tool itself is served.
    assert dropped == [Dropped("tools.0.format", "grammar", "apply_patch")]
    assert not dropped[0].whole_tool


def test_local_shell_is_a_function_of_the_exec_actions_fields() -> None:
    chat, dropped, _ = translated(LOCAL_SHELL)
    [function] = [tool["function"] for tool in chat["tools"]]
    assert function["name"] == "local_shell" and dropped == []
    action_fields = set(LocalShellCallAction.__annotations__) - {"type"}
    assert set(function["parameters"]["properties"]) == action_fields
    assert function["parameters"]["required"] == ["command"]


@pytest.mark.parametrize("hosted", HOSTED, ids=lambda tool: tool["type"])
def test_a_hosted_tool_is_left_out_and_named(hosted: dict[str, Any]) -> None:
    chat, dropped, _ = translated(FUNCTION_TOOL, hosted)
    assert [tool["function"]["name"] for tool in chat["tools"]] == ["add"]
    label = hosted.get("server_label")
    assert dropped == [Dropped("tools.1", hosted["type"], label)]
    assert dropped_header(dropped) == {"X-Trajstore-Dropped-Tools": f"tools.1={hosted['type']}"}


def test_only_hosted_tools_leave_the_engine_no_tools() -> None:
    chat, dropped, _ = translated(*HOSTED)
    assert "tools" not in chat and len(dropped) == len(HOSTED)


def test_refuse_makes_a_hosted_tool_a_400_naming_it() -> None:
    body = orjson.dumps(responses_body(tools=[FUNCTION_TOOL, LOCAL_SHELL, HOSTED[0]]))
    assert as_chat("responses", body).dropped == [Dropped("tools.2", "web_search")]
    with pytest.raises(BadRequest) as caught:
        as_chat("responses", body, hosted_tools="refuse")
    assert caught.value.param == "tools.2" and "'web_search'" in caught.value.message
    # A grammar is no hosted tool: refusing those keeps custom tools served.
    assert as_chat("responses", orjson.dumps(responses_body(tools=[APPLY_PATCH])), "refuse")


@pytest.mark.parametrize(
    ("tool", "param"),
    [
        ({"type": "namespace", "tools": NAMESPACE["tools"]}, "tools.0"),
        ({"type": "namespace", "name": "ns", "tools": [HOSTED[0]]}, "tools.0.tools.0"),
        ({"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}, "tools.0.tools.0"),
        ({"type": "namespace", "name": "ns"}, "tools.0.tools"),
        ({**APPLY_PATCH, "format": {"type": "grammar", "syntax": "lark"}}, "tools.0.format"),
        ({**APPLY_PATCH, "format": {"type": "json"}}, "tools.0.format"),
        ({"type": "custom"}, "tools.0"),
        ({"name": "add", "parameters": ADD_SCHEMA}, "tools.0"),
        ("web_search", "tools.0"),
    ],
    ids=["namespace-no-name", "namespace-of-hosted", "member-no-name", "namespace-no-tools",
         "grammar-no-definition", "unknown-format", "custom-no-name", "no-type", "not-object"],
)  # fmt: skip
def test_a_malformed_tool_is_a_400_naming_it(tool: Any, param: str) -> None:
    error = bad_request(Responses(), responses_body(tools=[tool]))
    assert error.param == param and error.message.startswith(param)


def test_two_tools_of_one_engine_name_are_a_400() -> None:
    clash = {**FUNCTION_TOOL, "name": "multi_agent_v1__wait_agent"}
    error = bad_request(Responses(), responses_body(tools=[NAMESPACE, clash]))
    assert error.param == "tools.1" and "tools.0.tools.1" in error.message


def test_tool_choice_of_a_custom_or_namespaced_tool_names_its_function() -> None:
    chat, *_ = translated(APPLY_PATCH, tool_choice={"type": "custom", "name": "apply_patch"})
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    choice = {"type": "function", "name": "wait_agent", "namespace": "multi_agent_v1"}
    chat = Responses().to_chat(responses_body(tools=[NAMESPACE], tool_choice=choice))
    expected = {"type": "function", "function": {"name": "multi_agent_v1__wait_agent"}}
    assert chat["tool_choice"] == expected


def test_codexs_first_request_is_served_with_web_search_left_out() -> None:
    request = captured(CODEX_FIRST)
    body = request["body"]
    chat, dropped, _ = Responses().translate(body)
    assert dropped == [Dropped("tools.8", "web_search")]
    names = [tool["function"]["name"] for tool in chat["tools"]]
    assert "multi_agent_v1__spawn_agent" in names and len(names) == 7 + 5
    assert [m["role"] for m in chat["messages"]] == ["system", "system", "user", "user"]
    assert chat["messages"][-1]["content"] == "say hi"
    assert chat["parallel_tool_calls"] is True and chat["tool_choice"] == "auto"
    # Codex's own fields are not the engine's business.
    for field in ("store", "include", "reasoning", "prompt_cache_key", "client_metadata"):
        assert field in body and field not in chat


# -- the answer: the engine's calls as output items ---------------------------------------------


def test_a_namespaced_call_is_a_function_call_with_its_namespace() -> None:
    body = responses_body(tools=[FUNCTION_TOOL, NAMESPACE])
    answer = openai_response(
        engine_calls(("multi_agent_v1__spawn_agent", '{"message": "go"}')), body
    )
    [item] = validated_response(answer).output
    assert item.type == "function_call"
    assert (item.namespace, item.name, item.arguments) == ("multi_agent_v1", "spawn_agent",
                                                          '{"message": "go"}')  # fmt: skip


def test_a_custom_call_is_a_custom_tool_call_with_its_input() -> None:
    body = responses_body(tools=[APPLY_PATCH])
    patch = "*** Begin Patch\n+x\n*** End Patch"
    arguments = orjson.dumps({"input": patch}).decode()
    [item] = validated_response(
        openai_response(engine_calls(("apply_patch", arguments)), body)
    ).output
    assert item.type == "custom_tool_call"
    assert (item.name, item.input, item.call_id) == ("apply_patch", patch, "chatcmpl-tool-0")


def test_a_custom_call_off_its_schema_keeps_the_arguments_as_input() -> None:
    body = responses_body(tools=[FREEFORM])
    answer = openai_response(engine_calls(("note", '{"a": 1, "b": 2}')), body)
    assert answer["output"][0]["input"] == '{"a": 1, "b": 2}'


def test_a_local_shell_call_is_a_local_shell_call_with_its_action() -> None:
    body = responses_body(tools=[LOCAL_SHELL])
    arguments = '{"command": ["ls", "-la"], "working_directory": "/tmp", "timeout_ms": 5000}'
    [item] = validated_response(
        openai_response(engine_calls(("local_shell", arguments)), body)
    ).output
    assert item.type == "local_shell_call" and item.status == "completed"
    assert item.action.command == ["ls", "-la"] and item.action.working_directory == "/tmp"
    assert item.action.timeout_ms == 5000 and item.action.env == {}


def test_a_local_shell_call_off_its_schema_is_still_a_valid_action() -> None:
    body = responses_body(tools=[LOCAL_SHELL])
    answer = openai_response(engine_calls(("local_shell", '{"command": "ls", "env": 3}')), body)
    [item] = validated_response(answer).output
    assert isinstance(item, LocalShellCall)
    assert item.action.command == ["ls"] and item.action.env == {}


def test_a_call_of_a_name_the_request_does_not_have_is_a_plain_function_call() -> None:
    body = responses_body(tools=[NAMESPACE])
    answer = openai_response(engine_calls(("made_up__tool", "{}")), body)
    assert answer["output"][0]["name"] == "made_up__tool" and "namespace" not in answer["output"][0]


@pytest.mark.parametrize("include", [["reasoning.encrypted_content"], []])
def test_reasoning_goes_back_as_an_item_to_send_again(include: list[str]) -> None:
    chat = chat_variant(CHAT_TEXT, message={"reasoning_content": "2 and 3 make 5"})
    answer = openai_response(chat, responses_body(include=include, store=False))
    reasoning = ResponseReasoningItem.model_validate(answer["output"][0])
    assert reasoning.content is not None and reasoning.content[0].text == "2 and 3 make 5"
    expected = "2 and 3 make 5" if include else None
    assert reasoning.encrypted_content == expected


# -- the stream ---------------------------------------------------------------------------------


def stream_of(name: str, arguments: str) -> list[dict[str, Any]]:
    """STREAM_CHUNKS with the call's name and arguments replaced (arguments in two pieces)."""
    chunks = [orjson.loads(orjson.dumps(chunk)) for chunk in STREAM_CHUNKS]
    pieces = [arguments[: len(arguments) // 2], arguments[len(arguments) // 2 :], ""]
    calls = [c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] = name
    for chunk, piece in zip(calls[1:], pieces, strict=True):
        chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] = piece
    return chunks


@pytest.mark.parametrize(
    ("tool", "name", "arguments", "call_events"),
    [
        (NAMESPACE, "multi_agent_v1__wait_agent", '{"timeout": 5}',
         ["response.output_item.added", "response.function_call_arguments.delta",
          "response.function_call_arguments.done", "response.output_item.done"]),
        (APPLY_PATCH, "apply_patch", '{"input": "*** Begin Patch"}',
         ["response.output_item.added", "response.custom_tool_call_input.delta",
          "response.custom_tool_call_input.done", "response.output_item.done"]),
        (LOCAL_SHELL, "local_shell", '{"command": ["pwd"]}',
         ["response.output_item.added", "response.output_item.done"]),
    ],
    ids=["namespace", "custom", "local_shell"],
)  # fmt: skip
def test_each_kind_of_call_streams_in_its_grammar_and_ends_as_unstreamed(
    tool: dict[str, Any], name: str, arguments: str, call_events: list[str]
) -> None:
    body = responses_body(tools=[tool], stream=True)
    events = responses_stream(stream_of(name, arguments), body)  # each validated by the SDK
    names = collapsed([kind for kind, _ in events])
    tail = names[names.index("response.output_text.done") + 3 :]
    assert tail == [*call_events, "response.completed"]
    completed = events[-1][1]["response"]
    added = next(data["item"] for kind, data in events[::-1] if kind.endswith("item.added"))
    assert added["type"] == completed["output"][-1]["type"]
    whole = chat_variant(CHAT_CALLS, message={"content": "Let me add them.", "tool_calls": [
        {"id": "chatcmpl-tool-0d4e6f8a1b3c5d7e", "type": "function",
         "function": {"name": name, "arguments": arguments}}]})  # fmt: skip
    unstreamed = Responses().answer(whole, body, REQUEST_ID)
    assert completed["output"][-1] == unstreamed["output"][-1]


# -- what the agent sends back --------------------------------------------------------------------


def test_calls_and_outputs_sent_back_are_the_tool_calls_and_tool_messages() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "go"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAAB..."},
        {"type": "function_call", "call_id": "c1", "name": "wait_agent",
         "namespace": "multi_agent_v1", "arguments": '{"timeout": 5}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "c3", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "timeout_ms": None}},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"type": "custom_tool_call_output", "call_id": "c2", "output": "patched"},
        {"type": "local_shell_call_output", "id": "c3", "output": '{"stdout": "a"}'},
    ]  # fmt: skip
    chat, *_ = translated(NAMESPACE, APPLY_PATCH, LOCAL_SHELL, input=items)
    _, assistant, *outputs = chat["messages"]
    assert [call["function"] for call in assistant["tool_calls"]] == [
        {"name": "multi_agent_v1__wait_agent", "arguments": '{"timeout": 5}'},
        {"name": "apply_patch", "arguments": '{"input":"*** Begin"}'},
        {"name": "local_shell", "arguments": '{"command":["ls"]}'},
    ]
    assert [(m["role"], m["tool_call_id"], m["content"]) for m in outputs] == [
        ("tool", "c1", "done"), ("tool", "c2", "patched"), ("tool", "c3", '{"stdout": "a"}'),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "custom_tool_call", "call_id": "c", "name": "apply_patch"}, "input.0"),
        ({"type": "custom_tool_call", "name": "apply_patch", "input": "x"}, "input.0"),
        ({"type": "local_shell_call", "call_id": "c", "action": {"type": "exec"}}, "input.0"),
        ({"type": "custom_tool_call_output", "output": "x"}, "input.0"),
        ({"type": "function_call", "call_id": "c", "name": "f", "namespace": 3}, "input.0"),
    ],
    ids=["custom-no-input", "custom-no-call-id", "shell-no-command", "output-no-call-id",
         "namespace-not-string"],
)  # fmt: skip
def test_a_malformed_item_sent_back_is_a_400_naming_it(item: dict[str, Any], param: str) -> None:
    error = bad_request(Responses(), responses_body(input=[item]))
    assert error.param == param and item["type"] in error.message


def test_every_kind_of_call_round_trips_to_the_engines_reply() -> None:
    tools = [NAMESPACE, APPLY_PATCH, LOCAL_SHELL]
    chat = engine_calls(
        ("multi_agent_v1__spawn_agent", '{"message": "go"}'),
        ("apply_patch", '{"input": "*** Begin Patch"}'),
        ("local_shell", '{"command": ["ls"], "timeout_ms": 100}'),
    )
    chat = chat_variant(chat, message={"content": "Working.", "reasoning_content": "plan"})
    body = responses_body(tools=tools, include=["reasoning.encrypted_content"])
    response = validated_response(Responses().answer(chat, body, REQUEST_ID))
    returned = [item.model_dump(exclude_none=True) for item in response.output]
    assert [item["type"] for item in returned] == [
        "reasoning", "message", "function_call", "custom_tool_call", "local_shell_call",
    ]  # fmt: skip
    output_kinds = {"function_call": "function_call_output",
                    "custom_tool_call": "custom_tool_call_output",
                    "local_shell_call": "local_shell_call_output"}  # fmt: skip
    outputs = [
        {"type": output_kinds[item["type"]], "call_id": item["call_id"], "output": "ok"}
        for item in returned
        if item["type"] in output_kinds
    ]
    sent_back = responses_body(tools=tools, input=[{"role": "user", "content": "go"},
                                                   *returned, *outputs])  # fmt: skip
    sent = Responses().to_chat(sent_back)["messages"][1]
    assert same_reply(sent, chat["choices"][0]["message"])
