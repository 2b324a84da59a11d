"""The event contract, part two: one model request's events, in the stream `request-<id>`.

The recorder (`proxy.recorder`) writes them in this order: `request_received`, the
`image_recorded` of each image new to the session, `prompt_tokens`, `completion_chunk`s, then
`completion_finished` or `request_failed` (the reaper writes the latter for a request whose
replica was lost). The prose of what the fields mean, and how references between turns work, is
in `store.sessions`; each class here is the one payload of its type (`store.payloads`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trajstore.store.payloads import (
    VERSION_KEY,
    Payload,
    VersionSpan,
    dump,
    load,
    payload_type,
    upcaster,
)


class Part(BaseModel):
    """A part of a payload: frozen, unknown fields kept, like `Payload`."""

    model_config = ConfigDict(frozen=True, extra="allow")


class MessagesPrefix(Part):
    """The request's whole messages are `request_id`'s whole messages (exactly `n_messages`
    of them) followed by its own `body.messages`."""

    request_id: str
    n_messages: int


class PromptPrefix(Part):
    """The prompt's first `n_tokens` ids are `request_id`'s prompt followed by its completion
    (choice 0), as recorded; the event's token ids are the rest."""

    request_id: str
    n_tokens: int


class Continuation(Part):
    """How a chat prompt reached the engine (`proxy.continuation`). Continued: the turn and
    choice it continued, where text rendering would have drifted, whether it was audited.
    Rendered after looking like a continuation: why (`fallback`)."""

    request_id: str | None = None  #: None in logs from before per-lineage continuation
    choice: int | None = None
    drift_at: int | None = None  #: first position the text rendering would differ; None: none
    audit: bool | None = None  #: the whole conversation was rendered to measure `drift_at`
    fallback: str | None = None


@payload_type
class RequestReceived(Payload):
    """`request_received`: a model request as the agent sent it, before it is forwarded."""

    event_type = "request_received"

    request_id: str
    api: str = "chat"  #: chat | completions | messages | responses
    body: dict[str, Any] = Field(default_factory=dict)  #: as sent, messages after the prefix
    sampling: dict[str, Any] = Field(default_factory=dict)
    engine: str | None = None
    #: The engine's policy version when the request was sent, as text ("0", "12").
    policy_version: str | None = None
    logprobs_mode: str | None = None
    stream: bool = False
    asked: dict[str, Any] | None = None  #: {token_ids, logprobs, usage} the agent asked for
    received_at: float | None = None  #: the proxy's clock (epoch seconds)
    replica: str | None = None  #: the proxy replica serving it (`proxy.reaper`)
    messages_prefix: MessagesPrefix | None = None
    n_images: int = 0  #: image parts in its whole messages
    image_token_id: int | None = None  #: the engine's image placeholder id
    images: list[str] | None = None  #: a translated API's image hashes, in prompt order
    dropped_tools: list[dict[str, Any]] | None = None  #: tools the engine did not get
    nul_replaced: bool | None = None  #: U+0000 in its text was stored as U+FFFD

    @field_validator("policy_version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        # Versions are step numbers a trainer may send as integers; the log keeps text.
        return str(value) if isinstance(value, int | float) else value

    @field_validator("n_images", mode="before")
    @classmethod
    def _no_images(cls, value: Any) -> Any:
        return 0 if value is None else value


@payload_type
class ImageRecorded(Payload):
    """`image_recorded`: an image a request brings into its session, once per session (the
    bodies refer to it by hash, `store.images`)."""

    event_type = "image_recorded"

    sha256: str  #: of a data URL's decoded bytes, or of an http URL's text
    source: str  #: data | url
    media_type: str | None = None
    n_bytes: int | None = None
    data: str | None = None  #: base64, for source data
    url: str | None = None  #: for source url

    def described(self) -> dict[str, Any]:
        """What a session record keeps of it: {source, media_type, n_bytes, url}, no bytes."""
        return {"source": self.source, "media_type": self.media_type, "n_bytes": self.n_bytes,
                "url": self.url}  # fmt: skip

    def without_data(self) -> dict[str, Any]:
        """The payload as stored, less its bytes (what a timeline shows)."""
        return {k: v for k, v in dump(self).items() if k != "data"}


@payload_type
class PromptTokens(Payload):
    """`prompt_tokens`: the prompt the engine saw (the event's token ids: all of it, or the ids
    after `prefix`).

    Version 2 names the continued turn and says whether it was audited (`Continuation`);
    version 1 left both to be inferred, which its upcaster does.
    """

    event_type = "prompt_tokens"
    schema_version = 2

    choice: int | None = None  #: always None: a prompt belongs to every choice
    prefix: PromptPrefix | None = None
    n_tokens: int | None = None  #: the whole prompt's length, with a prefix
    prompt_source: str | None = None  #: chat: continued | rendered
    continuation: Continuation | None = None
    nul_replaced: bool | None = None


@upcaster("prompt_tokens", 1)
def _continued_turn_and_audit(raw: dict[str, Any]) -> dict[str, Any]:
    """A continued prompt of version 1 names the turn it continued by its `prefix` alone, and
    was audited where it holds `drift_at` (the releases before per-lineage continuation
    audited every turn and always wrote it; those after wrote it only on audited turns)."""
    continuation = raw.get("continuation")
    if raw.get("prompt_source") == "continued" and isinstance(continuation, dict):
        prefix = raw.get("prefix")
        continued = prefix.get("request_id") if isinstance(prefix, dict) else None
        raw["continuation"] = {
            "request_id": continued,
            **continuation,
            "audit": "drift_at" in continuation,
        }
    return raw


@payload_type
class CompletionChunk(Payload):
    """`completion_chunk`: several generated tokens of one choice (the event's token ids and
    logprobs) and their text."""

    event_type = "completion_chunk"

    choice: int = 0
    text: str = ""
    nul_replaced: bool | None = None

    @field_validator("choice", mode="before")
    @classmethod
    def _first_when_null(cls, value: Any) -> Any:
        return 0 if value is None else value

    @field_validator("text", mode="before")
    @classmethod
    def _empty_when_null(cls, value: Any) -> Any:
        return "" if value is None else value

    @staticmethod
    def stored(choice: int, text: str) -> dict[str, Any]:
        """What `dump(CompletionChunk(choice=choice, text=text))` stores, as a literal: the
        recorder writes one per 16 tokens, where even `payloads.stored` costs it a microsecond
        (a test checks the two agree)."""
        return {"choice": choice, "text": text}

    @staticmethod
    def fields(raw: Mapping[str, Any]) -> tuple[int, str]:
        """(choice, text) of a stored chunk, read as `load` reads them without building a
        model: the projector folds one chunk per 16 tokens, where validation would cost about
        ten times the JSON parse (1.8 us against 0.2 us, measured here)."""
        if VERSION_KEY in raw:  # a newer shape: the full reading
            chunk = load("completion_chunk", raw)
            assert isinstance(chunk, CompletionChunk)
            return chunk.choice, chunk.text
        return int(raw.get("choice") or 0), raw.get("text") or ""


class FinishedChoice(Part):
    """How one choice of a completed request ended."""

    index: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None  #: the stop string or token id that ended it
    message: dict[str, Any] | None = None  #: the chat message the engine answered
    n_tokens: int | None = None
    #: The finish reason in the agent's API, when translated to chat (`proxy.apis`).
    api_finish_reason: str | None = None
    #: Which policy version generated which of its tokens, in order (written since the
    #: weight switch without a drain; None for older turns, whose one version is their
    #: request's `policy_version`).
    version_spans: list[VersionSpan] | None = None


@payload_type
class CompletionFinished(Payload):
    """`completion_finished`: the request completed; every chunk was written before it."""

    event_type = "completion_finished"

    choices: list[FinishedChoice] = Field(default_factory=list)
    usage: dict[str, Any] | None = None
    latency_s: float | None = None
    ttft_s: float | None = None  #: None when no token came
    nul_replaced: bool | None = None


@payload_type
class RequestFailed(Payload):
    """`request_failed`: the request ended without completing; the chunks already written stay
    (a failed or aborted request keeps its partial tokens)."""

    event_type = "request_failed"

    reason: str | None = None  #: engine_error | client_disconnected | replica_lost | ...
    status: int | None = None  #: the HTTP status the agent got
    message: str | None = None
    latency_s: float | None = None
    partial_tokens: dict[str, int] | None = None  #: tokens recorded, by choice
    #: choice -> which policy version generated its partial tokens (see `FinishedChoice`).
    version_spans: dict[str, list[VersionSpan]] | None = None
    nul_replaced: bool | None = None
