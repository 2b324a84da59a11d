"""The OpenAI Responses translation (`proxy.apis.responses`), the request: bodies as the
`openai` client sends them become the chat request vLLM serves, or a 400 naming what to fix
(no I/O). The way back: `test_responses_answer_unit.py`."""

from __future__ import annotations

from typing import Any

import pytest

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
    FUNCTION_TOOL,
    MODEL,
    bad_request,
    responses_body,
)
from trajstore.proxy.apis import TRANSLATIONS
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses


def test_both_apis_are_registered() -> None:
    assert isinstance(TRANSLATIONS["messages"], Messages)
    assert isinstance(TRANSLATIONS["responses"], Responses)


# -- OpenAI Responses: the request --------------------------------------------------------------


def test_responses_input_as_a_string_is_one_user_message() -> None:
    chat = Responses().to_chat(responses_body())
    assert chat["messages"] == [{"role": "user", "content": "What is 2 + 3?"}]
    assert chat["model"] == MODEL


def test_responses_instructions_come_first_as_system() -> None:
    chat = Responses().to_chat(responses_body(instructions="You add numbers."))
    assert chat["messages"] == [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]


def test_responses_user_message_with_input_text_parts() -> None:
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "add 2"},
            {"type": "input_text", "text": "and 3"},
        ],
    }
    chat = Responses().to_chat(responses_body(input=[item]))
    assert chat["messages"] == [
        {
            "role": "user",
            "content": [{"type": "text", "text": "add 2"}, {"type": "text", "text": "and 3"}],
        }
    ]


def test_responses_developer_message_is_system() -> None:
    items = [
        {"type": "message", "role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": "2+3?"},
    ]
    chat = Responses().to_chat(responses_body(input=items))
    assert chat["messages"] == [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "2+3?"},
    ]


def test_responses_assistant_message_then_two_calls_is_one_message_with_two_tool_calls() -> None:
    items = [
        {"role": "user", "content": "2+3 and 10-4?"},
        {
            "id": "rs_1",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "two sums"}],
        },
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [
                {"type": "output_text", "text": "Adding both.", "annotations": [], "logprobs": []}
            ],
        },
        {
            "type": "function_call",
            "id": "fc_1_0",
            "call_id": "call_a",
            "name": "add",
            "arguments": '{"a": 2, "b": 3}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "id": "fc_1_1",
            "call_id": "call_b",
            "name": "add",
            "arguments": '{"a": 10, "b": -4}',
            "status": "completed",
        },
        {"type": "function_call_output", "call_id": "call_a", "output": "5"},
        {"type": "function_call_output", "call_id": "call_b", "output": "6"},
    ]
    chat = Responses().to_chat(responses_body(input=items))
    assert chat["messages"] == [
        {"role": "user", "content": "2+3 and 10-4?"},
        {
            "role": "assistant",
            "content": "Adding both.",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                },
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 10, "b": -4}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "5"},
        {"role": "tool", "tool_call_id": "call_b", "content": "6"},
    ]


def test_responses_function_calls_with_no_message_before_are_an_assistant_with_null_content() -> (
    None
):
    items = [
        {"role": "user", "content": "2+3?"},
        {
            "type": "function_call",
            "call_id": "call_a",
            "name": "add",
            "arguments": '{"a": 2, "b": 3}',
        },
        {"type": "function_call_output", "call_id": "call_a", "output": "5"},
    ]
    chat = Responses().to_chat(responses_body(input=items))
    assert chat["messages"][1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
        ],
    }
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "call_a", "content": "5"}


def test_responses_reasoning_item_is_dropped() -> None:
    items = [
        {"role": "user", "content": "2+3?"},
        {"id": "rs_1", "type": "reasoning", "summary": [{"type": "summary_text", "text": "sum"}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "5", "annotations": []}],
        },
        {"role": "user", "content": "thanks"},
    ]
    assert Responses().to_chat(responses_body(input=items))["messages"] == [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "thanks"},
    ]


def test_responses_input_images_become_image_url_parts_with_their_detail() -> None:
    data_url = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="
    items = [
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "What is this?"},
                {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "low"},
            ],
        },
        {"type": "function_call", "call_id": "c1", "name": "view_image", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_image", "image_url": data_url}],
        },
    ]
    translated = Responses().translate(responses_body(input=items))
    messages = translated.chat["messages"]
    assert messages[0]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
    ]
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": [{"type": "image_url", "image_url": {"url": data_url}}],
    }
    assert [image.param for image in translated.images] == ["input.0.content.1", "input.2.output.0"]


def test_responses_input_image_by_file_id_is_a_400_naming_the_part() -> None:
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "file_id": "file-abc", "detail": "auto"},
        ],
    }
    error = bad_request(Responses(), responses_body(input=[item]))
    assert "file_id" in error.message
    assert error.param == "input.0.content.1"


def test_responses_input_file_is_a_400_naming_the_part() -> None:
    item = {"role": "user", "content": [{"type": "input_file", "file_id": "file-abc"}]}
    error = bad_request(Responses(), responses_body(input=[item]))
    assert error.param == "input.0.content.0"


def test_responses_previous_response_id_is_a_400_asking_for_the_whole_input() -> None:
    error = bad_request(Responses(), responses_body(previous_response_id="resp_abc123"))
    assert "input" in error.message
    assert error.param == "previous_response_id"


def test_responses_item_reference_is_a_400() -> None:
    items = [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_abc"}]
    error = bad_request(Responses(), responses_body(input=items))
    assert error.param == "input.1"


def test_responses_function_tools_become_chat_function_tools() -> None:
    chat = Responses().to_chat(responses_body(tools=[FUNCTION_TOOL], parallel_tool_calls=False))
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two integers.",
                "parameters": ADD_SCHEMA,
                "strict": True,
            },
        }
    ]
    assert chat["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        ("auto", "auto"),
        ("none", "none"),
        ("required", "required"),
        ({"type": "function", "name": "add"}, {"type": "function", "function": {"name": "add"}}),
    ],
)
def test_responses_tool_choice_maps_to_chat(tool_choice: Any, expected: Any) -> None:
    chat = Responses().to_chat(responses_body(tools=[FUNCTION_TOOL], tool_choice=tool_choice))
    assert chat["tool_choice"] == expected


def test_responses_hosted_tool_choice_is_a_400() -> None:
    body = responses_body(tools=[FUNCTION_TOOL], tool_choice={"type": "web_search_preview"})
    assert bad_request(Responses(), body).param == "tool_choice"


def test_responses_max_output_tokens_is_max_tokens() -> None:
    chat = Responses().to_chat(responses_body(max_output_tokens=256))
    assert chat["max_tokens"] == 256
    assert "max_output_tokens" not in chat


def test_responses_json_schema_format_is_response_format() -> None:
    text = {
        "format": {
            "type": "json_schema",
            "name": "sum",
            "schema": {"type": "object", "properties": {"sum": {"type": "integer"}}},
            "strict": True,
        }
    }
    chat = Responses().to_chat(responses_body(text=text))
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {
            "name": "sum",
            "schema": {"type": "object", "properties": {"sum": {"type": "integer"}}},
            "strict": True,
        },
    }
    assert "text" not in chat
    plain = Responses().to_chat(responses_body(text={"format": {"type": "text"}}))
    assert "response_format" not in plain


def test_responses_empty_input_list_is_a_400() -> None:
    assert bad_request(Responses(), responses_body(input=[])).param == "input"


def test_responses_vllm_extras_pass_and_responses_fields_do_not() -> None:
    body = responses_body(
        store=False,
        metadata={"run": "7"},
        include=["message.output_text.logprobs"],
        truncation="disabled",
        seed=11,
        top_k=20,
        temperature=0.2,
    )
    chat = Responses().to_chat(body)
    assert (chat["seed"], chat["top_k"], chat["temperature"]) == (11, 20, 0.2)
    for field in ("store", "metadata", "include", "truncation", "input"):
        assert field not in chat
