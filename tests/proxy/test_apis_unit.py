"""The Anthropic Messages and OpenAI Responses translations (`proxy.apis`), on realistic wire
examples: requests as the official SDKs send them, answers and streams as vLLM sends them, and
what goes back to the agent validated with the SDKs' own types (no I/O)."""

from __future__ import annotations

import copy
import json
from typing import Any, get_args

import anthropic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from trajstore.proxy.apis import TRANSLATIONS
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.apis.responses import Responses
from trajstore.proxy.continuation import same_reply
from trajstore.proxy.errors import BadRequest, EngineFailed, Overloaded

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


def test_both_apis_are_registered() -> None:
    assert isinstance(TRANSLATIONS["messages"], Messages)
    assert isinstance(TRANSLATIONS["responses"], Responses)


# -- Anthropic Messages: the request ------------------------------------------------------------


def messages_body(**fields: Any) -> dict[str, Any]:
    """A request as `anthropic.Anthropic().messages.create(...)` sends it."""
    body: dict[str, Any] = {
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "model": MODEL,
    }
    body.update(fields)
    return body


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


def test_messages_image_block_is_a_400_naming_images() -> None:
    content = [IMAGE_BLOCK, {"type": "text", "text": "What is in this picture?"}]
    error = bad_request(Messages(), messages_body(messages=[{"role": "user", "content": content}]))
    assert "image" in error.message
    assert error.param == "messages.0.content"


def test_messages_image_inside_a_tool_result_is_a_400() -> None:
    result = {
        "type": "tool_result",
        "tool_use_id": "toolu_1",
        "content": [{"type": "text", "text": "the screenshot:"}, IMAGE_BLOCK],
    }
    error = bad_request(Messages(), messages_body(messages=[{"role": "user", "content": [result]}]))
    assert "image" in error.message


def test_messages_missing_max_tokens_is_a_400_naming_max_tokens() -> None:
    body = messages_body()
    del body["max_tokens"]
    error = bad_request(Messages(), body)
    assert "max_tokens" in error.message
    assert error.param == "max_tokens"


def test_messages_server_tool_is_a_400() -> None:
    tools = [
        {"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    ]
    error = bad_request(Messages(), messages_body(tools=tools))
    assert "web_search_20250305" in error.message
    assert error.param == "tools.1"


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


def anthropic_stream(chunks: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    stream = Messages().stream(messages_body(stream=True), REQUEST_ID)
    pieces = [stream.chunk(chunk) for chunk in chunks] + [stream.end()]
    for piece in pieces:
        assert piece == b"" or piece.endswith(b"\n\n")
    events = sse(b"".join(pieces))
    for _, data in events:
        ANTHROPIC_EVENT.validate_python(data)
    return events


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


# -- OpenAI Responses: the request --------------------------------------------------------------


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


def test_responses_input_image_is_a_400() -> None:
    item = {
        "role": "user",
        "content": [
            {"type": "input_text", "text": "What is this?"},
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
        ],
    }
    error = bad_request(Responses(), responses_body(input=[item]))
    assert "image" in error.message
    assert error.param == "input.0.content"


def test_responses_previous_response_id_is_a_400_asking_for_the_whole_input() -> None:
    error = bad_request(Responses(), responses_body(previous_response_id="resp_abc123"))
    assert "input" in error.message
    assert error.param == "previous_response_id"


def test_responses_item_reference_is_a_400() -> None:
    items = [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_abc"}]
    error = bad_request(Responses(), responses_body(input=items))
    assert error.param == "input.1"


def test_responses_hosted_tool_is_a_400() -> None:
    error = bad_request(Responses(), responses_body(tools=[FUNCTION_TOOL, {"type": "web_search"}]))
    assert "web_search" in error.message
    assert error.param == "tools.1"


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


def openai_response(chat: dict[str, Any], body: dict[str, Any] | None = None) -> dict[str, Any]:
    answer = Responses().answer(chat, body or responses_body(), REQUEST_ID)
    validated_response(answer)
    return answer


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
