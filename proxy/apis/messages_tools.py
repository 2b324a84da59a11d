"""Anthropic Messages' tools as the engine's chat functions.

    tool in the request                 what the engine sees
    client tool {name, description,     that function (`cache_control`, `defer_loading`,
      input_schema} (type none|custom)    `input_examples` and the like are Anthropic's business)
    bash_20250124                       a function `bash` of the schema Anthropic defines for it
    text_editor_2025xxxx                a function of its name (`str_replace_editor`,
                                          `str_replace_based_edit_tool`) and Anthropic's schema
    web_search_*, web_fetch_*,          nothing: left out, recorded with the turn
      code_execution_*, computer_*,       (`dropped_tools`) and said in a response header
      memory_*, tool_search_*, ...

Why bash and the text editor are served and the others are not. Both run on the client (Claude
Code, or any agent that declares them executes the `tool_use` itself) and Anthropic's docs define
their input exactly, so the engine can be given that schema and the agent gets the `tool_use` it
expects, under the name it declared. The web tools and code execution run on Anthropic's servers,
which the engine cannot reach. The computer tool also runs on the client, but its results are
screenshots, which this API does not take yet (images are refused); memory and tool search keep
state on Anthropic's side. An agent that needs one of those declares a client tool instead.
"""

from __future__ import annotations

from typing import Any

from trajstore.proxy.apis.base import Dropped
from trajstore.proxy.errors import BadRequest

_BASH = {
    "description": "Run a command in a persistent bash session and get its output; "
    "`restart: true` starts a new session.",
    "parameters": {
        "type": "object",
        "properties": {
            "command": {"type": "string", "description": "The command to run."},
            "restart": {"type": "boolean", "description": "Restart the session instead."},
        },
    },
}

_EDITOR_COMMANDS = ["view", "create", "str_replace", "insert"]


def _text_editor(version: str) -> dict[str, Any]:
    """The text editor's schema: `undo_edit` only up to text_editor_20250124."""
    commands = _EDITOR_COMMANDS + (["undo_edit"] if version <= "20250124" else [])
    return {
        "description": "View, create and edit text files: `view` a file (optionally lines "
        "`view_range`) or a directory, `create` one with `file_text`, `str_replace` `old_str` "
        "(unique in the file) with `new_str`, `insert` `new_str` after line `insert_line`.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": commands},
                "path": {"type": "string", "description": "The file or directory."},
                "file_text": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "insert_line": {"type": "integer"},
                "view_range": {
                    "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2,
                },
            },
            "required": ["command", "path"],
        },
    }  # fmt: skip


def _client_function(tool: dict[str, Any], param: str) -> dict[str, Any]:
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name or not isinstance(schema, dict):
        raise BadRequest(
            f"{param}: a client tool needs 'name' (a string) and 'input_schema' (an object)",
            param=param,
        )
    function = {"name": name, "parameters": schema}
    if tool.get("description"):
        function["description"] = tool["description"]
    return function


def chat_tools(tools: Any) -> tuple[list[dict[str, Any]], list[Dropped]]:
    """The request's tools as chat function tools, and the ones the engine does not get."""
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    out: list[dict[str, Any]] = []
    dropped: list[Dropped] = []
    for k, tool in enumerate(tools):
        param = f"tools.{k}"
        if not isinstance(tool, dict):
            raise BadRequest(f"{param}: each tool must be an object", param=param)
        kind = tool.get("type")
        if kind is None or kind == "custom":
            function = _client_function(tool, param)
        elif not isinstance(kind, str):
            raise BadRequest(f"{param}: 'type' must be a string", param=param)
        else:
            name = tool.get("name")
            family, _, version = kind.rpartition("_")
            if family == "bash" and name == "bash":
                function = {"name": name, **_BASH}
            elif family == "text_editor" and isinstance(name, str) and name:
                function = {"name": name, **_text_editor(version)}
            else:  # runs on Anthropic's servers, or needs what this API does not take
                dropped.append(Dropped(param, kind, name if isinstance(name, str) else None))
                continue
        out.append({"type": "function", "function": function})
    return out, dropped
