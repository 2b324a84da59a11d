"""OpenAI Responses, the way back: the engine's chat answer as a Response object, and its stream
as the Responses event grammar (response.created ... response.completed, each event with its
sequence_number).

Output items, in order: reasoning (its text as `reasoning_text` content, and as
`encrypted_content` when the request includes `reasoning.encrypted_content`), one message with
one output_text, then one item per tool call: function_call (with `namespace` for a namespaced
tool), custom_tool_call or local_shell_call (`proxy.apis.responses_tools`).

A stream opens one item at a time. Function calls stream their arguments as they come; a custom
tool's input and a local shell's action are only known once their arguments are whole (they are
JSON fields of them), so those items are announced whole when they end: `output_item.added`,
for a custom call its input as one delta, then `output_item.done`.

`encrypted_content` is not encrypted: it is the reasoning's text. The proxy keeps nothing from
the agent (the log holds that text anyway) and needs nothing back: reasoning sent back is left
out of the engine's messages, as templates leave earlier reasoning out, and token-in
continuation keeps the reasoning the engine sampled in the prompt's ids.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from trajstore.proxy.apis.base import AssistantTurn, sse_event
from trajstore.proxy.apis.responses_tools import ToolKinds, call_item, tool_kinds
from trajstore.proxy.errors import ProxyError

_LOGPROBS = "message.output_text.logprobs"
_ENCRYPTED_REASONING = "reasoning.encrypted_content"


def _logprobs(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "token": e.get("token"),
            "logprob": e.get("logprob"),
            "bytes": e.get("bytes") or [],
            "top_logprobs": [
                {
                    "token": t.get("token"),
                    "logprob": t.get("logprob"),
                    "bytes": t.get("bytes") or [],
                }
                for t in e.get("top_logprobs") or ()
            ],
        }
        for e in entries
    ]


def _asked_logprobs(body: dict[str, Any]) -> bool:
    return _LOGPROBS in (body.get("include") or ())


def _text_part(body: dict[str, Any], text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    part["logprobs"] = _logprobs(logprobs) if _asked_logprobs(body) else []
    return part


def items(
    body: dict[str, Any], request_id: str, turn: AssistantTurn, kinds: ToolKinds | None = None
) -> list[dict[str, Any]]:
    """The output items of a finished turn: the ids are those its stream announced."""
    out: list[dict[str, Any]] = []
    # The item that was being generated when the answer was cut by length is incomplete.
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    if turn.reasoning:
        out.append(_reasoning(body, request_id, turn.reasoning))
    if turn.text or not turn.tool_calls:
        part = _text_part(body, turn.text, turn.logprobs)
        last = not turn.tool_calls
        out.append(_message_item(request_id, [part], status if last else "completed"))
    calls = turn.tool_calls
    if calls and kinds is None:
        kinds = tool_kinds(body)
    out += [
        call_item(request_id, k, call, status if k == len(calls) - 1 else "completed", kinds or {})
        for k, call in enumerate(calls)
    ]
    return out


def _reasoning(body: dict[str, Any], request_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    item = {"type": "reasoning", "id": f"rs_{request_id}", "summary": [], "content": content}
    if _ENCRYPTED_REASONING in (body.get("include") or ()):
        item["encrypted_content"] = text
    return item


def _message_item(
    request_id: str, content: list[dict[str, Any]], status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{request_id}",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def response(
    body: dict[str, Any],
    request_id: str,
    turn: AssistantTurn | None,
    created: float,
    status: str | None = None,
    kinds: ToolKinds | None = None,
) -> dict[str, Any]:
    """The Response object; `turn` None while it is still in progress."""
    incomplete = turn is not None and turn.finish_reason == "length"
    if status is None:
        status = "in_progress" if turn is None else ("incomplete" if incomplete else "completed")
    usage = None
    if turn is not None:
        usage = {
            "input_tokens": turn.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": turn.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": turn.prompt_tokens + turn.completion_tokens,
        }
    return {
        "id": f"resp_{request_id}",
        "object": "response",
        "created_at": int(created),
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": [] if turn is None else items(body, request_id, turn, kinds),
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": body.get("reasoning"),
        "store": False,
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": body.get("truncation", "disabled"),
        "usage": usage,
        "metadata": body.get("metadata") or {},
    }


class ResponsesStream:
    """Chat chunks as the Responses stream: one output item open at a time, numbered events."""

    def __init__(self, body: dict[str, Any], request_id: str) -> None:
        self.body = body
        self.request_id = request_id
        self.created = time.time()
        self.turn = AssistantTurn(keep_logprobs=_asked_logprobs(body))
        self.sequence = 0
        self.started = False
        self.output_index = -1
        self._delta_head: bytes | None = None  # the text deltas' fixed fields
        self.open: tuple[str, int] | None = None  # ("reasoning" | "text" | "call", call index)
        self._whole = False  # the open call is announced whole when it ends
        self._kinds: ToolKinds | None = None  # read from the request at the first call

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        """Responses events for one engine chunk."""
        out = [] if self.started else self._start()
        logprobs_before = len(self.turn.logprobs)
        for kind, value in self.turn.take(chunk):
            if kind == "text":
                out += self._open(("text", 0))
                logprobs = _logprobs(self.turn.logprobs[logprobs_before:])
                out.append(self._text_delta(value, logprobs))
            elif kind == "reasoning":
                out += self._open(("reasoning", 0))
                out.append(self._emit("response.reasoning_text.delta", {
                    "item_id": f"rs_{self.request_id}", "output_index": self.output_index,
                    "content_index": 0, "delta": value,
                }))  # fmt: skip
            elif kind == "call":
                out += self._open(("call", value))
            elif self.open == ("call", value[0]) and not self._whole:
                out.append(self._emit("response.function_call_arguments.delta", {
                    "item_id": f"fc_{self.request_id}_{value[0]}",
                    "output_index": self.output_index, "delta": value[1],
                }))  # fmt: skip
        return b"".join(out)

    def end(self) -> bytes:
        """Close the open item, then response.completed (or response.incomplete)."""
        out = [] if self.started else self._start()
        if self.open is None and not self.turn.tool_calls and not self.turn.text:
            out += self._open(("text", 0))  # an empty answer is one empty message, as unstreamed
        out += self._close()
        done = response(self.body, self.request_id, self.turn, self.created, kinds=self._kinds)
        out.append(self._emit(f"response.{done['status']}", {"response": done}))
        return b"".join(out)

    def error(self, error: ProxyError) -> bytes:
        """`response.failed`, with the error in the response."""
        failed = response(self.body, self.request_id, None, self.created, status="failed")
        # The API's codes are its own (server_error, rate_limit_exceeded, ...): ours is a
        # failure of the server side, named in the message.
        failed["error"] = {"code": "server_error", "message": error.message}
        return self._emit("response.failed", {"response": failed})

    def _text_delta(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        """The one event of every token, written without a dict in between."""
        head = self._delta_head
        if head is None:
            self._delta_head = head = (
                b'"item_id":"msg_' + self.request_id.encode() + b'","output_index":'
                + str(self.output_index).encode() + b',"content_index":0,"delta":'
            )  # fmt: skip
        sequence = str(self.sequence).encode()
        self.sequence += 1
        return (
            b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
            b'"sequence_number":' + sequence + b"," + head + orjson.dumps(text)
            + b',"logprobs":' + orjson.dumps(logprobs) + b"}\n\n"
        )  # fmt: skip

    def _emit(self, name: str, data: dict[str, Any]) -> bytes:
        data = {"type": name, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return sse_event(name, data)

    def _start(self) -> list[bytes]:
        self.started = True
        created = response(self.body, self.request_id, None, self.created)
        return [
            self._emit("response.created", {"response": created}),
            self._emit("response.in_progress", {"response": created}),
        ]

    def _call(self, index: int, status: str) -> dict[str, Any]:
        if self._kinds is None:
            self._kinds = tool_kinds(self.body)
        call = self.turn.tool_calls[index]
        if status == "in_progress":
            call = {**call, "function": {**call["function"], "arguments": ""}}
        return call_item(self.request_id, index, call, status, self._kinds)

    def _item(self, which: tuple[str, int], status: str) -> dict[str, Any]:
        kind, index = which
        if kind == "reasoning":
            text = self.turn.reasoning if status != "in_progress" else ""
            return _reasoning(self.body, self.request_id, text)
        if kind == "call":
            return self._call(index, status)
        content = [] if status == "in_progress" else [self._text_part()]
        return _message_item(self.request_id, content, status)

    def _text_part(self) -> dict[str, Any]:
        return _text_part(self.body, self.turn.text, self.turn.logprobs)

    def _open(self, which: tuple[str, int]) -> list[bytes]:
        if self.open == which:
            return []
        out = self._close()
        self.output_index += 1
        self.open = which
        self._delta_head = None
        if which[0] == "call":
            item = self._call(which[1], "in_progress")
            self._whole = item["type"] != "function_call"
            if self._whole:
                return out  # announced when it ends, whole
        else:
            item = self._item(which, "in_progress")
        out.append(self._added(item))
        if which[0] == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._emit("response.content_part.added", {
                "item_id": item["id"], "output_index": self.output_index, "content_index": 0,
                "part": part,
            }))  # fmt: skip
        return out

    def _added(self, item: dict[str, Any]) -> bytes:
        return self._emit("response.output_item.added", {
            "output_index": self.output_index, "item": item,
        })  # fmt: skip

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        which, self.open = self.open, None
        cut = self.turn.finish_reason == "length"  # only known once the engine finished
        item = self._item(which, "incomplete" if cut else "completed")
        at = {"item_id": item["id"], "output_index": self.output_index}
        out = []
        if which[0] == "text":
            part = self._text_part()
            out.append(self._emit("response.output_text.done", {
                **at, "content_index": 0, "text": part["text"], "logprobs": part["logprobs"],
            }))  # fmt: skip
            out.append(self._emit("response.content_part.done", {
                **at, "content_index": 0, "part": part,
            }))  # fmt: skip
        elif which[0] == "reasoning":
            out.append(self._emit("response.reasoning_text.done", {
                **at, "content_index": 0, "text": self.turn.reasoning,
            }))  # fmt: skip
        elif item["type"] == "custom_tool_call":
            out.append(self._added({**item, "input": ""}))
            out.append(self._emit("response.custom_tool_call_input.delta", {
                **at, "delta": item["input"],
            }))  # fmt: skip
            out.append(self._emit("response.custom_tool_call_input.done", {
                **at, "input": item["input"],
            }))  # fmt: skip
        elif item["type"] == "local_shell_call":
            out.append(self._added({**item, "status": "in_progress"}))
        else:
            out.append(self._emit("response.function_call_arguments.done", {
                **at, "name": item["name"], "arguments": item["arguments"],
            }))  # fmt: skip
        out.append(self._emit("response.output_item.done", {
            "output_index": self.output_index, "item": item,
        }))  # fmt: skip
        return out
