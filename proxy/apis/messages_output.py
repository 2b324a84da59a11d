"""Anthropic Messages, the way back: the engine's chat answer as a Message (content blocks:
thinking, text, tool_use; `stop_reason` from the finish reason; usage in input/output tokens),
its stream as Anthropic's event grammar (message_start, content_block_start/delta/stop,
message_delta, message_stop), and errors as `{"type": "error", "error": {...}}`.

The request's way in is `proxy.apis.messages`.
"""

from __future__ import annotations

from typing import Any

import orjson

from trajstore.proxy.apis.base import AssistantTurn, parsed_arguments, sse_event
from trajstore.proxy.errors import ProxyError

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

#: Our statuses as Anthropic's error types (what its SDKs expect with each status).
_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "invalid_request_error", 413: "request_too_large",
    429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error",
}  # fmt: skip


def answer(chat: dict[str, Any], body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """A Messages response from the engine's chat answer."""
    turn = AssistantTurn.of_answer(chat)
    content: list[dict[str, Any]] = []
    if turn.reasoning:
        content.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.text:
        content.append({"type": "text", "text": turn.text})
    content += [_tool_use(call) for call in turn.tool_calls]
    return {
        **_message(body, request_id, turn),
        "content": content,
        "usage": {"input_tokens": turn.prompt_tokens, "output_tokens": turn.completion_tokens},
    }


def error_body(error: ProxyError) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = _ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def stop_reason_of(finish_reason: str | None, stop_reason: Any) -> str | None:
    """Anthropic's `stop_reason` for a chat finish reason (and vLLM's stop reason: the stop
    string that matched, if one did)."""
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason or "", "end_turn")


def _message(body: dict[str, Any], request_id: str, turn: AssistantTurn) -> dict[str, Any]:
    stop_reason = stop_reason_of(turn.finish_reason, turn.stop_reason)
    return {
        "id": f"msg_{request_id}",
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "stop_reason": stop_reason if turn.finish_reason else None,
        "stop_sequence": turn.stop_reason if stop_reason == "stop_sequence" else None,
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function") or {}
    arguments = parsed_arguments(function.get("arguments") or "{}")
    if not isinstance(arguments, dict):  # not a JSON object: kept, where Anthropic has room
        arguments = {"arguments": arguments}
    return {
        "type": "tool_use",
        "id": call.get("id"),
        "name": function.get("name"),
        "input": arguments,
    }


class MessagesStream:
    """Chat chunks as Anthropic's stream events: one content block open at a time."""

    def __init__(self, body: dict[str, Any], request_id: str) -> None:
        self.body = body
        self.request_id = request_id
        self.turn = AssistantTurn()
        self.started = False
        self.index = -1  # the content block open, or the last one
        self.open: tuple[str, int] | None = None  # ("text" | "thinking" | "tool", call index)

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """Anthropic events for one engine chunk."""
        added = self.turn.take(chunk)
        out = [] if self.started else [self._start()]
        for kind, value in added:
            if kind == "call":
                call = self.turn.tool_calls[value]
                block = {**_tool_use(call), "input": {}}
                out += self._open(("tool", value), block)
            elif kind == "arguments":
                index, text = value
                if self.open != ("tool", index):  # never seen: the engine sends a call first
                    continue
                delta = {"type": "input_json_delta", "partial_json": text}
                out.append(self._delta(delta))
            elif kind == "text":
                out += self._open(("text", 0), {"type": "text", "text": ""})
                out.append(self._text_delta(value))
            else:
                block = {"type": "thinking", "thinking": "", "signature": ""}
                out += self._open(("thinking", 0), block)
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
        return b"".join(out)

    def end(self) -> bytes:
        """Close the open block, then message_delta (stop reason, usage) and message_stop."""
        out = [] if self.started else [self._start()]
        out += self._close()
        message = _message(self.body, self.request_id, self.turn)
        delta = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
        usage = {"output_tokens": self.turn.completion_tokens}
        out.append(
            sse_event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage})
        )
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return b"".join(out)

    def error(self, error: ProxyError) -> bytes:
        """Anthropic's `error` event."""
        return sse_event("error", error_body(error))

    def _start(self) -> bytes:
        self.started = True
        message = {
            **_message(self.body, self.request_id, AssistantTurn()),
            "content": [],
            "usage": {"input_tokens": self.turn.prompt_tokens, "output_tokens": 0},
        }
        return sse_event("message_start", {"type": "message_start", "message": message})

    def _open(self, which: tuple[str, int], block: dict[str, Any]) -> list[bytes]:
        if self.open == which:
            return []
        out = self._close()
        self.index += 1
        self.open = which
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        out.append(sse_event("content_block_start", start))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [
            sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        ]

    def _text_delta(self, text: str) -> bytes:
        """The one event of every token, written without a dict in between."""
        return (
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":'
            + str(self.index).encode() + b',"delta":{"type":"text_delta","text":'
            + orjson.dumps(text) + b"}}\n\n"
        )  # fmt: skip

    def _delta(self, delta: dict[str, Any]) -> bytes:
        data = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return sse_event("content_block_delta", data)
