"""The Anthropic Messages translation (`proxy.apis.messages`): requests as the `anthropic` SDK
sends them, vLLM's answers and streams back, validated with the SDK's own types (no I/O)."""

from __future__ import annotations

import base64
import json
from typing import Any

import anthropic
import pytest

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
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
    bad_request,
    chat_variant,
    collapsed,
    messages_body,
    sse,
)
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import BadRequest, EngineFailed, Overloaded

# -- Anthropic Messages: the request ------------------------------------------------------------


def test_messages_system_as_a_string_is_the_first_system_message() -> None:
    chat = Messages().to_chat(messages_body(system="You add numbers."))
    assert chat["messages"] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    assert chat["model"] == MODEL
    assert chat["max_tokens"] == 1024


def test_messages_system_as_text_blocks_becomes_text_parts() -> None:
    system = [
        {"type": "text", "text": "You add numbers.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Answer briefly."},
    ]
    chat = Messages().to_chat(messages_body(system=system))
    assert chat["messages"][0] == {
        "role": "system",
        "content": [
            {"type": "text", "text": "You add numbers."},
            {"type": "text", "text": "Answer briefly."},
        ],
    }


def test_messages_system_as_one_text_block_is_plain_text() -> None:
    chat = Messages().to_chat(messages_body(system=[{"type": "text", "text": "You add."}]))
    assert chat["messages"][0] == {"role": "system", "content": "You add."}


def test_messages_user_text_blocks_become_text_parts() -> None:
    content = [{"type": "text", "text": "add 2"}, {"type": "text", "text": "and 3"}]
    chat = Messages().to_chat(messages_body(messages=[{"role": "user", "content": content}]))
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "add 2"}, {"type": "text", "text": "and 3"}],
        }
    ]


def test_messages_assistant_text_and_two_tool_uses_are_one_message_with_two_tool_calls() -> None:
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "I'll add both pairs."},
            {
                "type": "tool_use",
                "id": "toolu_01A09q90qw90lq917835lq9",
                "name": "add",
                "input": {"a": 2, "b": 3},
            },
            {
                "type": "tool_use",
                "id": "toolu_01B8r7s6t5u4v3w2x1y0z9a8",
                "name": "add",
                "input": {"a": 10, "b": -4},
            },
        ],
    }
    body = messages_body(messages=[{"role": "user", "content": "2+3 and 10-4?"}, assistant])
    message = Messages().to_chat(body)["messages"][1]
    assert message["role"] == "assistant"
    assert message["content"] == "I'll add both pairs."
    assert [call["id"] for call in message["tool_calls"]] == [
        "toolu_01A09q90qw90lq917835lq9",
        "toolu_01B8r7s6t5u4v3w2x1y0z9a8",
    ]
    assert all(call["type"] == "function" for call in message["tool_calls"])
    assert [call["function"]["name"] for call in message["tool_calls"]] == ["add", "add"]
    arguments = [call["function"]["arguments"] for call in message["tool_calls"]]
    assert all(isinstance(a, str) for a in arguments)
    assert [json.loads(a) for a in arguments] == [{"a": 2, "b": 3}, {"a": 10, "b": -4}]


def test_messages_assistant_with_only_tool_use_has_null_content() -> None:
    assistant = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1}}],
    }
    body = messages_body(messages=[{"role": "user", "content": "1?"}, assistant])
    message = Messages().to_chat(body)["messages"][1]
    assert message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}


def test_messages_two_tool_results_then_text_are_two_tool_messages_then_a_user_message() -> None:
    user = {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A09q90qw90lq917835lq9", "content": "5"},
            {
                "type": "tool_result",
                "tool_use_id": "toolu_01B8r7s6t5u4v3w2x1y0z9a8",
                "content": "6",
                "is_error": False,
            },
            {"type": "text", "text": "Now multiply them."},
        ],
    }
    body = messages_body(messages=[{"role": "user", "content": "add"}, user])
    assert Messages().to_chat(body)["messages"][1:] == [
        {"role": "tool", "tool_call_id": "toolu_01A09q90qw90lq917835lq9", "content": "5"},
        {"role": "tool", "tool_call_id": "toolu_01B8r7s6t5u4v3w2x1y0z9a8", "content": "6"},
        {"role": "user", "content": "Now multiply them."},
    ]


def test_messages_tool_result_with_text_blocks_becomes_the_tool_message_text() -> None:
    one = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "5"}],
    }
    two = {
        "type": "tool_result",
        "tool_use_id": "toolu_2",
        "content": [{"type": "text", "text": "sum:"}, {"type": "text", "text": "6"}],
    }
    body = messages_body(messages=[{"role": "user", "content": [one, two]}])
    assert Messages().to_chat(body)["messages"] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {
            "role": "tool",
            "tool_call_id": "toolu_2",
            "content": [{"type": "text", "text": "sum:"}, {"type": "text", "text": "6"}],
        },
    ]


def test_messages_thinking_blocks_sent_back_are_dropped() -> None:
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "2 plus 3 is 5.", "signature": "EqQBCkgIARABGAIiQL"},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"},
            {"type": "text", "text": "5"},
        ],
    }
    body = messages_body(
        messages=[
            {"role": "user", "content": "2+3?"},
            assistant,
            {"role": "user", "content": "thanks"},
        ]
    )
    assert Messages().to_chat(body)["messages"] == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "thanks"},
    ]


IMAGE_BLOCK = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgoAAAANSUhEUg=="},
}


def test_messages_image_blocks_become_image_url_parts_in_the_order_of_the_prompt() -> None:
    url_block = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "the screenshot:"}, IMAGE_BLOCK],
    }
    content = [url_block, {"type": "text", "text": "And this?"}, result]
    translated = Messages().translate(
        messages_body(messages=[{"role": "user", "content": content}])
    )
    data_url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="
    assert translated.chat["messages"] == [
        {
            "role": "tool",
            "tool_call_id": "toolu_1",
            "content": [
                {"type": "text", "text": "the screenshot:"},
                {"type": "image_url", "image_url": {"url": data_url}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                {"type": "text", "text": "And this?"},
            ],
        },
    ]
    # The tool result comes first in the prompt, so its image is the first placeholder run.
    assert [image.param for image in translated.images] == [
        "messages.0.content.2.content.1",
        "messages.0.content.0",
    ]
    assert translated.images[0].path == ("messages", 0, "content", 2, "content", 1)


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ({"type": "file", "file_id": "file_1"}, "base64 or url source"),
        ({"type": "base64", "media_type": "image/png"}, "'data'"),
        ({"type": "url"}, "'url'"),
    ],
)
def test_messages_image_block_that_cannot_be_served_is_a_400_naming_the_block(
    source: dict[str, Any], says: str
) -> None:
    content = [{"type": "text", "text": "look"}, {"type": "image", "source": source}]
    error = bad_request(Messages(), messages_body(messages=[{"role": "user", "content": content}]))
    assert says in error.message
    assert error.param == "messages.0.content.1"


def test_messages_document_block_is_a_400() -> None:
    document = {"type": "document", "source": {"type": "text", "data": "x"}}
    error = bad_request(
        Messages(), messages_body(messages=[{"role": "user", "content": [document]}])
    )
    assert "document" in error.message


def test_messages_missing_max_tokens_is_a_400_naming_max_tokens() -> None:
    body = messages_body()
    del body["max_tokens"]
    error = bad_request(Messages(), body)
    assert "max_tokens" in error.message
    assert error.param == "max_tokens"


def test_messages_tools_become_function_tools() -> None:
    tools = [
        {
            "name": "add",
            "description": "Add two integers.",
            "input_schema": ADD_SCHEMA,
            "cache_control": {"type": "ephemeral"},
        },
        {"name": "now", "input_schema": {"type": "object", "properties": {}}},
    ]
    chat = Messages().to_chat(messages_body(tools=tools))
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": ADD_SCHEMA,
                "description": "Add two integers.",
            },
        },
        {
            "type": "function",
            "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
        },
    ]


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_messages_tool_choice_maps_to_chat(tool_choice: dict[str, Any], expected: Any) -> None:
    tools = [{"name": "add", "input_schema": ADD_SCHEMA}]
    chat = Messages().to_chat(messages_body(tools=tools, tool_choice=tool_choice))
    assert chat["tool_choice"] == expected
    assert "parallel_tool_calls" not in chat


def test_messages_disable_parallel_tool_use_turns_parallel_tool_calls_off() -> None:
    tools = [{"name": "add", "input_schema": ADD_SCHEMA}]
    choice = {"type": "any", "disable_parallel_tool_use": True}
    chat = Messages().to_chat(messages_body(tools=tools, tool_choice=choice))
    assert chat["tool_choice"] == "required"
    assert chat["parallel_tool_calls"] is False


def test_messages_unknown_tool_choice_is_a_400() -> None:
    error = bad_request(Messages(), messages_body(tool_choice={"type": "required"}))
    assert error.param == "tool_choice"


def test_messages_stop_sequences_become_stop_and_sampling_passes() -> None:
    body = messages_body(stop_sequences=["\n\nHuman:", "."], temperature=0.7, top_p=0.9, top_k=20)
    chat = Messages().to_chat(body)
    assert chat["stop"] == ["\n\nHuman:", "."]
    assert "stop_sequences" not in chat
    assert (chat["temperature"], chat["top_p"], chat["top_k"]) == (0.7, 0.9, 20)


def test_messages_vllm_extras_pass_and_anthropic_fields_do_not() -> None:
    body = messages_body(
        metadata={"user_id": "user-7f3a"},
        thinking={"type": "enabled", "budget_tokens": 512},
        service_tier="auto",
        seed=7,
        min_p=0.05,
        stream=True,
    )
    chat = Messages().to_chat(body)
    assert chat["seed"] == 7
    assert chat["min_p"] == 0.05
    assert chat["stream"] is True
    for field in ("metadata", "thinking", "service_tier", "system", "stop_sequences"):
        assert field not in chat


@pytest.mark.parametrize("role", ["tool", "developer", "function"])
def test_messages_other_roles_are_a_400(role: str) -> None:
    body = messages_body(messages=[{"role": role, "content": "hi"}])
    error = bad_request(Messages(), body)
    assert "'user' or 'assistant'" in error.message
    assert error.param == "messages.0.role"


def test_messages_empty_messages_is_a_400() -> None:
    assert bad_request(Messages(), messages_body(messages=[])).param == "messages"


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


def test_a_recorded_body_refers_to_its_images_in_place_and_leaves_the_agents_untouched() -> None:
    import copy
    import hashlib

    from trajstore.proxy.images import referenced, referenced_body

    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "the screenshot:"}, IMAGE_BLOCK],
    }
    body = messages_body(messages=[{"role": "user", "content": [result, IMAGE_BLOCK]}])
    sent = copy.deepcopy(body)
    translated = Messages().translate(body)
    params = {id(image.chat_part): image.param for image in translated.images}
    found = referenced(translated.chat["messages"], 1 << 20, params)
    recorded = referenced_body(body, translated.images, found.messages)

    assert body == sent  # the agent's body, as the engine's request was made from it
    digest = hashlib.sha256(base64.b64decode(IMAGE_BLOCK["source"]["data"])).hexdigest()
    reference = {"type": "url", "url": f"trajstore-image:sha256:{digest}"}
    blocks = recorded["messages"][0]["content"]
    assert blocks[0]["content"][1] == {"type": "image", "source": reference}
    assert blocks[1] == {"type": "image", "source": reference}
    assert blocks[0]["content"][0] == {"type": "text", "text": "the screenshot:"}
    assert found.hashes == [digest, digest]
