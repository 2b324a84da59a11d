"""The OpenAI Responses translation (`proxy.apis.responses`): requests as the `openai` client
sends them, vLLM's answers and streams back, validated with the SDK's own types (no I/O)."""

from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response

from tests.proxy.apis_wire import (
    ADD_SCHEMA,
    CHAT_CALLS,
    CHAT_STREAMED_AS_ONE,
    CHAT_TEXT,
    EMPTY_STREAM,
    FUNCTION_TOOL,
    MODEL,
    REQUEST_ID,
    STREAM_ARGUMENTS,
    STREAM_CALL_ID,
    STREAM_CHUNKS,
    STREAM_TEXT,
    bad_request,
    chat_variant,
    collapsed,
    openai_response,
    responses_body,
    responses_stream,
    sse,
    validated_response,
)
from trajstore.proxy.apis import TRANSLATIONS
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import EngineFailed


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


# -- OpenAI Responses: the answer ---------------------------------------------------------------


def test_responses_answer_text_is_one_message_item() -> None:
    answer = openai_response(CHAT_TEXT)
    assert answer["id"] == f"resp_{REQUEST_ID}"
    assert answer["object"] == "response"
    assert answer["status"] == "completed"
    assert answer["incomplete_details"] is None
    assert answer["output"] == [
        {
            "type": "message",
            "id": f"msg_{REQUEST_ID}",
            "status": "completed",
            "role": "assistant",
            "content": [
                {"type": "output_text", "text": "The sum is 5.", "annotations": [], "logprobs": []}
            ],
        }
    ]
    assert answer["usage"]["input_tokens"] == 21
    assert answer["usage"]["output_tokens"] == 7
    assert answer["usage"]["total_tokens"] == 28
    assert validated_response(answer).output_text == "The sum is 5."


def test_responses_answer_tool_calls_are_function_call_items_and_no_message() -> None:
    body = responses_body(tools=[FUNCTION_TOOL])
    answer = openai_response(CHAT_CALLS, body)
    assert answer["status"] == "completed"
    assert answer["output"] == [
        {
            "type": "function_call",
            "id": f"fc_{REQUEST_ID}_0",
            "call_id": "chatcmpl-tool-5b1c9e2f7a3d4c8b",
            "name": "add",
            "arguments": '{"a": 2, "b": 3}',
            "status": "completed",
        },
        {
            "type": "function_call",
            "id": f"fc_{REQUEST_ID}_1",
            "call_id": "chatcmpl-tool-9e8d7c6b5a4f3e2d",
            "name": "add",
            "arguments": '{"a": 10, "b": -4}',
            "status": "completed",
        },
    ]


def test_responses_answer_cut_by_length_is_incomplete() -> None:
    answer = openai_response(chat_variant(CHAT_TEXT, finish_reason="length"))
    assert answer["status"] == "incomplete"
    assert answer["incomplete_details"] == {"reason": "max_output_tokens"}
    assert Responses().finish_reason("length", None) == "max_output_tokens"
    assert Responses().finish_reason("tool_calls", None) == "completed"


def test_responses_answer_cut_by_length_marks_the_cut_message_incomplete() -> None:
    answer = openai_response(chat_variant(CHAT_TEXT, finish_reason="length"))
    [message] = answer["output"]
    assert message["status"] == "incomplete"


def test_responses_answer_logprobs_when_included() -> None:
    body = responses_body(include=["message.output_text.logprobs"], top_logprobs=2)
    answer = openai_response(CHAT_TEXT, body)
    logprobs = answer["output"][0]["content"][0]["logprobs"]
    assert [entry["token"] for entry in logprobs] == ["The", " sum", " is", " ", "5", ".", ""]
    assert logprobs[0] == {
        "token": "The",
        "logprob": -0.0123,
        "bytes": [84, 104, 101],
        "top_logprobs": [
            {"token": "The", "logprob": -0.0123, "bytes": [84, 104, 101]},
            {"token": "So", "logprob": -4.51, "bytes": [83, 111]},
        ],
    }


def test_responses_answer_logprobs_empty_when_not_included() -> None:
    answer = openai_response(CHAT_TEXT, responses_body(include=[]))
    assert answer["output"][0]["content"][0]["logprobs"] == []


def test_responses_usage_has_every_field_the_openai_sdk_requires() -> None:
    answer = Responses().answer(CHAT_TEXT, responses_body(), REQUEST_ID)
    assert Response.model_validate(answer).usage is not None
    stream = Responses().stream(responses_body(stream=True), REQUEST_ID)
    raw = b"".join(stream.chunk(chunk) for chunk in STREAM_CHUNKS) + stream.end()
    (name, completed) = sse(raw)[-1]
    assert name == "response.completed"
    assert Response.model_validate(completed["response"]).usage is not None


def test_responses_answer_empty_is_one_empty_message() -> None:
    answer = openai_response(chat_variant(CHAT_TEXT, message={"content": ""}))
    assert [item["type"] for item in answer["output"]] == ["message"]
    assert answer["output"][0]["content"][0]["text"] == ""


# -- OpenAI Responses: the stream ---------------------------------------------------------------


def test_responses_stream_text_then_a_function_call_follows_the_event_grammar() -> None:
    body = responses_body(tools=[FUNCTION_TOOL], stream=True)
    events = responses_stream(STREAM_CHUNKS, body)
    names = [name for name, _ in events]
    assert collapsed(names) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))

    created = events[0][1]["response"]
    assert created["status"] == "in_progress"
    assert created["output"] == []

    text = "".join(data["delta"] for name, data in events if name == "response.output_text.delta")
    assert text == STREAM_TEXT
    [text_done] = [data for name, data in events if name == "response.output_text.done"]
    assert text_done["text"] == STREAM_TEXT

    added = [data for name, data in events if name == "response.output_item.added"]
    assert [data["output_index"] for data in added] == [0, 1]
    assert added[1]["item"]["call_id"] == STREAM_CALL_ID
    assert added[1]["item"]["name"] == "add"

    arguments = [data for name, data in events if name == "response.function_call_arguments.delta"]
    assert "".join(data["delta"] for data in arguments) == STREAM_ARGUMENTS
    assert {data["item_id"] for data in arguments} == {f"fc_{REQUEST_ID}_0"}
    [arguments_done] = [
        data for name, data in events if name == "response.function_call_arguments.done"
    ]
    assert arguments_done["arguments"] == STREAM_ARGUMENTS

    completed = events[-1][1]["response"]
    assert completed["status"] == "completed"
    unstreamed = Responses().answer(CHAT_STREAMED_AS_ONE, body, REQUEST_ID)
    assert completed["output"] == unstreamed["output"]
    assert completed["usage"] == unstreamed["usage"]
    done_items = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert done_items == completed["output"]


def test_responses_stream_text_deltas_carry_their_logprobs_when_included() -> None:
    body = responses_body(include=["message.output_text.logprobs"], stream=True)
    events = responses_stream(STREAM_CHUNKS, body)
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert [[lp["token"] for lp in data["logprobs"]] for data in deltas] == [
        ["Let"],
        [" me"],
        [" add", " them."],
    ]


def test_responses_stream_with_no_content_is_one_empty_message() -> None:
    body = responses_body(stream=True)
    events = responses_stream(EMPTY_STREAM, body)
    completed = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    assert (
        completed["output"]
        == openai_response(chat_variant(CHAT_TEXT, message={"content": ""}))["output"]
    )
    assert completed["usage"]["input_tokens"] == 5
    assert completed["usage"]["output_tokens"] == 1


def test_responses_stream_error_is_response_failed_with_the_message() -> None:
    stream = Responses().stream(responses_body(stream=True), REQUEST_ID)
    started = sse(stream.chunk(STREAM_CHUNKS[0]))
    [(name, data)] = sse(stream.error(EngineFailed("the engine closed the stream")))
    assert name == "response.failed"
    assert data["sequence_number"] == len(started)
    assert data["response"]["status"] == "failed"
    assert data["response"]["error"]["message"] == "the engine closed the stream"
    assert data["response"]["output"] == []


# -- round trips: the reply sent back is the engine's message ------------------------------------


def test_responses_round_trip_of_text_and_function_calls_is_the_same_reply() -> None:
    chat = chat_variant(CHAT_CALLS, message={"content": "Adding.", "reasoning": "two sums"})
    response = validated_response(Responses().answer(chat, responses_body(), REQUEST_ID))
    returned = [item.model_dump(exclude_none=True) for item in response.output]
    outputs = [
        {"type": "function_call_output", "call_id": item["call_id"], "output": "5"}
        for item in returned
        if item["type"] == "function_call"
    ]
    body = responses_body(input=[{"role": "user", "content": "2+3 and 10-4?"}, *returned, *outputs])
    sent = Responses().to_chat(body)["messages"][1]
    assert same_reply(sent, chat["choices"][0]["message"])


def test_responses_round_trip_of_function_calls_only_is_the_same_reply() -> None:
    response = validated_response(Responses().answer(CHAT_CALLS, responses_body(), REQUEST_ID))
    returned = [item.model_dump(exclude_none=True) for item in response.output]
    body = responses_body(
        input=[
            {"role": "user", "content": "2+3 and 10-4?"},
            *returned,
            {"type": "function_call_output", "call_id": returned[0]["call_id"], "output": "5"},
            {"type": "function_call_output", "call_id": returned[1]["call_id"], "output": "6"},
        ]
    )
    messages = Responses().to_chat(body)["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert same_reply(messages[1], CHAT_CALLS["choices"][0]["message"])


def test_responses_round_trip_of_text_is_the_same_reply() -> None:
    response = validated_response(Responses().answer(CHAT_TEXT, responses_body(), REQUEST_ID))
    returned = [item.model_dump(exclude_none=True) for item in response.output]
    body = responses_body(input=[{"role": "user", "content": "2+3?"}, *returned])
    sent = Responses().to_chat(body)["messages"][1]
    assert same_reply(sent, CHAT_TEXT["choices"][0]["message"])
