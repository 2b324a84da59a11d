"""The Anthropic Messages translation (`proxy.apis.messages`), the request: bodies as the
`anthropic` SDK sends them become the chat request vLLM serves, or a 400 naming what to fix, and
a recorded body refers to its images in place (no I/O). The way back:
`test_messages_answer_unit.py`."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
    MODEL,
    bad_request,
    messages_body,
)
from trajstore.proxy.apis.messages import Messages

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
