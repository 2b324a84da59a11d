"""The OpenAI wire format as the proxy handles it: check, ask for more, give back what was asked.

Bodies stay plain dicts end to end: fields the proxy does not know pass through untouched in both
directions (a proxy must not drop what a newer client or engine sends). The proxy always asks the
engine for what training needs (vLLM: `return_token_ids`, `logprobs`) and removes from the answer
what the agent did not ask for itself, so the agent sees the shape it would have seen directly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import orjson

from trajstore.proxy.errors import BadRequest

#: The agent APIs: OpenAI chat and completions, and two served over the engine's chat
#: completions by translation (`proxy.apis`): Anthropic Messages and OpenAI Responses.
Api = Literal["chat", "completions", "messages", "responses"]

ENGINE_PATHS: dict[str, str] = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/chat/completions",
    "responses": "/v1/chat/completions",
}

#: The request fields that shape sampling, recorded with every turn for the trainer.
SAMPLING_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens",
    "n", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "allowed_token_ids", "logprobs", "top_logprobs",
    "response_format", "tool_choice", "ignore_eos", "min_tokens", "skip_special_tokens",
)  # fmt: skip


@dataclass(frozen=True)
class Asked:
    """Which of the fields the proxy adds the agent asked for itself."""

    token_ids: bool
    logprobs: bool
    usage: bool

    def as_json(self) -> dict[str, bool]:
        """A JSON-able view, recorded with the request."""
        return {"token_ids": self.token_ids, "logprobs": self.logprobs, "usage": self.usage}


def parse_body(api: Api, raw: bytes) -> dict[str, Any]:
    """The request body as a dict, or `BadRequest` saying what is wrong with it."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if not isinstance(body.get("stream", False), bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    if api in ("messages", "responses"):
        return body  # checked as it is translated (proxy.apis)
    if api == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("each message must be an object with a 'role'", param="messages")
    else:
        prompt = body.get("prompt")
        one_text = isinstance(prompt, str)
        one_ids = isinstance(prompt, list) and all(type(t) is int for t in prompt) and prompt
        if not (one_text or one_ids):
            raise BadRequest(
                "'prompt' must be one string or one list of token ids "
                "(send batched prompts as separate requests)",
                param="prompt",
            )
    n = body.get("n", 1)
    if type(n) is not int or n < 1:
        raise BadRequest("'n' must be a positive integer", param="n")
    return body


def asked_for(api: Api, body: dict[str, Any]) -> Asked:
    """What the agent asked for itself, before the proxy adds its own asks."""
    logprobs = body.get("logprobs")
    options = body.get("stream_options")
    return Asked(
        token_ids=body.get("return_token_ids") is True,
        logprobs=bool(logprobs) if api == "chat" else logprobs is not None,
        usage=isinstance(options, dict) and bool(options.get("include_usage")),
    )


def engine_body(
    api: Api, body: dict[str, Any], prompt_token_ids: Sequence[int] | np.ndarray | None = None
) -> dict[str, Any]:
    """The body sent to the engine: the agent's, plus token ids, logprobs and (streaming) usage;
    and the prompt as ids when the proxy continued it (`proxy.continuation`). vLLM takes a
    pre-tokenised chat prompt through `kv_transfer_params` and still parses the answer as chat."""
    out = dict(body)
    if prompt_token_ids is not None:
        transfer = out.get("kv_transfer_params")
        out["kv_transfer_params"] = {
            **(transfer if isinstance(transfer, dict) else {}),
            "prompt_token_ids": prompt_token_ids,
        }
    out["return_token_ids"] = True
    if api == "chat":
        out["logprobs"] = True
    elif out.get("logprobs") is None:
        out["logprobs"] = 0  # the sampled token's logprob only
    if out.get("stream"):
        options = dict(out.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    return out


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling-relevant fields of a request, for the record."""
    return {k: body[k] for k in SAMPLING_FIELDS if k in body}


def strip(data: dict[str, Any], asked: Asked, *, streaming: bool) -> dict[str, Any]:
    """Give an answer (or a stream chunk) the shape it has when the agent asks directly.

    In place. vLLM answers `null` for token-id fields it was not asked for, and leaves them out
    of stream chunks; logprobs not asked for are `null` in both.
    """
    if not asked.token_ids:
        _blank(data, "prompt_token_ids", streaming)
    for choice in data.get("choices") or ():
        if not asked.token_ids:
            _blank(choice, "token_ids", streaming)
            _blank(choice, "prompt_token_ids", streaming)
        if not asked.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return data


def _blank(data: dict[str, Any], key: str, streaming: bool) -> None:
    if key not in data:
        return
    if streaming:
        del data[key]
    else:
        data[key] = None


@dataclass(slots=True)
class ChoiceTokens:
    """What one choice of an answer (or of a stream chunk) carries for the record."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    message: dict[str, Any] | None = None  # non-streaming chat: the whole message
    delta: dict[str, Any] | None = None  # streaming chat: this chunk's delta
    #: The engine's routed experts as it sent them (vLLM: base64 `.npy`), decoded when recorded.
    routed_experts: str | None = None


@dataclass(slots=True)
class Extracted:
    """The recordable content of an answer or a stream chunk."""

    prompt_token_ids: list[int] | None = None
    choices: list[ChoiceTokens] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    model: str | None = None  #: the model the engine names in its answer


def _logprobs_of(api: Api, choice: dict[str, Any], n_tokens: int) -> list[float] | None:
    block = choice.get("logprobs")
    if not isinstance(block, dict):
        return None
    if api == "completions":
        values = list(block.get("token_logprobs") or ())
    else:
        values = [entry.get("logprob") for entry in block.get("content") or ()]
    if len(values) != n_tokens:
        return None  # the record keeps the ids; a mismatch is never papered over
    if None in values:  # vLLM's null for a token of probability 0
        return [-math.inf if v is None else v for v in values]
    return values


def extract(api: Api, data: dict[str, Any]) -> Extracted:
    """Token ids, logprobs, text and outcome of each choice in an answer or a stream chunk.

    Runs for every chunk of every stream, so each choice is built once, with nothing to spare.
    """
    prompt = data.get("prompt_token_ids")
    choices = []
    for choice in data.get("choices") or ():
        if prompt is None and choice.get("prompt_token_ids") is not None:
            prompt = choice["prompt_token_ids"]  # completions: per choice
        ids = choice.get("token_ids") or []
        message = delta = None
        if api == "completions":
            text = choice.get("text") or ""
        elif "message" in choice:
            message = choice["message"]
            text = (message or {}).get("content") or ""
        else:
            delta = choice.get("delta") or {}
            text = delta.get("content") or ""
        choices.append(
            ChoiceTokens(
                int(choice.get("index") or 0),
                ids,
                _logprobs_of(api, choice, len(ids)),
                text,
                choice.get("finish_reason"),
                choice.get("stop_reason"),
                message,
                delta,
                choice.get("routed_experts"),
            )
        )
    return Extracted(prompt, choices, data.get("usage"), data.get("model"))


def extract_stream(api: Api, chunks: list[dict[str, Any]]) -> Extracted:
    """What a run of stream chunks carries (those of one read), merged per choice.

    Recording the merge is recording each chunk in turn: the same ids, logprobs, text and
    delta, in order, at one `record()` per read instead of one per event. A chunk whose tokens
    came without their logprobs leaves the merged choice without logprobs (`None`), as it
    leaves the recorded chunk without them.
    """
    merged = Extracted()
    runs: dict[int, _Run] = {}
    for data in chunks:
        usage = data.get("usage")
        if usage:
            merged.usage = usage
        prompt = data.get("prompt_token_ids")
        if prompt is not None and merged.prompt_token_ids is None:
            merged.prompt_token_ids = prompt
        if merged.model is None:
            merged.model = data.get("model")
        for choice in data.get("choices") or ():
            if merged.prompt_token_ids is None and choice.get("prompt_token_ids") is not None:
                merged.prompt_token_ids = choice["prompt_token_ids"]  # completions: per choice
            index = int(choice.get("index") or 0)
            run = runs.get(index)
            if run is None:
                run = runs[index] = _Run(api != "completions")
            run.take(api, choice)
    merged.choices = [run.tokens(index) for index, run in runs.items()]
    return merged


class _Run:
    """One choice's chunks of a read, merged (`extract_stream`)."""

    __slots__ = (
        "calls", "finish_reason", "ids", "logprobs", "role", "routed", "stop_reason", "texts",
    )  # fmt: skip

    def __init__(self, chat: bool) -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] | None = []
        self.texts: list[str] = []
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.role: str | None = None
        self.calls: list[Any] | None = [] if chat else None  # None: completions (no delta)
        self.routed: str | None = None

    def take(self, api: Api, choice: dict[str, Any]) -> None:
        ids = choice.get("token_ids")
        if ids:
            self.ids += ids
            if self.logprobs is not None:
                values = _logprobs_of(api, choice, len(ids))
                if values is None:
                    self.logprobs = None  # tokens without their logprobs: none for the run
                else:
                    self.logprobs += values
        if self.calls is None:
            self.texts.append(choice.get("text") or "")
        else:
            delta = choice.get("delta")
            if delta:
                self.texts.append(delta.get("content") or "")
                self.role = delta.get("role") or self.role
                calls = delta.get("tool_calls")
                if calls:
                    self.calls += calls
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.stop_reason = choice.get("stop_reason") or self.stop_reason
        self.routed = choice.get("routed_experts") or self.routed

    def tokens(self, index: int) -> ChoiceTokens:
        text = "".join(self.texts)
        delta = None
        if self.calls is not None:
            delta = {"role": self.role, "content": text, "tool_calls": self.calls}
        return ChoiceTokens(
            index, self.ids, self.logprobs, text, self.finish_reason, self.stop_reason, None,
            delta, self.routed,
        )  # fmt: skip
