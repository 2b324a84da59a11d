"""Realistic wire examples for the translations' unit tests (`proxy.apis`): requests as the
official SDKs send them, answers and streams as vLLM sends them, and checks of what goes back
to the agent against the SDKs' own types."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, get_args

import anthropic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.errors import BadRequest

MODEL = "Qwen/Qwen3-0.6B"
REQUEST_ID = "0192f0c5a3b87c1e"

ADD_SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}

ANTHROPIC_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)
#: The Responses stream events by their `type` (the SDK's union is not discriminated).
RESPONSES_EVENTS = {
    get_args(event.model_fields["type"].annotation)[0]: event
    for event in get_args(get_args(ResponseStreamEvent)[0])
}


def sdk_compatible(response: dict[str, Any]) -> dict[str, Any]:
    """A Response object with `usage.input_tokens_details.cache_write_tokens` filled in when
    missing, so that every other field is validated while
    `test_responses_usage_has_every_field_the_openai_sdk_requires` reports that one."""
    response = copy.deepcopy(response)
    if response.get("usage"):
        response["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    return response


def validated_response(answer: dict[str, Any]) -> Response:
    return Response.model_validate(sdk_compatible(answer))


def validate_responses_event(data: dict[str, Any]) -> None:
    if "response" in data:
        data = {**data, "response": sdk_compatible(data["response"])}
    RESPONSES_EVENTS[data["type"]].model_validate(data)


# -- what vLLM answers ---------------------------------------------------------------------------

# A non-streamed chat answer with text only, ended by the model's end of turn.
CHAT_TEXT: dict[str, Any] = {
    "id": "chatcmpl-8d1f0e6a2b7c4e1d9a3b5c7d9e1f2a3b",
    "object": "chat.completion",
    "created": 1760000000,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "The sum is 5.",
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning": None,
                "reasoning_content": None,
            },
            "logprobs": {
                "content": [
                    {
                        "token": "The",
                        "logprob": -0.0123,
                        "bytes": [84, 104, 101],
                        "top_logprobs": [
                            {"token": "The", "logprob": -0.0123, "bytes": [84, 104, 101]},
                            {"token": "So", "logprob": -4.51, "bytes": [83, 111]},
                        ],
                    },
                    {
                        "token": " sum",
                        "logprob": -0.25,
                        "bytes": [32, 115, 117, 109],
                        "top_logprobs": [],
                    },
                    {
                        "token": " is",
                        "logprob": -0.001,
                        "bytes": [32, 105, 115],
                        "top_logprobs": [],
                    },
                    {"token": " ", "logprob": -0.3, "bytes": [32], "top_logprobs": []},
                    {"token": "5", "logprob": -0.0002, "bytes": [53], "top_logprobs": []},
                    {"token": ".", "logprob": -0.04, "bytes": [46], "top_logprobs": []},
                    {"token": "", "logprob": -0.0001, "bytes": [], "top_logprobs": []},
                ]
            },
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": [785, 2629, 374, 220, 20, 13, 151645],
        }
    ],
    "service_tier": None,
    "system_fingerprint": None,
    "usage": {
        "prompt_tokens": 21,
        "total_tokens": 28,
        "completion_tokens": 7,
        "prompt_tokens_details": None,
    },
    "prompt_logprobs": None,
    "prompt_token_ids": list(range(151644, 151644 + 21)),
    "kv_transfer_params": None,
}

# Two parallel tool calls, no text (the hermes parser's answer).
CHAT_CALLS: dict[str, Any] = {
    "id": "chatcmpl-1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d",
    "object": "chat.completion",
    "created": 1760000001,
    "model": MODEL,
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [
                    {
                        "id": "chatcmpl-tool-5b1c9e2f7a3d4c8b",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    },
                    {
                        "id": "chatcmpl-tool-9e8d7c6b5a4f3e2d",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 10, "b": -4}'},
                    },
                ],
                "reasoning": None,
                "reasoning_content": None,
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "token_ids": [151657, 198, 4913, 606, 788, 151658, 151657, 198, 4913, 151658, 151645],
        }
    ],
    "service_tier": None,
    "system_fingerprint": None,
    "usage": {
        "prompt_tokens": 180,
        "total_tokens": 191,
        "completion_tokens": 11,
        "prompt_tokens_details": None,
    },
    "prompt_logprobs": None,
    "prompt_token_ids": list(range(180)),
    "kv_transfer_params": None,
}


def chat_variant(base: dict[str, Any], **choice: Any) -> dict[str, Any]:
    """`base` with some fields of its first choice (or of its message, under `message`) changed."""
    out = copy.deepcopy(base)
    message = choice.pop("message", {})
    out["choices"][0].update(choice)
    out["choices"][0]["message"].update(message)
    return out


# A stream: "Let me add them." then one call of add, its arguments in pieces, then usage.
_ENVELOPE = {
    "id": "chatcmpl-4f3e2d1c0b9a8f7e6d5c4b3a2f1e0d9c",
    "object": "chat.completion.chunk",
    "created": 1760000002,
    "model": MODEL,
}


def _lp(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def _chunk(
    delta: dict[str, Any],
    logprobs: list[dict[str, Any]] | None,
    token_ids: list[int] | None = None,
    *,
    finish_reason: str | None = None,
    **beside: Any,
) -> dict[str, Any]:
    """A chunk of one choice as vLLM streams it; `beside`: fields after `choices`."""
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None if logprobs is None else {"content": logprobs},
        "finish_reason": finish_reason,
    }
    if finish_reason is not None:
        choice["stop_reason"] = None
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {**_ENVELOPE, "choices": [choice], **beside}


STREAM_TEXT = "Let me add them."
STREAM_ARGUMENTS = '{"a": 2, "b": 3}'
STREAM_CALL_ID = "chatcmpl-tool-0d4e6f8a1b3c5d7e"
STREAM_PROMPT = list(range(1000, 1042))
STREAM_CHUNKS: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": ""}, None, prompt_token_ids=STREAM_PROMPT),
    _chunk({"content": "Let"}, [_lp("Let", -0.5)], [10061]),
    _chunk({"content": " me"}, [_lp(" me", -0.01)], [752]),
    _chunk({"content": " add them."}, [_lp(" add", -0.2), _lp(" them.", -0.3)], [912, 1105]),
    _chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": STREAM_CALL_ID,
                    "type": "function",
                    "function": {"name": "add", "arguments": ""},
                }
            ]
        },
        [_lp("<tool_call>", -0.02), _lp('{"name": "add"', -0.1)],
        [151657, 4913],
    ),
    _chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 2'}}]},
        [_lp('{"a": 2', -0.04)],
        [5212],
    ),
    _chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 3'}}]},
        [_lp(', "b": 3', -0.05)],
        [11, 330],
    ),
    _chunk(
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        [_lp("}", -0.001), _lp("</tool_call>", -0.002)],
        [92, 151658],
        finish_reason="tool_calls",
    ),
    {
        **_ENVELOPE,
        "choices": [],
        "usage": {"prompt_tokens": 42, "total_tokens": 52, "completion_tokens": 10},
    },
]

# The same answer, not streamed: what `answer` is compared with.
CHAT_STREAMED_AS_ONE: dict[str, Any] = {
    **_ENVELOPE,
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": STREAM_TEXT,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [
                    {
                        "id": STREAM_CALL_ID,
                        "type": "function",
                        "function": {"name": "add", "arguments": STREAM_ARGUMENTS},
                    }
                ],
                "reasoning": None,
                "reasoning_content": None,
            },
            "logprobs": {
                "content": [
                    lp
                    for chunk in STREAM_CHUNKS
                    for choice in chunk["choices"]
                    for lp in (choice["logprobs"] or {}).get("content") or ()
                ]
            },
            "finish_reason": "tool_calls",
            "stop_reason": None,
            "token_ids": [
                t
                for chunk in STREAM_CHUNKS
                for c in chunk["choices"]
                for t in c.get("token_ids", ())
            ],
        }
    ],
    "usage": {"prompt_tokens": 42, "total_tokens": 52, "completion_tokens": 10},
    "prompt_logprobs": None,
    "prompt_token_ids": STREAM_PROMPT,
    "kv_transfer_params": None,
}

# An empty answer: the model ended its turn at once.
EMPTY_STREAM: list[dict[str, Any]] = [
    _chunk({"role": "assistant", "content": ""}, None, prompt_token_ids=[1, 2, 3, 4, 5]),
    _chunk({"content": ""}, [_lp("", -0.7)], [151645], finish_reason="stop"),
    {
        **_ENVELOPE,
        "choices": [],
        "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1},
    },
]


def sse(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """Server-sent events as (event, data) pairs, checking each is `event: X\\ndata: {...}`."""
    text = raw.decode()
    assert text.endswith("\n\n")
    events = []
    for block in text[:-2].split("\n\n"):
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        parsed = json.loads(data[len("data: ") :])
        assert parsed["type"] == event[len("event: ") :]
        events.append((parsed["type"], parsed))
    return events


def collapsed(names: list[str]) -> list[str]:
    """Event names with runs of the same name as one."""
    return [name for k, name in enumerate(names) if k == 0 or names[k - 1] != name]


def bad_request(translation: Any, body: dict[str, Any]) -> BadRequest:
    with pytest.raises(BadRequest) as caught:
        translation.to_chat(body)
    assert caught.value.status == 400
    return caught.value


# -- requests and what goes back, as each SDK sees them ------------------------------------------


def messages_body(**fields: Any) -> dict[str, Any]:
    """A request as `anthropic.Anthropic().messages.create(...)` sends it."""
    body: dict[str, Any] = {
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "model": MODEL,
    }
    body.update(fields)
    return body


def anthropic_stream(chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    stream = Messages().stream(messages_body(stream=True), REQUEST_ID)
    pieces = [stream.chunk(chunk) for chunk in chunks] + [stream.end()]
    for piece in pieces:
        assert piece == b"" or piece.endswith(b"\n\n")
    events = sse(b"".join(pieces))
    for _, data in events:
        ANTHROPIC_EVENT.validate_python(data)
    return events


def responses_body(**fields: Any) -> dict[str, Any]:
    """A request as `openai.OpenAI().responses.create(...)` sends it."""
    body: dict[str, Any] = {"input": "What is 2 + 3?", "model": MODEL}
    body.update(fields)
    return body


FUNCTION_TOOL = {
    "type": "function",
    "name": "add",
    "description": "Add two integers.",
    "parameters": ADD_SCHEMA,
    "strict": True,
}


def openai_response(chat: dict[str, Any], body: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = Responses().answer(chat, body or responses_body(), REQUEST_ID)
    validated_response(answer)
    return answer


def responses_stream(
    chunks: list[dict[str, Any]], body: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    stream = Responses().stream(body, REQUEST_ID)
    pieces = [stream.chunk(chunk) for chunk in chunks] + [stream.end()]
    for piece in pieces:
        assert piece == b"" or piece.endswith(b"\n\n")
    events = sse(b"".join(pieces))
    for _, data in events:
        validate_responses_event(data)
    return events


# -- requests as real agent CLIs sent them ------------------------------------------------------

AGENTS = Path(__file__).parent / "agents"


def captured(name: str) -> dict[str, Any]:
    """A real CLI's request as captured on the wire (`tests/proxy/agents/<name>.json`): `path`,
    the `headers` that matter and the `body`, unchanged."""
    loaded: dict[str, Any] = json.loads((AGENTS / f"{name}.json").read_text())
    return loaded


CODEX_FIRST = "codex-0.169.0-first-request"
CLAUDE_CODE_FIRST = "claude-code-2.1.328-first-request"
