"""OpenAI Responses (`POST /v1/responses`), served over the engine's chat completions.

    Responses                               chat
    instructions                            a first system message
    input as text                           one user message
    message items (user, system, developer, their role's message (developer as system); text
      assistant; input_text / output_text)   parts joined as the template expects
    function_call items                     tool_calls of the assistant message before them
                                            (or of a new one)
    function_call_output items              tool messages
    reasoning items sent back               left out (a template strips earlier reasoning)
    tools of type function                  function tools
    max_output_tokens, text.format          max_tokens, response_format
    previous_response_id, conversation      400: send the whole conversation in `input`
    images, files, hosted tools             400: text and function tools only, for now

Back: the first choice as output items (reasoning, a message with one output_text, one
function_call per tool call), `status` completed, or incomplete with reason max_output_tokens
when cut by length; `include: ["message.output_text.logprobs"]` adds the behaviour logprobs;
streams in the Responses event grammar (response.created ... response.completed, each event with
its sequence_number); errors in OpenAI's shape, mid-stream as `response.failed`.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from trajstore.proxy.apis.base import AssistantTurn, refuse_media, sse_event, text_content
from trajstore.proxy.errors import BadRequest, ProxyError

#: The Responses API's own fields, translated or ignored (`store`: the proxy records every
#: request anyway; `metadata`, `user` and the like are not the engine's business). Anything else
#: (vLLM's sampling extras such as `seed` or `top_k`) passes on to the engine untouched.
_OWN = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
    "max_output_tokens", "temperature", "top_p", "top_logprobs", "stream", "text", "include",
    "previous_response_id", "conversation", "background", "prompt", "store", "metadata",
    "user", "truncation", "service_tier", "reasoning", "prompt_cache_key", "safety_identifier",
    "stream_options", "max_tool_calls", "prompt_cache_retention",
}  # fmt: skip

_LOGPROBS = "message.output_text.logprobs"
_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts(content: Any, param: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise BadRequest("'content' must be a string or a list of content parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS:
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        elif kind in ("input_image", "input_file", "input_audio"):
            raise refuse_media(kind, param)
        else:
            raise BadRequest(f"unexpected content part {kind!r}", param=param)
    return texts


def _item_messages(items: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for k, item in enumerate(items):
        param = f"input.{k}"
        if not isinstance(item, dict):
            raise BadRequest("each input item must be an object", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise BadRequest(
                    "a message's 'role' must be user, system, developer or assistant",
                    param=f"{param}.role",
                )
            texts = _parts(item.get("content"), f"{param}.content")
            role = "system" if role == "developer" else role
            out.append({"role": role, "content": text_content(texts) if texts else ""})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output", "")
            content = output if isinstance(output, str) else text_content(_parts(output, param))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": content})
        elif kind == "reasoning":
            continue  # not sent back to the model: templates strip earlier reasoning
        elif kind == "item_reference":
            raise BadRequest(
                "item references need stored responses, which trajstore's proxy does not serve: "
                "send the item itself",
                param=param,
            )
        else:
            raise BadRequest(
                f"input items of type {kind!r} are not served (messages, function_call and "
                "function_call_output are)",
                param=param,
            )
    return out


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages a Responses request means (instructions first)."""
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise BadRequest(
                f"'{field}' needs conversation state stored by the server, which trajstore's "
                "proxy does not keep: send the whole conversation in 'input' (earlier items, the "
                "previous response's output items, then the new ones)",
                param=field,
            )
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        out.append(
            {"role": "system", "content": text_content(_parts(instructions, "instructions"))}
        )
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        out += _item_messages(given)
    else:
        raise BadRequest("'input' must be a string or a non-empty list of items", param="input")
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list", param="tools")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise BadRequest(
                f"tools.{k}: only function tools are served; {kind!r} runs on OpenAI's servers",
                param=f"tools.{k}",
            )
        function = {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise BadRequest(
        "'tool_choice' must be auto, none, required or {type: function, name}", param="tool_choice"
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest("'text.format' must be text, json_object or json_schema", param="text")


class Responses:
    """The OpenAI Responses API (a `proxy.apis.Translation`)."""

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat request a Responses request means."""
        for refused in ("background", "prompt"):
            if body.get(refused):
                raise BadRequest(f"'{refused}' is not served by trajstore's proxy", param=refused)
        chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _OWN}
        chat["model"] = body.get("model")
        chat["messages"] = chat_messages(body)
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        for field in ("temperature", "top_p", "top_logprobs", "parallel_tool_calls"):
            if body.get(field) is not None:
                chat[field] = body[field]
        if body.get("tools"):
            chat["tools"] = _tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = _tool_choice(body["tool_choice"])
        response_format = _response_format(body.get("text"))
        if response_format is not None:
            chat["response_format"] = response_format
        if body.get("stream"):  # checked with the body (`proxy.wire.parse_body`)
            chat["stream"] = True
        return chat

    def answer(self, chat: dict[str, Any], body: dict[str, Any], request_id: str) -> dict[str, Any]:
        """A Response object from the engine's chat answer."""
        return _response(body, request_id, AssistantTurn.of_answer(chat), time.time())

    def stream(self, body: dict[str, Any], request_id: str) -> ResponsesStream:
        """A translator for one stream."""
        return ResponsesStream(body, request_id)

    def error_body(self, error: ProxyError) -> dict[str, Any]:
        """OpenAI's error shape (the Responses API shares it)."""
        return error.body()

    def finish_reason(self, finish_reason: str | None, stop_reason: Any) -> str | None:
        """`completed`, or the reason a response is incomplete."""
        return "max_output_tokens" if finish_reason == "length" else "completed"


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


def _items(body: dict[str, Any], request_id: str, turn: AssistantTurn) -> list[dict[str, Any]]:
    """The output items of a finished turn: the ids are those its stream announced."""
    items: list[dict[str, Any]] = []
    # The item that was being generated when the answer was cut by length is incomplete.
    status = "incomplete" if turn.finish_reason == "length" else "completed"
    if turn.reasoning:
        items.append(_reasoning(request_id, turn.reasoning))
    if turn.text or not turn.tool_calls:
        part = _text_part(body, turn.text, turn.logprobs)
        last = not turn.tool_calls
        items.append(_message_item(request_id, [part], status if last else "completed"))
    calls = turn.tool_calls
    items += [
        _call_item(request_id, k, call, status if k == len(calls) - 1 else "completed")
        for k, call in enumerate(calls)
    ]
    return items


def _reasoning(request_id: str, text: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": f"rs_{request_id}", "summary": [], "content": content}


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


def _call_item(
    request_id: str, k: int, call: dict[str, Any], status: str = "completed"
) -> dict[str, Any]:
    function = call.get("function") or {}
    return {
        "type": "function_call",
        "id": f"fc_{request_id}_{k}",
        "call_id": call.get("id"),
        "name": function.get("name"),
        "arguments": function.get("arguments") or "",
        "status": status,
    }


def _response(
    body: dict[str, Any],
    request_id: str,
    turn: AssistantTurn | None,
    created: float,
    status: str | None = None,
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
        "output": [] if turn is None else _items(body, request_id, turn),
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
            elif self.open == ("call", value[0]):
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
        response = _response(self.body, self.request_id, self.turn, self.created)
        name = f"response.{response['status']}"
        out.append(self._emit(name, {"response": response}))
        return b"".join(out)

    def error(self, error: ProxyError) -> bytes:
        """`response.failed`, with the error in the response."""
        response = _response(self.body, self.request_id, None, self.created, status="failed")
        # The API's codes are its own (server_error, rate_limit_exceeded, ...): ours is a
        # failure of the server side, named in the message.
        response["error"] = {"code": "server_error", "message": error.message}
        return self._emit("response.failed", {"response": response})

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
        response = _response(self.body, self.request_id, None, self.created)
        return [
            self._emit("response.created", {"response": response}),
            self._emit("response.in_progress", {"response": response}),
        ]

    def _item(self, which: tuple[str, int], status: str) -> dict[str, Any]:
        kind, index = which
        if kind == "reasoning":
            return _reasoning(
                self.request_id, self.turn.reasoning if status != "in_progress" else ""
            )
        if kind == "call":
            call = self.turn.tool_calls[index]
            if status == "in_progress":
                call = {**call, "function": {**call["function"], "arguments": ""}}
            return _call_item(self.request_id, index, call, status)
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
        item = self._item(which, "in_progress")
        out.append(self._emit("response.output_item.added", {
            "output_index": self.output_index, "item": item,
        }))  # fmt: skip
        if which[0] == "text":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(self._emit("response.content_part.added", {
                "item_id": item["id"], "output_index": self.output_index, "content_index": 0,
                "part": part,
            }))  # fmt: skip
        return out

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
        else:
            out.append(self._emit("response.function_call_arguments.done", {
                **at, "name": item["name"], "arguments": item["arguments"],
            }))  # fmt: skip
        out.append(self._emit("response.output_item.done", {
            "output_index": self.output_index, "item": item,
        }))  # fmt: skip
        return out
