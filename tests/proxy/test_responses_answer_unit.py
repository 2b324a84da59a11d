"""What goes back to an agent of the OpenAI Responses API (`proxy.apis.responses`, no I/O).

vLLM's answer becomes a Response and its stream the API's events, each checked with the `openai`
SDK's own types; the output items an agent sends back are read as the engine's own message, so
the next turn continues it. The request is `test_responses_unit.py`'s."""

from __future__ import annotations

from openai.types.responses import Response

from tests.proxy.apis_wire import (
    CHAT_CALLS,
    CHAT_STREAMED_AS_ONE,
    CHAT_TEXT,
    EMPTY_STREAM,
    FUNCTION_TOOL,
    REQUEST_ID,
    STREAM_ARGUMENTS,
    STREAM_CALL_ID,
    STREAM_CHUNKS,
    STREAM_TEXT,
    chat_variant,
    collapsed,
    openai_response,
    responses_body,
    responses_stream,
    sse,
    validated_response,
)
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import EngineFailed

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
    # An entry is vLLM's, as it came: its token, logprob, bytes and top alternatives.
    assert logprobs[0] == CHAT_TEXT["choices"][0]["logprobs"]["content"][0]
    assert [alt["token"] for alt in logprobs[0]["top_logprobs"]] == ["The", "So"]


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
