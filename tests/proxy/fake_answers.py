"""The fake engine's answers (`fake_engine.FakeEngine`) in vLLM 0.32's wire shapes: a whole chat
or completions answer, or its stream, as the captures in docs/engine-vllm-cpu.md show them (key
order included; the completions stream was not captured, so it follows vLLM's serving code), with
tool calls as vLLM's hermes parser gives them and routed experts as with
``--enable-return-routed-experts``.
"""

from __future__ import annotations

import base64
import io
import time
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from tests.proxy.fake_tokens import (
    EOS,
    chat_logprobs,
    chat_prompt_ids,
    completion_logprobs,
    completion_prompt_ids,
    content_text,
    expert_ids,
)

if TYPE_CHECKING:
    from tests.proxy.fake_engine import FakeEngine

FINGERPRINT = "vllm-0.32.0-fake"

# vLLM's fields beyond OpenAI's, null here as in the captures; a proxy must pass them through.
_MESSAGE_NULLS = dict.fromkeys(["refusal", "annotations", "audio", "function_call", "reasoning"])
_TAIL_NULLS = dict.fromkeys(["kv_transfer_params", "ec_transfer_params", "metrics"])
_USAGE_NULLS = dict.fromkeys(["prompt_tokens_details", "completion_tokens_details"])

JSON = dict[str, Any]
Payload = bytes | list[bytes]  # a whole JSON body, or the SSE lines of a stream


def _encoded(array: np.ndarray[Any, Any]) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def sse_event(obj: JSON) -> bytes:
    """One server-sent event of a stream, as vLLM writes it."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _tool_call(function: JSON, ids: list[int]) -> JSON:
    """A call of `function["name"]` with its `arguments` (an object, or its text as is), or when
    None with arguments that follow from the sampled ids (spaced as vLLM's are)."""
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {"a": ids[0] % 10, "b": ids[-1] % 10}
    if isinstance(arguments, str):
        text = arguments
    else:
        text = orjson.dumps(arguments).decode().replace('":', '": ')
    function = {"name": function.get("name"), "arguments": text}
    return {"id": f"chatcmpl-tool-{ids[0]}", "type": "function", "function": function}


def _tool_call_delta(call: JSON, j: int) -> JSON:
    """Token j's delta of a streamed call: the call's name, then its arguments in two pieces."""
    arguments = call["function"]["arguments"]
    half = len(arguments) // 2
    if j == 0:
        first = {"name": call["function"]["name"], "arguments": ""}
        return {
            "tool_calls": [{"index": 0, "id": call["id"], "type": "function", "function": first}]
        }
    if j in (1, 2):
        piece = arguments[:half] if j == 1 else arguments[half:]
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    return {}


def render(engine: FakeEngine, api: str, body: JSON) -> Payload:
    """`engine`'s answer to a request of `api` ("chat" or "completions"): JSON bytes, or the SSE
    lines of a stream; its options, `_generate` and `_function_to_call` make it."""
    chat = api == "chat"
    token_prompt = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
    if chat and token_prompt is not None and not engine.ignore_token_prompts:
        prompt = list(token_prompt)
    elif chat:
        prompt = chat_prompt_ids(
            body.get("messages") or [], rewrite_replies=engine.rewrite_replies, vision=engine.vision
        )
    else:
        prompt = completion_prompt_ids(body.get("prompt"))
    n = int(body.get("n") or 1)
    choices = [engine._generate(prompt, body, i) for i in range(n)]
    rti = bool(body.get("return_token_ids"))
    # Chat asks with logprobs=true + top_logprobs=k, completions with logprobs=k.
    if chat:
        k = int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
    else:
        k = None if body.get("logprobs") is None else max(int(body["logprobs"]), 1)

    def logprobs(ids: list[int], pos: int = 0, count: int | None = None) -> JSON | None:
        """The logprobs of ids[pos:pos+count] (all by default), or None if not asked."""
        if k is None:
            return None
        part = ids[pos:] if count is None else ids[pos : pos + count]
        if chat:
            return chat_logprobs(part, pos, k)
        return completion_logprobs(part, pos, sum(len(content_text(t)) for t in ids[:pos]), k)

    call = None
    function = engine._function_to_call(body) if chat else None
    if function is not None:
        choices = [(ids, "tool_calls") for ids, _ in choices]
        call = _tool_call(function, choices[0][0])
    stream = bool(body.get("stream"))
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
    obj = ("chat.completion" + (".chunk" if stream else "")) if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": int(time.time())}
    head["model"] = body.get("model") or engine.model_name
    p, done = len(prompt), sum(len(ids) for ids, _ in choices)
    usage = {"prompt_tokens": p, "total_tokens": p + done, "completion_tokens": done}
    prompt_ids = prompt if rti else None
    routed: list[str | None] = [None] * n
    if engine.routed_experts is not None:
        start = int(body.get("routed_experts_prompt_start") or 0)
        routed = [
            _encoded(expert_ids(prompt + ids, start, *engine.routed_experts)) for ids, _ in choices
        ]

    if not stream:
        out: list[JSON] = []
        for i, (choice_ids, finish) in enumerate(choices):
            text = "".join(map(content_text, choice_ids))
            c: JSON = {"index": i}
            if chat and call is not None:
                c["message"] = {"role": "assistant", "content": None, **_MESSAGE_NULLS}
                c["message"]["tool_calls"] = [call]
            elif chat:
                c["message"] = {"role": "assistant", "content": text, **_MESSAGE_NULLS}
            else:
                c["text"] = text
            c |= {"logprobs": logprobs(choice_ids), "finish_reason": finish}
            c |= {"stop_reason": None, "token_ids": choice_ids if rti else None}
            if not chat:
                c |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
            out.append(c | {"routed_experts": routed[i]})
        full: JSON = {**head, "choices": out, "service_tier": None}
        full |= {"system_fingerprint": FINGERPRINT, "usage": usage | _USAGE_NULLS}
        if chat:
            full |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
            full["prompt_text"] = None
        return orjson.dumps(full | _TAIL_NULLS)

    lines: list[bytes] = []
    if chat:  # one role chunk per choice, carrying the prompt ids
        for i in range(n):
            delta = {"role": "assistant", "content": ""}
            role = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
            chunk: JSON = {**head, "choices": [role]}
            if rti:
                chunk |= {"prompt_token_ids": prompt, "prompt_text": None}
            lines.append(sse_event(chunk))
    # One token per chunk, the choices interleaved, as vLLM's n=2 capture shows.
    for j in range(max(len(ids) for ids, _ in choices)):
        for i, (choice_ids, finish) in enumerate(choices):
            if j >= len(choice_ids):
                continue
            tid, last = choice_ids[j], j == len(choice_ids) - 1
            ch: JSON = {"index": i}
            if call is not None:
                ch["delta"] = _tool_call_delta(call, j)
            elif chat:  # eos shows as an empty delta that still has its token id
                ch["delta"] = {"content": content_text(tid)} if tid != EOS else {}
            else:
                ch["text"] = content_text(tid)
            ch["logprobs"] = logprobs(choice_ids, j, 1)
            ch["finish_reason"] = finish if last else None
            if last:
                ch["stop_reason"] = None
                if routed[i] is not None:
                    ch["routed_experts"] = routed[i]
            if rti:
                ch["token_ids"] = [tid]
                if not chat and j == 0:  # completions: prompt ids in each choice's first chunk
                    ch["prompt_token_ids"] = prompt
            chunk = {**head, "choices": [ch]}
            if last and not include_usage:  # captured: otherwise it is on the usage chunk
                chunk["system_fingerprint"] = FINGERPRINT
            lines.append(sse_event(chunk))
    if include_usage:
        usage_chunk = {**head, "choices": [], "usage": usage}
        lines.append(sse_event(usage_chunk | {"system_fingerprint": FINGERPRINT}))
    return [*lines, b"data: [DONE]\n\n"]
