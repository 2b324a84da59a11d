"""The Anthropic Messages translation (`proxy.apis.messages`), the way back: vLLM's answers and
streams as the `anthropic` SDK reads them, validated with its own types, and the reply an agent
sends back read as the engine's own message (no I/O). The request: `test_messages_unit.py`."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from tests.proxy.apis_wire import (
    CHAT_CALLS,
    CHAT_STREAMED_AS_ONE,
    CHAT_TEXT,
    EMPTY_STREAM,
    MODEL,
    REQUEST_ID,
    STREAM_CALL_ID,
    STREAM_CHUNKS,
    STREAM_PROMPT,
    STREAM_TEXT,
    anthropic_stream,
    chat_variant,
    collapsed,
    messages_body,
    sse,
)
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import BadRequest, EngineFailed, Overloaded

# -- Anthropic Messages: the answer -------------------------------------------------------------


def anthropic_message(chat: dict[str, Any], body: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = Messages().answer(chat, body or messages_body(), REQUEST_ID)
    anthropic.types.Message.model_validate(answer)
    return answer


def test_messages_answer_text_ends_the_turn() -> None:
    answer = anthropic_message(CHAT_TEXT)
    assert answer["id"] == f"msg_{REQUEST_ID}"
    assert (answer["type"], answer["role"], answer["model"]) == ("message", "assistant", MODEL)
    assert answer["content"] == [{"type": "text", "text": "The sum is 5."}]
    assert answer["stop_reason"] == "end_turn"
    assert answer["stop_sequence"] is None


def test_messages_answer_stopped_on_a_stop_token_id_ends_the_turn() -> None:
    answer = anthropic_message(chat_variant(CHAT_TEXT, stop_reason=151645))
    assert answer["stop_reason"] == "end_turn"
    assert answer["stop_sequence"] is None


def test_messages_answer_usage_is_input_and_output_tokens() -> None:
    assert anthropic_message(CHAT_TEXT)["usage"] == {"input_tokens": 21, "output_tokens": 7}


def test_messages_answer_empty_has_no_content_blocks() -> None:
    chat = chat_variant(CHAT_TEXT, message={"content": ""}, token_ids=[151645], logprobs=None)
    chat["usage"] = {"prompt_tokens": 21, "total_tokens": 22, "completion_tokens": 1}
    answer = anthropic_message(chat)
    assert answer["content"] == []
    assert answer["stop_reason"] == "end_turn"
    assert answer["usage"] == {"input_tokens": 21, "output_tokens": 1}


def test_messages_answer_tool_calls_are_tool_use_blocks() -> None:
    answer = anthropic_message(CHAT_CALLS)
    assert answer["content"] == [
        {
            "type": "tool_use",
            "id": "chatcmpl-tool-5b1c9e2f7a3d4c8b",
            "name": "add",
            "input": {"a": 2, "b": 3},
        },
        {
            "type": "tool_use",
            "id": "chatcmpl-tool-9e8d7c6b5a4f3e2d",
            "name": "add",
            "input": {"a": 10, "b": -4},
        },
    ]
    assert answer["stop_reason"] == "tool_use"
    assert answer["usage"] == {"input_tokens": 180, "output_tokens": 11}


def test_messages_answer_text_and_reasoning_before_a_tool_call() -> None:
    chat = chat_variant(
        CHAT_CALLS,
        message={
            "content": "Adding.",
            "reasoning": "The user wants 2+3.",
            "tool_calls": CHAT_CALLS["choices"][0]["message"]["tool_calls"][:1],
        },
    )
    answer = anthropic_message(chat)
    assert [block["type"] for block in answer["content"]] == ["thinking", "text", "tool_use"]
    assert answer["content"][0]["thinking"] == "The user wants 2+3."
    assert answer["content"][1]["text"] == "Adding."


def test_messages_answer_cut_by_length_is_max_tokens() -> None:
    answer = anthropic_message(chat_variant(CHAT_TEXT, finish_reason="length"))
    assert answer["stop_reason"] == "max_tokens"
    assert answer["stop_sequence"] is None


def test_messages_answer_stopped_on_a_stop_string_is_stop_sequence() -> None:
    chat = chat_variant(CHAT_TEXT, message={"content": "The sum is 5"}, stop_reason=".")
    answer = anthropic_message(chat, messages_body(stop_sequences=["."]))
    assert answer["stop_reason"] == "stop_sequence"
    assert answer["stop_sequence"] == "."
    assert answer["content"] == [{"type": "text", "text": "The sum is 5"}]


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [
        ("stop", None, "end_turn"),
        ("stop", 151645, "end_turn"),
        ("stop", "\n\nHuman:", "stop_sequence"),
        ("length", None, "max_tokens"),
        ("tool_calls", None, "tool_use"),
    ],
)
def test_messages_finish_reason_in_anthropic_terms(
    finish_reason: str, stop_reason: Any, expected: str
) -> None:
    assert Messages().finish_reason(finish_reason, stop_reason) == expected


def test_messages_error_body_is_anthropic_shape() -> None:
    body = Messages().error_body(BadRequest("'max_tokens' is required", param="max_tokens"))
    assert body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'max_tokens' is required"},
    }
    assert Messages().error_body(Overloaded("busy"))["error"]["type"] == "overloaded_error"


# -- Anthropic Messages: the stream -------------------------------------------------------------


def test_messages_stream_text_then_a_tool_call_follows_anthropic_grammar() -> None:
    events = anthropic_stream(STREAM_CHUNKS)
    names = [name for name, _ in events]
    assert collapsed(names) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"] == f"msg_{REQUEST_ID}"
    assert start["content"] == []
    assert start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == len(STREAM_PROMPT)

    starts = [data for name, data in events if name == "content_block_start"]
    stops = [data for name, data in events if name == "content_block_stop"]
    assert [data["index"] for data in starts] == [0, 1]
    assert [data["index"] for data in stops] == [0, 1]
    assert starts[0]["content_block"] == {"type": "text", "text": ""}
    assert starts[1]["content_block"] == {
        "type": "tool_use",
        "id": STREAM_CALL_ID,
        "name": "add",
        "input": {},
    }

    deltas = [data for name, data in events if name == "content_block_delta"]
    indexes = [data["index"] for name, data in events if name.startswith("content_block")]
    assert indexes == sorted(indexes)
    text = [d["delta"] for d in deltas if d["index"] == 0]
    json_parts = [d["delta"] for d in deltas if d["index"] == 1]
    assert {d["type"] for d in text} == {"text_delta"}
    assert "".join(d["text"] for d in text) == STREAM_TEXT
    assert {d["type"] for d in json_parts} == {"input_json_delta"}
    assert json.loads("".join(d["partial_json"] for d in json_parts)) == {"a": 2, "b": 3}

    message_delta = events[-2][1]
    assert message_delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert message_delta["usage"]["output_tokens"] == 10
    assert events[-1] == ("message_stop", {"type": "message_stop"})


def test_messages_stream_accumulates_to_the_unstreamed_answer() -> None:
    events = anthropic_stream(STREAM_CHUNKS)
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    message: dict[str, Any] = {}
    for name, data in events:
        if name == "message_start":
            message = data["message"]
        elif name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            blocks[data["index"]]["text"] += data["delta"]["text"]
        elif name == "content_block_delta":
            partial[data["index"]] = partial.get(data["index"], "") + data["delta"]["partial_json"]
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text)
    message["content"] = blocks
    assert message == Messages().answer(CHAT_STREAMED_AS_ONE, messages_body(), REQUEST_ID)


def test_messages_stream_with_no_content_still_starts_and_stops() -> None:
    events = anthropic_stream(EMPTY_STREAM)
    assert [name for name, _ in events] == ["message_start", "message_delta", "message_stop"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == 5
    assert events[1][1]["delta"]["stop_reason"] == "end_turn"
    assert events[1][1]["usage"]["output_tokens"] == 1


def test_messages_stream_error_is_an_anthropic_error_event() -> None:
    stream = Messages().stream(messages_body(stream=True), REQUEST_ID)
    stream.chunk(STREAM_CHUNKS[0])
    [(name, data)] = sse(stream.error(EngineFailed("the engine closed the stream")))
    assert name == "error"
    assert data == {
        "type": "error",
        "error": {"type": "api_error", "message": "the engine closed the stream"},
    }
    [(_, overloaded)] = sse(stream.error(Overloaded("every engine is saturated")))
    assert overloaded["error"]["type"] == "overloaded_error"


# -- round trips: the reply sent back is the engine's message ------------------------------------


def test_messages_round_trip_of_text_and_tool_calls_is_the_same_reply() -> None:
    chat = chat_variant(CHAT_CALLS, message={"content": "Adding.", "reasoning": "two sums"})
    message = anthropic.types.Message.model_validate(
        Messages().answer(chat, messages_body(), REQUEST_ID)
    )
    returned = [block.model_dump(exclude_none=True) for block in message.content]
    results = [
        {"type": "tool_result", "tool_use_id": block["id"], "content": "5"}
        for block in returned
        if block["type"] == "tool_use"
    ]
    body = messages_body(
        messages=[
            {"role": "user", "content": "2+3 and 10-4?"},
            {"role": "assistant", "content": returned},
            {"role": "user", "content": results},
        ]
    )
    sent = Messages().to_chat(body)["messages"][1]
    assert same_reply(sent, chat["choices"][0]["message"])


def test_messages_round_trip_of_text_is_the_same_reply() -> None:
    message = anthropic.types.Message.model_validate(
        Messages().answer(CHAT_TEXT, messages_body(), REQUEST_ID)
    )
    body = messages_body(
        messages=[
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": message.role,
                "content": [b.model_dump(exclude_none=True) for b in message.content],
            },
            {"role": "user", "content": "thanks"},
        ]
    )
    sent = Messages().to_chat(body)["messages"][1]
    assert same_reply(sent, CHAT_TEXT["choices"][0]["message"])
