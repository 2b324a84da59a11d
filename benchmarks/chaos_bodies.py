"""Hypothesis strategies for the chaos fuzz's model-call bodies: chat completions, Messages and
Responses, mostly of their own shape (benchmarks/chaos_fuzz.py sends them).
"""

from __future__ import annotations

import json
from typing import Any


def weighted(*choices: tuple[Any, int]) -> Any:
    """One of the strategies, each as often as its weight says."""
    from hypothesis import strategies as st

    return st.sampled_from([s for s, w in choices for _ in range(w)]).flatmap(lambda s: s)


def model_call_bodies(api: str) -> Any:
    """Bodies for one model-call API: mostly its own shape, each field of the right type nine
    times in ten and anything at all the tenth; sometimes any JSON, sometimes bytes that are not
    JSON. A body of the right shape gets through to the engine often enough (a fifth to a third
    of them) to exercise the translation, the recording and the streaming."""
    from hypothesis import strategies as st

    anything = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                    max_size=4),
        max_leaves=10,
    )  # fmt: skip

    def maybe(strategy: Any) -> Any:
        return weighted((strategy, 9), (anything, 1))

    text = st.text(max_size=40)
    tokens = st.integers(min_value=1, max_value=40)
    common = {
        "model": maybe(text),
        "stream": maybe(st.booleans()),
        "temperature": maybe(st.floats(min_value=0, max_value=2)),
        "metadata": anything,
    }
    if api == "chat":
        call = st.fixed_dictionaries({
            "id": text, "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": text, "arguments": maybe(text)}),
        })  # fmt: skip
        part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
        message = st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "developer"]))},
            optional={
                "content": maybe(st.one_of(st.none(), text, st.lists(part, max_size=3))),
                "tool_calls": maybe(st.lists(call, max_size=2)),
                "tool_call_id": text,
                "name": text,
            },
        )
        tool = st.fixed_dictionaries({
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": text}, optional={"parameters": anything}),
        })  # fmt: skip
        body = st.fixed_dictionaries(
            {"messages": maybe(st.lists(message, min_size=1, max_size=4))},
            optional={
                **common,
                "max_tokens": maybe(tokens), "n": maybe(st.integers(1, 3)),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
                "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
                "logprobs": maybe(st.booleans()), "top_logprobs": maybe(st.integers(0, 25)),
                "stop": maybe(st.lists(text, max_size=2)), "seed": maybe(st.integers()),
                "return_token_ids": maybe(st.booleans()), "response_format": anything,
            },
        )  # fmt: skip
    elif api == "messages":
        text_block = st.fixed_dictionaries({"type": st.just("text"), "text": maybe(text)})
        block = weighted(
            (text_block, 6),
            (st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                                    "input": anything}), 1),
            (st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                                   optional={"content": maybe(text), "is_error": st.booleans()}),
             1),
            (st.fixed_dictionaries(
                {"type": st.sampled_from(["image", "document", "thinking", "server_tool_use"])},
                optional={"source": anything, "thinking": text}), 1),
            (anything, 1),
        )  # fmt: skip
        message = st.fixed_dictionaries({
            "role": maybe(st.sampled_from(["user", "assistant"])),
            "content": maybe(weighted((text, 2), (st.lists(block, max_size=3), 1))),
        })  # fmt: skip
        tool = st.fixed_dictionaries(
            {"name": text}, optional={"description": text, "input_schema": anything, "type": text}
        )
        body = st.fixed_dictionaries(
            {"messages": maybe(st.lists(message, min_size=1, max_size=4)),
             "max_tokens": maybe(tokens)},
            optional={
                **common,
                "system": maybe(st.one_of(text, st.lists(text_block, max_size=2))),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.fixed_dictionaries(
                    {"type": st.sampled_from(["auto", "any", "tool", "none"])},
                    optional={"name": text})),
                "stop_sequences": maybe(st.lists(text, max_size=2)),
                "thinking": anything, "top_k": maybe(tokens),
            },
        )  # fmt: skip
    else:
        part = st.fixed_dictionaries({
            "type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": text,
        })  # fmt: skip
        message = st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["user", "assistant", "system", "developer"])),
             "content": maybe(weighted((text, 2), (st.lists(part, max_size=3), 1)))},
            optional={"type": st.just("message")},
        )  # fmt: skip
        item = weighted(
            (message, 6),
            (st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text,
                                    "name": text, "arguments": maybe(text)}), 1),
            (st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                                    "output": maybe(text)}), 1),
            (st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call"])},
                                   optional={"summary": anything}), 1),
            (anything, 1),
        )  # fmt: skip
        tool = st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "function", "web_search"]), "name": text},
            optional={"parameters": anything, "strict": st.booleans()},
        )
        body = st.fixed_dictionaries(
            {"input": maybe(weighted((text, 1), (st.lists(item, min_size=1, max_size=4), 2)))},
            optional={
                **common,
                "instructions": maybe(text), "max_output_tokens": maybe(tokens),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
                "previous_response_id": maybe(st.none()), "store": maybe(st.booleans()),
                "text": anything, "reasoning": anything,
            },
        )  # fmt: skip
    return weighted(
        (body.map(lambda b: json.dumps(b).encode()), 8),
        (anything.map(lambda b: json.dumps(b).encode()), 1),
        (st.binary(max_size=40), 1),
    )
