"""A session as recorded, rebuilt from its events: what `GET /sessions/{id}` shows.

This is the contract between the recorder (which writes these events) and every reader of them.
A session's events live in two kinds of streams (see `store.events`):

`session-<id>`
    session_created    {run_id, task_id, group_id, metadata, deadline_s, created_at}
    reward_assigned    {value, components, source}
    session_finished   {status: completed|aborted|error|timeout, reason}
    session_discarded  {reason}

`request-<request_id>`, one per model call, in this order:
    request_received     {request_id, api: chat|completions, body, sampling, engine,
                          policy_version, logprobs_mode, stream, asked: {token_ids, logprobs,
                          usage}, received_at}; or, when the request's messages continue an
                          earlier turn's, also {messages_prefix: {request_id, n_messages}} and
                          body.messages = the messages after the first n_messages (see below).
                          With images in its messages: {n_images, image_token_id} (how many
                          image parts the whole messages hold; the engine's placeholder id,
                          when the proxy was told it) and each image's URL in body replaced by
                          a reference, `trajstore-image:sha256:<hex>` (`store.images`)
                          With tools the engine did not get (api messages or responses):
                          {dropped_tools: [{param, type, name?}]}, each a tool left out
                          (`tools.8`, `web_search`: hosted and server tools) or a custom
                          tool's grammar not enforced (`tools.5.format`, `grammar`); see
                          `proxy.apis`
    image_recorded       {sha256, source: data, media_type, n_bytes, data (base64)} or
                          {sha256, source: url, url}: one per image that this request brings
                          into the session (see below); right after request_received
    prompt_tokens        token_ids = the prompt the engine saw; {choice: null}; or, when the
                         prompt continues an earlier turn of the session, {choice: null,
                         prefix: {request_id, n_tokens}, n_tokens} and token_ids = the prompt
                         after its first prefix.n_tokens ids (see below). Chat prompts also say
                         how they reached the engine (`proxy.continuation`): prompt_source
                         `continued` (ids built by the proxy: {continuation: {choice,
                         drift_at}}, drift_at the first position where the text rendering
                         would have differed, null for none) or `rendered` (the engine rendered
                         the messages; {continuation: {fallback}} says why when the request
                         looked like a continuation)
    completion_chunk     token_ids + logprobs of several generated tokens; {choice, text}
    completion_finished  {choices: [{index, finish_reason, stop_reason, message, n_tokens,
                          api_finish_reason}], usage, latency_s, ttft_s}; `message` is the
                          chat message the engine answered; `api_finish_reason` only for the
                          APIs translated to chat (`proxy.apis`): the finish reason in the
                          agent's API (messages: end_turn | tool_use | max_tokens |
                          stop_sequence; responses: completed | max_output_tokens)
  or request_failed      {reason, status, message, latency_s} (chunks already recorded stay:
                          a failed or aborted request keeps its partial tokens)

`body` is the agent's request as it sent it (no headers, so no keys); `asked` says which of the
fields training needs the agent asked for itself (the proxy always asks the engine for them).

A prompt with a `prefix` is stored as a reference plus its new tokens: its first `n_tokens` ids
are the first `n_tokens` of the referenced request's prompt followed by that request's completion
(choice 0), as recorded; `n_tokens` at the top is the whole prompt's length. The referenced request
belongs to the same session and comes earlier in the log, so a reader folding the session in log
order (`rebuild_session`) always has it. Without this, a session's events grow with the square of
its turns, since every turn's prompt repeats the context before it.

The request's messages work the same way: with `messages_prefix`, the whole list is the
referenced request's whole messages (exactly `n_messages` of them) followed by `body.messages`.
An agent re-sends its whole conversation every turn, so storing each body whole made the bodies
most of an agent session's bytes. `rebuild_session`, the `turns` view and the export give whole
messages.

Images are recorded once per session the same way: a request whose messages hold an image the
proxy replica has not yet recorded for the session writes it as `image_recorded` (the sha256 is
that of a data URL's decoded bytes, or of an http URL's text); every body then refers to it by
hash. After a restart, on another replica, or after a failed turn, an image may be recorded
again: same hash, same content; readers keep one. A reference whose image the session's events
do not hold leaves the image's source unknown, never the tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from trajstore.store.events import EventType, RecordedEvent, request_stream
from trajstore.store.tokens import TokenIds, decode_logprobs, decode_token_ids


@dataclass
class ChoiceRecord:
    """One generated choice of a turn: its tokens, their logprobs, how it ended."""

    index: int
    token_ids: list[int] = field(default_factory=list)  # bytes as stored, when `packed`
    logprobs: list[float] = field(default_factory=list)  # bytes as stored, when `packed`
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    message: dict[str, Any] | None = None
    api_finish_reason: str | None = None  #: in the agent's API's taxonomy, when translated

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {
            "index": self.index,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "message": self.message,
            "api_finish_reason": self.api_finish_reason,
        }


#: vLLM's request options that constrain decoding with a grammar.
_GUIDED_OPTIONS = (
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
)  # fmt: skip


@dataclass
class TurnRecord:
    """One model request of a session, as recorded."""

    request_id: str
    api: str
    body: dict[str, Any]
    engine: str | None
    policy_version: str | None
    logprobs_mode: str | None
    stream: bool
    sampling: dict[str, Any]
    prompt_token_ids: list[int] = field(default_factory=list)  # bytes as stored, when `packed`
    choices: dict[int, ChoiceRecord] = field(default_factory=dict)
    status: str = "in_progress"  # in_progress | completed | failed
    failure: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    latency_s: float | None = None
    ttft_s: float | None = None
    first_position: int = 0
    received_at: float | None = None  # the proxy's clock when the request arrived
    messages_prefix: dict[str, Any] | None = None  # body.messages continue that request's
    prompt_source: str | None = None  # chat: continued | rendered (None: recorded before it)
    continuation: dict[str, Any] | None = None  # {choice, drift_at} or {fallback}
    n_images: int = 0  # image parts in its whole messages
    image_token_id: int | None = None  # the engine's image placeholder id, when recorded

    @property
    def constrained_by(self) -> str | None:
        """What constrained the engine's decoding (a forced tool call, a JSON format, a vLLM
        guided-decoding option), or None.

        The engine then samples from the grammar-masked distribution, and the logprobs it
        reports (vLLM: even `raw_logprobs`) are that distribution's, not the model's: measured
        on vLLM 0.32, a forced tool call's tokens came back with logprobs near 0 where the model
        gave them about -6. They are no behaviour logprobs for an importance ratio.
        """
        choice = self.body.get("tool_choice")
        if choice == "required" or isinstance(choice, dict):
            return "tool_choice"
        response_format = self.body.get("response_format")
        if isinstance(response_format, dict) and response_format.get("type") in (
            "json_object",
            "json_schema",
        ):
            return "response_format"
        for key in _GUIDED_OPTIONS:
            if self.body.get(key) is not None:
                return key
        return None

    def choice(self, index: int) -> ChoiceRecord:
        """The choice with this index, created on first use."""
        if index not in self.choices:
            self.choices[index] = ChoiceRecord(index)
        return self.choices[index]

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view: messages, tools, sampling, tokens, logprobs, outcome, timing."""
        return {
            "request_id": self.request_id,
            "api": self.api,
            "messages": self.body.get("messages"),
            "prompt": self.body.get("prompt"),
            "tools": self.body.get("tools"),
            "sampling": self.sampling,
            "stream": self.stream,
            "engine": self.engine,
            "policy_version": self.policy_version,
            "logprobs_mode": self.logprobs_mode,
            "prompt_token_ids": self.prompt_token_ids,
            "prompt_source": self.prompt_source,
            "continuation": self.continuation,
            "choices": [self.choices[i].as_json() for i in sorted(self.choices)],
            "status": self.status,
            "constrained_by": self.constrained_by,
            "failure": self.failure,
            "usage": self.usage,
            "latency_s": self.latency_s,
            "ttft_s": self.ttft_s,
        }


@dataclass
class SessionRecord:
    """A session rebuilt from its events."""

    session_id: str
    run_id: str | None = None
    task_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    deadline_s: float | None = None
    created_at: float | None = None
    recorded_created_at: datetime | None = None  # when the store recorded its creation
    recorded_finished_at: datetime | None = None  # ... and its (last) finish
    status: str = "active"  # active | completed | aborted | error | timeout
    finish_reason: str | None = None
    discarded: str | None = None  # the reason, when discarded
    rewards: list[dict[str, Any]] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    n_events: int = 0
    #: The images its requests recorded, by sha256: {source, media_type, n_bytes, url}, without
    #: the bytes (`image_recorded`; the export writes those).
    images: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def reward(self) -> float | None:
        """The last reward assigned (a later assignment corrects an earlier one)."""
        return float(self.rewards[-1]["value"]) if self.rewards else None

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view of the whole session."""
        return {
            "session_id": self.session_id,
            "run_id": self.run_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            "deadline_s": self.deadline_s,
            "created_at": self.created_at,
            "status": self.status,
            "finish_reason": self.finish_reason,
            "discarded": self.discarded,
            "reward": self.reward,
            "rewards": self.rewards,
            "turns": [t.as_json() for t in self.turns],
            "n_events": self.n_events,
            "images": self.images,
        }


def _ints(array: TokenIds | None) -> list[int]:
    return [] if array is None else np.asarray(array).tolist()


@dataclass
class _Chunks:
    """A choice's completion chunks, packed as stored, decoded once at the end."""

    choice: ChoiceRecord
    token_ids: list[bytes] = field(default_factory=list)
    logprobs: list[bytes] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def close(self, packed: bool) -> None:
        ids, logprobs = b"".join(self.token_ids), b"".join(self.logprobs)
        if packed:
            self.choice.token_ids = ids  # type: ignore[assignment]
            self.choice.logprobs = logprobs  # type: ignore[assignment]
        else:
            self.choice.token_ids += _ints(decode_token_ids(ids))
            self.choice.logprobs += np.asarray(decode_logprobs(logprobs), np.float64).tolist()
        self.choice.text += "".join(self.text)


_CHUNK = EventType.COMPLETION_CHUNK.value
_PROMPT = EventType.PROMPT_TOKENS.value
_RECEIVED = EventType.REQUEST_RECEIVED.value
_FINISHED = EventType.COMPLETION_FINISHED.value
_FAILED = EventType.REQUEST_FAILED.value
_CREATED = EventType.SESSION_CREATED.value
_REWARD = EventType.REWARD_ASSIGNED.value
_SESSION_FINISHED = EventType.SESSION_FINISHED.value
_DISCARDED = EventType.SESSION_DISCARDED.value
_IMAGE = EventType.IMAGE_RECORDED.value


def rebuild_session(
    session_id: str, events: list[RecordedEvent], *, packed: bool = False
) -> SessionRecord:
    """Fold a session's events (in log order) into a `SessionRecord`.

    The most frequent events (completion chunks) are checked first, and their arrays are
    joined as stored bytes and decoded once per choice: the projector folds every session.
    With `packed`, token ids and logprobs stay as stored (little-endian int32 and float32
    bytes) instead of lists: what `store.samples` works on, without a Python object per token.
    Turns come in the order their requests arrived (`_in_request_order`).
    """
    session = SessionRecord(session_id, n_events=len(events))
    turns: dict[str, TurnRecord] = {}
    chunks: dict[tuple[str, int], _Chunks] = {}
    prompts: dict[str, bytes] = {}  # packed, as stored: a referencing prompt's new tokens only
    references: list[tuple[str, dict[str, Any]]] = []  # (stream, prefix), in log order
    for event in events:
        kind = event.type
        stream = event.stream_id
        if kind == _CHUNK:
            if stream in turns:
                payload = event.payload
                index = int(payload.get("choice") or 0)
                pending = chunks.get((stream, index))
                if pending is None:
                    pending = chunks[stream, index] = _Chunks(turns[stream].choice(index))
                if (ids := event.packed_token_ids) is not None:
                    pending.token_ids.append(ids)
                if (logprobs := event.packed_logprobs) is not None:
                    pending.logprobs.append(logprobs)
                pending.text.append(payload.get("text") or "")
        elif kind == _PROMPT:
            if stream in turns:
                prompts[stream] = event.packed_token_ids or b""
                turns[stream].prompt_source = event.payload.get("prompt_source")
                turns[stream].continuation = event.payload.get("continuation")
                if (prefix := event.payload.get("prefix")) is not None:
                    references.append((stream, prefix))
        elif kind == _RECEIVED:
            payload = event.payload
            turn = TurnRecord(
                request_id=payload["request_id"],
                api=payload.get("api", "chat"),
                body=payload.get("body") or {},
                engine=payload.get("engine"),
                policy_version=payload.get("policy_version"),
                logprobs_mode=payload.get("logprobs_mode"),
                stream=bool(payload.get("stream")),
                sampling=payload.get("sampling") or {},
                first_position=event.position,
                received_at=payload.get("received_at"),
                messages_prefix=payload.get("messages_prefix"),
                n_images=int(payload.get("n_images") or 0),
                image_token_id=payload.get("image_token_id"),
            )
            turns[stream] = turn
            session.turns.append(turn)
        elif kind == _FINISHED:
            if stream in turns:
                payload = event.payload
                turn = turns[stream]
                turn.status = "completed"
                turn.usage = payload.get("usage")
                turn.latency_s = payload.get("latency_s")
                turn.ttft_s = payload.get("ttft_s")
                for finished in payload.get("choices") or []:
                    choice = turn.choice(int(finished.get("index") or 0))
                    choice.finish_reason = finished.get("finish_reason")
                    choice.stop_reason = finished.get("stop_reason")
                    choice.message = finished.get("message")
                    choice.api_finish_reason = finished.get("api_finish_reason")
        elif kind == _FAILED:
            if stream in turns:
                turn = turns[stream]
                turn.status = "failed"
                turn.failure = event.payload
                turn.latency_s = turn.failure.get("latency_s")
        elif kind == _CREATED:
            payload = event.payload
            session.run_id = event.run_id
            session.task_id = payload.get("task_id")
            session.group_id = payload.get("group_id")
            session.metadata = payload.get("metadata") or {}
            session.deadline_s = payload.get("deadline_s")
            session.created_at = payload.get("created_at")
            session.recorded_created_at = event.recorded_at
        elif kind == _REWARD:
            session.rewards.append(event.payload)
        elif kind == _SESSION_FINISHED:
            payload = event.payload
            session.status = payload.get("status", "completed")
            session.finish_reason = payload.get("reason")
            session.recorded_finished_at = event.recorded_at
        elif kind == _DISCARDED:
            session.discarded = event.payload.get("reason") or "discarded"
        elif kind == _IMAGE:
            payload = event.payload
            sha256 = payload.get("sha256")
            if isinstance(sha256, str) and sha256 not in session.images:
                session.images[sha256] = {
                    key: payload.get(key) for key in ("source", "media_type", "n_bytes", "url")
                }
        # else: a newer event type; a reader of today ignores what it does not know
    _in_request_order(session.turns)
    _resolve_messages(turns)
    _resolve_prefixes(references, prompts, chunks, turns)
    for stream, prompt in prompts.items():
        turns[stream].prompt_token_ids = (
            prompt if packed else _ints(decode_token_ids(prompt))  # type: ignore[assignment]
        )
    for pending in chunks.values():
        pending.close(packed)
    return session


def _in_request_order(turns: list[TurnRecord]) -> None:
    """Sort turns by when their requests arrived, where the log's order is not that.

    Each proxy replica commits through its own batched writer, so when a session's turns go to
    several replicas, turn k+1 can commit before turn k (turn k's replica was still lingering
    over its batch). The projection needs request order (turn k+1 extends turn k), which is the
    order of `received_at`; the sort is stable, so the log's order stays wherever the clocks do
    not say otherwise (one replica, or turns of an older log without the field).
    """
    if all(t.received_at is not None for t in turns):
        turns.sort(key=lambda t: t.received_at or 0.0)


def whole_messages(
    requests: Mapping[str, tuple[Any, Mapping[str, Any] | None]],
) -> dict[str, list[Any] | None]:
    """Each request's whole messages, from its stored `body.messages` and `messages_prefix`
    (keyed by request stream; `rebuild_session` and the export use it).

    None where a reference cannot be satisfied from `requests` (the referenced request is
    missing, does not have exactly `n_messages` messages, or the chain loops back): messages are
    for people, and no reader is shown a guess.
    """
    whole: dict[str, list[Any] | None] = {}

    def resolve(stream: str, seen: frozenset[str]) -> list[Any] | None:
        if stream not in whole:
            messages, prefix = requests[stream]
            if not isinstance(messages, list):
                messages = None
            elif prefix is not None:
                source = request_stream(str(prefix.get("request_id")))
                before = None
                if source in requests and source not in seen:
                    before = resolve(source, seen | {stream})
                if before is None or len(before) != prefix.get("n_messages"):
                    messages = None
                else:
                    messages = before + messages
            whole[stream] = messages
        return whole[stream]

    for stream in requests:
        resolve(stream, frozenset())
    return whole


def _resolve_messages(turns: dict[str, TurnRecord]) -> None:
    """Make every referencing turn's `body.messages` whole; where that cannot be done, None, and
    `body.messages_unresolved` says why (the turn's tokens are not affected)."""
    referencing = {s: t for s, t in turns.items() if t.messages_prefix is not None}
    if not referencing:
        return
    whole = whole_messages(
        {s: (t.body.get("messages"), t.messages_prefix) for s, t in turns.items()}
    )
    for stream, turn in referencing.items():
        turn.body = {**turn.body, "messages": whole[stream]}
        if whole[stream] is None:
            prefix = turn.messages_prefix or {}
            turn.body["messages_unresolved"] = (
                f"its messages continue the {prefix.get('n_messages')} of request "
                f"{prefix.get('request_id')!r}, which this session's events do not hold"
            )


def _resolve_prefixes(
    references: list[tuple[str, dict[str, Any]]],
    prompts: dict[str, bytes],
    chunks: dict[tuple[str, int], _Chunks],
    turns: dict[str, TurnRecord],
) -> None:
    """Make every referencing prompt whole: the referenced turn's prompt and completion, cut to
    the shared length, then the stored new tokens.

    A referenced prompt is made whole first when it references another (in log order it always
    is already). A reference the log cannot satisfy (never written by the proxy: a damaged or
    hand-made log) fails the turn, which keeps it out of training, instead of guessing tokens.
    """
    pending = dict(references)
    resolving: set[str] = set()

    def resolve(stream: str) -> None:
        prefix = pending.pop(stream)
        resolving.add(stream)
        source = request_stream(str(prefix.get("request_id")))
        shared = 4 * int(prefix.get("n_tokens") or 0)
        if source in pending:
            resolve(source)  # out of log order: its own reference first (failed: no prompt)
        base = None if source in resolving else prompts.get(source)  # None: a cycle
        if base is not None and len(base) < shared and (completion := chunks.get((source, 0))):
            base += b"".join(completion.token_ids)
        resolving.discard(stream)
        if base is None or len(base) < shared:
            del prompts[stream]
            turns[stream].status = "failed"
            turns[stream].failure = {
                "reason": "prompt_unresolved",
                "message": f"its prompt continues request {prefix.get('request_id')!r} for "
                f"{shared // 4} tokens, which this session's events do not hold",
            }
            return
        prompts[stream] = base[:shared] + prompts[stream]

    for stream, _ in references:
        if stream in pending:
            resolve(stream)
