"""A session as recorded, rebuilt from its events: what `GET /sessions/{id}` shows.

This is the prose of the contract between the recorder (which writes these events) and every
reader of them; its code, one typed payload class per event type with the upcasters that read
older shapes, is `store.payloads_session` and `store.payloads_request` (the generated catalogue
is in docs/architecture.md). A session's events live in two kinds of streams (see
`store.events`):

`session-<id>`
    session_created    {run_id, task_id, group_id, metadata, deadline_s, created_at}
    reward_assigned    {value, components, source}
    session_finished   {status: completed|aborted|error|timeout, reason, main_lineage?} (the
                       lineage the orchestrator names the main one, `store.lineages`)
    session_discarded  {reason}

`request-<request_id>`, one per model call, in this order:
    request_received     {request_id, api: chat|completions|messages|responses, body,
                          sampling, engine, policy_version, logprobs_mode, stream, asked:
                          {token_ids, logprobs, usage}, received_at}; or, when the request's
                          messages continue an earlier turn's, also {messages_prefix:
                          {request_id, n_messages}} and body.messages = the messages after
                          the first n_messages (see below).
                          With images in its messages: {n_images, image_token_id} (how many
                          image parts the whole messages hold; the engine's placeholder id,
                          when the proxy was told it) and each image's URL in body replaced by
                          a reference, `trajstore-image:sha256:<hex>` (`store.images`); for
                          api messages or responses also {images: [sha256, ...]}, the hashes
                          in the order of the prompt's placeholders (their body's blocks are
                          not chat messages; Messages' image sources become {type: url, url:
                          <reference>}, Responses' image_url the reference)
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
                         `continued` (ids built by the proxy: {continuation: {request_id,
                         choice, drift_at, audit}}: the turn and choice continued; drift_at the
                         first position where the text rendering would have differed, null for
                         none, measured on audited turns only; audit: whether the whole
                         conversation was rendered to check it) or `rendered` (the engine
                         rendered the messages; {continuation: {fallback}} says why when the
                         request looked like a continuation)
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
is the earlier turn of the same session that the prompt continues (its lineage's last turn, when
the proxy knows it: `store.lineages`) and comes earlier in the log. Without this, a session's
events grow with the square of its turns, since every turn's prompt repeats the context before it.

The request's messages work the same way: with `messages_prefix`, the whole list is the
referenced request's whole messages (exactly `n_messages` of them) followed by `body.messages`.
An agent re-sends its whole conversation every turn, so storing each body whole made the bodies
most of an agent session's bytes.

Readers keep both as stored (`TurnRecord.prompt_added`, `TurnRecord.messages_added`) and make
one turn's whole prompt or messages on demand (`TurnRecord.prompt_token_ids`,
`TurnRecord.messages`; `store.references`): reading a session costs what it stored.

Images are recorded once per session the same way: a request whose messages hold an image the
proxy replica has not yet recorded for the session writes it as `image_recorded` (the sha256 is
that of a data URL's decoded bytes, or of an http URL's text); every body then refers to it by
hash. After a restart, on another replica, or after a failed turn, an image may be recorded
again: same hash, same content; readers keep one. A reference whose image the session's events
do not hold leaves the image's source unknown, never the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from trajstore.store import payloads
from trajstore.store.events import EventType, RecordedEvent, request_stream
from trajstore.store.payloads_request import (
    CompletionChunk,
    CompletionFinished,
    ImageRecorded,
    PromptTokens,
    RequestFailed,
    RequestReceived,
)
from trajstore.store.payloads_session import (
    RewardAssigned,
    SessionCreated,
    SessionDiscarded,
    SessionFinished,
)
from trajstore.store.records import ChoiceRecord, SessionRecord, TurnRecord
from trajstore.store.tokens import TokenIds, decode_logprobs, decode_token_ids

__all__ = ["ChoiceRecord", "SessionRecord", "TurnRecord", "rebuild_session"]


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
_SIDE = EventType.SIDE_DATA_RECORDED.value


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
    session = SessionRecord(session_id, n_events=len(events), packed=packed)
    turns: dict[str, TurnRecord] = {}
    chunks: dict[tuple[str, int], _Chunks] = {}
    for event in events:
        kind = event.type
        stream = event.stream_id
        if kind == _CHUNK:
            if stream in turns:
                index, text = CompletionChunk.fields(event.payload)
                pending = chunks.get((stream, index))
                if pending is None:
                    pending = chunks[stream, index] = _Chunks(turns[stream].choice(index))
                if (ids := event.packed_token_ids) is not None:
                    pending.token_ids.append(ids)
                if (logprobs := event.packed_logprobs) is not None:
                    pending.logprobs.append(logprobs)
                pending.text.append(text)
        elif kind == _PROMPT:
            if stream in turns:
                turn = turns[stream]
                prompt = PromptTokens.read(event.payload)
                turn.prompt_added = added = event.packed_token_ids or b""
                turn.prompt_source = prompt.prompt_source
                turn.continuation = prompt.continuation
                turn.prompt_prefix = prompt.prefix
                session.prompts.add(turn.request_id, added, prompt.prefix)
                turn.n_prompt_tokens = session.prompts.length(turn.request_id)
        elif kind == _RECEIVED:
            received = RequestReceived.read(event.payload)
            turn = TurnRecord(
                request_id=received.request_id,
                api=received.api,
                body=received.body,
                engine=received.engine,
                policy_version=received.policy_version,
                logprobs_mode=received.logprobs_mode,
                stream=received.stream,
                sampling=received.sampling,
                first_position=event.position,
                received_at=received.received_at,
                messages_prefix=received.messages_prefix,
                n_images=received.n_images,
                image_token_id=received.image_token_id,
                image_order=received.images,
            )
            turns[stream] = turn
            session.turns.append(turn)
            session.messages.add(turn.request_id, turn.body.get("messages"), turn.messages_prefix)
        elif kind == _FINISHED:
            if stream in turns:
                finished = CompletionFinished.read(event.payload)
                turn = turns[stream]
                turn.status = "completed"
                turn.usage = finished.usage
                turn.latency_s = finished.latency_s
                turn.ttft_s = finished.ttft_s
                for ending in finished.choices:
                    choice = turn.choice(ending.index)
                    choice.finish_reason = ending.finish_reason
                    choice.stop_reason = ending.stop_reason
                    choice.message = ending.message
                    choice.api_finish_reason = ending.api_finish_reason
                    if ending.version_spans is not None:
                        choice.version_spans = list(ending.version_spans)
        elif kind == _FAILED:
            if stream in turns:
                turn = turns[stream]
                turn.status = "failed"
                turn.failure = RequestFailed.read(event.payload)
                turn.latency_s = turn.failure.latency_s
                for choice_index, spans in (turn.failure.version_spans or {}).items():
                    partial = turn.choice(int(choice_index))
                    partial.version_spans = list(spans)
        elif kind == _CREATED:
            created = SessionCreated.read(event.payload)
            session.run_id = event.run_id
            session.task_id = created.task_id
            session.group_id = created.group_id
            session.metadata = created.metadata
            session.deadline_s = created.deadline_s
            session.created_at = created.created_at
            session.rate_limit = created.rate_limit
            session.recorded_created_at = event.recorded_at
        elif kind == _REWARD:
            session.rewards.append(RewardAssigned.read(event.payload))
        elif kind == _SESSION_FINISHED:
            ended = SessionFinished.read(event.payload)
            session.status = ended.status
            session.finish_reason = ended.reason
            session.recorded_finished_at = event.recorded_at
            if ended.main_lineage is not None:
                session.main_lineage = ended.main_lineage
        elif kind == _DISCARDED:
            session.discarded = SessionDiscarded.read(event.payload).why
        elif kind == _IMAGE:
            image = ImageRecorded.read(event.payload)
            if image.sha256 not in session.images:
                session.images[image.sha256] = image.model_copy(update={"data": None})
        elif kind == _SIDE and stream in turns:
            side = payloads.load(kind, event.payload)
            turns[stream].side_data.append((side, event.packed_side_data))
        # else: a newer event type (or a sample's derived facts, `store.side_data`, which
        # readers align when they read); a reader of today ignores what it does not know
    _in_request_order(session.turns)
    for (stream, index), pending in chunks.items():
        if index == 0:
            session.prompts.completed(stream.removeprefix("request-"), b"".join(pending.token_ids))
        pending.close(packed)
    for request_id, why in session.prompts.unresolved().items():
        # Never a guessed token: the turn fails, which keeps it out of training.
        turn = turns[request_stream(request_id)]
        turn.status = "failed"
        turn.failure = RequestFailed(reason="prompt_unresolved", message=why)
        turn.prompt_added, turn.prompt_prefix, turn.n_prompt_tokens = b"", None, None
    for request_id, why in session.messages.unresolved().items():
        turns[request_stream(request_id)].body["messages_unresolved"] = why
    for turn in session.turns:
        turn.session = session
        if not packed and isinstance(turn.prompt_added, bytes):
            turn.prompt_added = _ints(decode_token_ids(turn.prompt_added))
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
