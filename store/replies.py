"""Whether the assistant message an agent sends back is the reply it was given.

Agents keep the replies they get and send them back with their history, as their client library
re-serialises them: `content` null, "" or text parts alike; tool-call arguments as JSON values
(spacing and key order do not matter); reasoning fields left out (the OpenAI API has no way to
send them back). The proxy continues a turn only when the reply comes back the same
(`proxy.continuation`, rule 3); the projection tells a re-rendered history from an edited one
by it (`store.lineages`).
"""

from __future__ import annotations

from typing import Any

import orjson


def text_of(content: Any) -> Any:
    """A message's content as text when it is text (null, a string or text parts), else as is."""
    if content is None:
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return "".join(str(p.get("text", "")) for p in content)
    return content


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            return raw
    return raw


def _calls(message: dict[str, Any]) -> list[tuple[Any, Any, Any]]:
    calls = []
    for call in message.get("tool_calls") or ():
        function = (call.get("function") if isinstance(call, dict) else None) or {}
        calls.append((call.get("id"), function.get("name"), _arguments(function.get("arguments"))))
    return calls


def same_reply(sent: dict[str, Any], returned: dict[str, Any] | None) -> bool:
    """Whether the assistant message an agent sent back is the reply it was given."""
    if returned is None or sent.get("role") != "assistant":
        return False
    return text_of(sent.get("content")) == text_of(returned.get("content")) and _calls(
        sent
    ) == _calls(returned)
