"""The Responses API's tools as the engine's chat functions, and their calls both ways.

    tool in the request               what the engine sees                 its call, back
    function                          that function                        function_call
    namespace {name, tools}           each of its tools, as a function     function_call (or
                                      named `<namespace>__<name>`          custom_tool_call) with
                                                                           `namespace` and the name
    custom {name, format}             a function of one string, `input`    custom_tool_call {input}
    local_shell                       a function `local_shell` of the      local_shell_call
                                      exec action's fields                 {action: {type: exec}}
    web_search, file_search, mcp,     nothing: left out, recorded with     -
      code_interpreter, ... (any      the turn (`dropped_tools`) and
      type the engine cannot run)     said in a response header

A namespace's flat name is Codex's own (`codex-rs/protocol/src/tool_name.rs`): the namespace
without trailing underscores, `__`, the name without leading ones. The way back never parses a
flat name: the request's tools say which chat name is which tool (`ToolKinds`), so a name the
model made up goes back as a plain function_call, as the engine gave it.

A custom tool's grammar (`format: {type: grammar, syntax, definition}`) is shown to the model in
the `input` argument's description but not enforced: vLLM's structured outputs constrain a whole
answer, not one argument of an answer that may call any tool or none. So it is recorded as
dropped (`type: grammar`), and the agent's own parser checks the input, as it must anyway.

The calls the agent sends back in `input` (function_call with its namespace, custom_tool_call,
local_shell_call, and their outputs) become the chat tool calls and tool messages the engine gave
and was given, so token-in continuation finds the reply it returned (`proxy.continuation`).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import orjson

from trajstore.proxy.apis.base import Dropped, parsed_arguments
from trajstore.proxy.errors import BadRequest

LOCAL_SHELL = "local_shell"

#: The exec action of a `local_shell_call` (the `openai` package's `LocalShellCallAction`) as
#: the arguments of a function.
_LOCAL_SHELL_FUNCTION = {
    "name": LOCAL_SHELL,
    "description": "Run a command on the user's machine and get its output.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {
                "type": "array", "items": {"type": "string"},
                "description": "The program and its arguments, e.g. [\"bash\", \"-lc\", \"ls\"].",
            },
            "working_directory": {"type": "string"},
            "timeout_ms": {"type": "integer"},
            "env": {"type": "object", "additionalProperties": {"type": "string"}},
            "user": {"type": "string"},
        },
        "required": ["command"],
    },
}  # fmt: skip
_ACTION_FIELDS = ("command", "working_directory", "timeout_ms", "env", "user")


class ToolKind(NamedTuple):
    """A chat function that stands for something other than a plain function tool."""

    kind: Literal["function", "custom", "local_shell"]
    namespace: str | None
    name: str  #: the tool's own name, as the agent calls it


#: Chat function name -> the tool it stands for; plain function tools are not in it.
ToolKinds = dict[str, ToolKind]


def flat_name(namespace: str, name: str) -> str:
    """A namespaced tool's name as one chat function name (Codex's flattening)."""
    return f"{namespace.rstrip('_')}__{name.lstrip('_')}"


def _name(tool: dict[str, Any], param: str, what: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{param}: a {what} tool needs a 'name' (a non-empty string)", param=param)
    return name


def _custom_function(tool: dict[str, Any], name: str, param: str) -> tuple[dict[str, Any], bool]:
    """A custom tool as a function of one string; and whether its grammar went unenforced."""
    fmt = tool.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    described = "The tool's input, as free text."
    if kind == "grammar":
        definition, syntax = fmt.get("definition"), fmt.get("syntax")  # type: ignore[union-attr]
        if not isinstance(definition, str) or not isinstance(syntax, str):
            raise BadRequest(
                f"{param}.format: a grammar needs 'syntax' (lark or regex) and 'definition' "
                "(strings)",
                param=f"{param}.format",
            )
        described = f"The tool's input: text that follows this {syntax} grammar.\n{definition}"
    elif fmt is not None and kind != "text":
        raise BadRequest(
            f"{param}.format: a custom tool's format is {{type: text}} or {{type: grammar, "
            "syntax, definition}}",
            param=f"{param}.format",
        )
    function: dict[str, Any] = {"name": name}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    function["parameters"] = {
        "type": "object",
        "properties": {"input": {"type": "string", "description": described}},
        "required": ["input"],
        "additionalProperties": False,
    }
    return function, kind == "grammar"


class _Tools:
    """One request's tools, walked once: the chat functions, their kinds, what was dropped."""

    def __init__(self) -> None:
        self.functions: list[dict[str, Any]] = []
        self.kinds: ToolKinds = {}
        self.dropped: list[Dropped] = []
        self._params: dict[str, str] = {}  # chat name -> where it came from

    def walk(self, tools: Any) -> _Tools:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list", param="tools")
        for k, tool in enumerate(tools):
            param = f"tools.{k}"
            kind = _type_of(tool, param)
            if kind == "namespace":
                self._namespace(tool, param)
            elif kind in ("function", "custom"):
                self._add(tool, kind, None, param)
            elif kind == LOCAL_SHELL:
                self._function(dict(_LOCAL_SHELL_FUNCTION), param)
                self.kinds[LOCAL_SHELL] = ToolKind("local_shell", None, LOCAL_SHELL)
            else:  # hosted, or a kind this proxy does not serve: the engine cannot run it
                name = tool.get("name") or tool.get("server_label")
                self.dropped.append(Dropped(param, kind, name if isinstance(name, str) else None))
        return self

    def _namespace(self, tool: dict[str, Any], param: str) -> None:
        namespace = _name(tool, param, "namespace")
        members = tool.get("tools")
        if not isinstance(members, list):
            raise BadRequest(
                f"{param}.tools: a namespace needs 'tools', a list of function and custom tools",
                param=f"{param}.tools",
            )
        for j, member in enumerate(members):
            where = f"{param}.tools.{j}"
            kind = _type_of(member, where)
            if kind not in ("function", "custom"):
                raise BadRequest(
                    f"{where}: a namespace groups function and custom tools, not {kind!r}",
                    param=where,
                )
            self._add(member, kind, namespace, where)

    def _add(self, tool: dict[str, Any], kind: str, namespace: str | None, param: str) -> None:
        name = _name(tool, param, kind)
        chat_name = name if namespace is None else flat_name(namespace, name)
        if kind == "custom":
            function, grammar = _custom_function(tool, chat_name, param)
            if grammar:
                self.dropped.append(Dropped(f"{param}.format", "grammar", name))
            self.kinds[chat_name] = ToolKind("custom", namespace, name)
        else:
            function = {k: tool[k] for k in ("description", "parameters", "strict") if k in tool}
            function = {"name": chat_name, **function}
            if namespace is not None:
                self.kinds[chat_name] = ToolKind("function", namespace, name)
        self._function(function, param)

    def _function(self, function: dict[str, Any], param: str) -> None:
        name = function["name"]
        if name in self._params:
            raise BadRequest(
                f"{param}: its function name for the engine, {name!r}, is already that of "
                f"{self._params[name]}: tool names must be unique",
                param=param,
            )
        self._params[name] = param
        self.functions.append({"type": "function", "function": function})


def _type_of(tool: Any, param: str) -> str:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if not isinstance(kind, str):
        raise BadRequest(f"{param}: each tool must be an object with a 'type'", param=param)
    return kind


def chat_tools(tools: Any) -> tuple[list[dict[str, Any]], list[Dropped]]:
    """The request's tools as chat function tools, and the ones the engine does not get."""
    walked = _Tools().walk(tools)
    return walked.functions, walked.dropped


def tool_kinds(body: dict[str, Any]) -> ToolKinds:
    """Which chat functions of the request stand for namespaced, custom or local_shell tools
    (the request was checked by `chat_tools` before)."""
    tools = body.get("tools")
    if not tools or all(isinstance(t, dict) and t.get("type") == "function" for t in tools):
        return {}
    return _Tools().walk(tools).kinds


def chat_tool_name(kinds: ToolKinds, name: Any) -> Any:
    """A tool_choice's function name as the engine knows it: a custom or local_shell tool of
    that name, else the name itself."""
    for chat_name, tool in kinds.items():
        if tool.name == name and tool.namespace is None:
            return chat_name
    return name


# -- the engine's calls, as output items --------------------------------------------------------


def custom_input(arguments: str) -> str:
    """A custom tool's input from the engine's arguments (`{"input": ...}`); the arguments as
    they are when the model did not follow the schema."""
    value = parsed_arguments(arguments)
    if isinstance(value, dict) and isinstance(value.get("input"), str):
        return str(value["input"])
    return arguments


def shell_action(arguments: str) -> dict[str, Any]:
    """A local_shell_call's exec action from the engine's arguments (what a field that is not of
    its type becomes: command [], env {}, the others null)."""
    value = parsed_arguments(arguments)
    fields = value if isinstance(value, dict) else {}
    command = fields.get("command")
    if isinstance(command, str):
        command = [command]
    if not isinstance(command, list) or not all(isinstance(c, str) for c in command):
        command = []
    env = fields.get("env")
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        env = {}
    timeout, user, directory = (fields.get(f) for f in ("timeout_ms", "user", "working_directory"))
    return {
        "type": "exec",
        "command": command,
        "env": env,
        "timeout_ms": timeout if type(timeout) is int else None,
        "user": user if isinstance(user, str) else None,
        "working_directory": directory if isinstance(directory, str) else None,
    }


def call_item(
    request_id: str, k: int, call: dict[str, Any], status: str, kinds: ToolKinds
) -> dict[str, Any]:
    """The output item of the engine's k-th tool call."""
    function = call.get("function") or {}
    name = function.get("name")
    arguments = function.get("arguments") or ""
    tool = kinds.get(name) if kinds and isinstance(name, str) else None
    if tool is not None and tool.kind == "custom":
        item = {
            "type": "custom_tool_call", "id": f"ctc_{request_id}_{k}", "call_id": call.get("id"),
            "name": tool.name, "input": custom_input(arguments),
        }  # fmt: skip
    elif tool is not None and tool.kind == "local_shell":
        return {
            "type": "local_shell_call", "id": f"lsh_{request_id}_{k}", "call_id": call.get("id"),
            "status": status, "action": shell_action(arguments),
        }  # fmt: skip
    else:
        item = {
            "type": "function_call", "id": f"fc_{request_id}_{k}", "call_id": call.get("id"),
            "name": name if tool is None else tool.name, "arguments": arguments, "status": status,
        }  # fmt: skip
    if tool is not None and tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


# -- the agent's calls and outputs sent back, as chat ------------------------------------------


def _string(item: dict[str, Any], field: str, param: str, kind: str) -> str:
    value = item.get(field)
    if not isinstance(value, str):
        raise BadRequest(f"{param}: a {kind} item needs '{field}' (a string)", param=param)
    return value


def chat_call(item: dict[str, Any], kind: str, param: str) -> dict[str, Any]:
    """The chat tool call a function_call, custom_tool_call or local_shell_call item was."""
    call_id = _string(item, "call_id", param, kind)
    namespace = item.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise BadRequest(f"{param}: a {kind} item's 'namespace' is a string", param=param)
    if kind == "local_shell_call":
        action = item.get("action")
        if not isinstance(action, dict) or not isinstance(action.get("command"), list):
            raise BadRequest(
                f"{param}: a local_shell_call item needs 'action' with 'command' (a list)",
                param=param,
            )
        kept = {f: action[f] for f in _ACTION_FIELDS if action.get(f) not in (None, {})}
        name, arguments = LOCAL_SHELL, orjson.dumps(kept).decode()
    else:
        name = _string(item, "name", param, kind)
        if kind == "custom_tool_call":
            arguments = orjson.dumps({"input": _string(item, "input", param, kind)}).decode()
        else:
            arguments = item.get("arguments", "")
        if namespace:
            name = flat_name(namespace, name)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def output_call_id(item: dict[str, Any], kind: str, param: str) -> str:
    """The call an output item answers (a local_shell_call_output may name it as its `id`)."""
    call_id = item.get("call_id")
    if call_id is None and kind == "local_shell_call_output":
        call_id = item.get("id")
    if not isinstance(call_id, str):
        raise BadRequest(f"{param}: a {kind} item needs 'call_id' (a string)", param=param)
    return call_id
