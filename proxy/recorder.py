"""Recording one model request as events, through the store's background writer.

Every request gets its own stream (`request-<id>`), numbered by this recorder alone, so replicas
never contend (see `store.events`). Nothing here awaits the database: events go to the
`EventWriter`'s queue, and only when that queue is over its hard limit does `put()` wait, which
slows the stream instead of dropping tokens. Each event's payload is built as its typed model
(`store.payloads_request`; the prose is in `store.sessions`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from trajstore.proxy import routing
from trajstore.proxy.apis.base import ImagePart
from trajstore.proxy.continuation import RENDERED, Plan
from trajstore.proxy.images import DEFAULT_MAX_IMAGE_BYTES, referenced, referenced_body
from trajstore.proxy.lineages import Ending, SessionTurns, Turn, messages_key, render_key
from trajstore.proxy.wire import Api, Asked, ChoiceTokens, Extracted, sampling_of
from trajstore.store import BadEvent, EventWriter, NewEvent, request_stream
from trajstore.store.payloads import Payload, VersionSpan, dump, stored
from trajstore.store.payloads_request import (
    CompletionChunk,
    CompletionFinished,
    Continuation,
    FinishedChoice,
    ImageRecorded,
    MessagesPrefix,
    PromptPrefix,
    PromptTokens,
    RequestFailed,
    RequestReceived,
)
from trajstore.store.tokens import TOKEN_DTYPE, decode_token_ids, encode_token_ids, shared_prefix

#: A prompt is stored as a reference to an earlier turn of the session when it shares at least
#: this many leading tokens with it (the prompt_tokens contract in `store.sessions`).
MIN_SHARED_TOKENS = 16

#: What ends a turn: its completion_finished or request_failed payload (`on_ended` gets it).
TurnEnding = CompletionFinished | RequestFailed


def _without_nul(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {_without_nul(k): _without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_nul(v) for v in value]
    return value


def _prompt_source(plan: Plan) -> dict[str, Any]:
    """What the prompt_tokens event records of how the prompt reached the engine: continued
    (the turn and choice, whether audited, the drift measured) or rendered (and why)."""
    if plan.source == "continued":
        request_id = None if plan.turn is None else plan.turn.request_id
        # drift_at is there only when measured (an audited turn): null would say "no drift".
        if plan.audit:
            continued = stored(
                Continuation,
                request_id=request_id,
                choice=plan.choice,
                audit=True,
                drift_at=plan.drift_at,
            )
        else:
            continued = stored(Continuation, request_id=request_id, choice=plan.choice, audit=False)
        return {"prompt_source": "continued", "continuation": continued}
    if plan.fallback is not None:
        return {
            "prompt_source": "rendered",
            "continuation": stored(Continuation, fallback=plan.fallback),
        }
    return {"prompt_source": "rendered"}


def new_request_id() -> str:
    """A fresh, unique request id: 128 random bits, as hex (cheaper than uuid4, as unique)."""
    return f"{random.getrandbits(128):032x}"


@dataclass
class _ChoiceBuffer:
    """Tokens of one choice not yet written, and what the finished event will say of it."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    logprobs_complete: bool = True
    text: list[str] = field(default_factory=list)
    n_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    message: dict[str, Any] | None = None
    content: list[str] = field(default_factory=list)  # streamed chat content, for the message
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    role: str | None = None
    routed_experts: str | None = None  # as the engine sent them (`proxy.routing`)


class RequestRecorder:
    """Turns one request's lifecycle into events: received, prompt, chunks, finished or failed."""

    def __init__(
        self,
        writer: EventWriter,
        *,
        session_id: str,
        run_id: str | None,
        request_id: str,
        chunk_tokens: int = 16,
        turns: SessionTurns | None = None,
        on_completed: Callable[[Turn, Turn | None, Turn | None], None] | None = None,
        on_prompt: Callable[[Plan], None] | None = None,
        finish_reason_in_api: Callable[[str | None, Any], str | None] | None = None,
        max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
        image_token_id: int | None = None,
        on_ended: Callable[[RequestRecorder, CompletionFinished | RequestFailed], None]
        | None = None,
    ) -> None:
        """`turns`: the session's turns this replica remembers, which this turn's prompt and
        messages may reference (`proxy.lineages`); `on_completed`: told this turn as a `Turn`
        once it finished, with the turn its prompt extends (if remembered) and the turn its request
        continued or looked like; `on_prompt`:
        told how the prompt reached the engine once the engine echoed it;
        `finish_reason_in_api`: a translated API's name for a chat finish reason (`proxy.apis`);
        `max_image_bytes`: the largest image a chat message may carry (`proxy.images`);
        `image_token_id`: the engine's image placeholder id, recorded with requests that carry
        images so the projection can locate them in the prompt; `on_ended`: told this recorder
        and its last event's payload (completion_finished or request_failed) once that event
        is queued (`proxy.tracing`'s span)."""
        self.writer = writer
        self.session_id = session_id
        self.run_id = run_id
        self.request_id = request_id
        self.stream_id = request_stream(request_id)
        self.chunk_tokens = chunk_tokens
        self.version = 0
        self.started = time.monotonic()
        self.first_token_at: float | None = None
        self.ended = False
        self.prompt_recorded = False
        self.tokens_recorded = 0
        self._choices: dict[int, _ChoiceBuffer] = {}
        self._outbox: list[NewEvent] = []
        self.turns = turns or SessionTurns()
        #: The remembered turns whose messages this request repeats, deepest first.
        self.candidates: list[Turn] = []
        self.on_completed = on_completed
        self.on_prompt = on_prompt
        self.finish_reason_in_api = finish_reason_in_api
        self.plan: Plan = RENDERED  #: how the prompt is sent (`proxy.continuation`)
        self._prompt: bytes | None = None  # packed, whole
        self._completions: dict[int, list[bytes]] = {}  # each choice's recorded chunks, packed
        self._messages: tuple[int, bytes] = (0, b"")  # chat: how many messages, as JSON
        self._reference: Turn | None = None  # the turn the prompt is stored against
        self._render_key = b""
        self.api: str = "chat"
        self.max_image_bytes = max_image_bytes
        self.image_token_id = image_token_id
        self.engine: str | None = None
        self.routed_experts_start = 0  # the request's `routed_experts_prompt_start`
        # The images recorded for the session so far (by this replica): referenced, not repeated.
        self._images = self.turns.images
        self.on_ended = on_ended
        self.response_model: str | None = None  #: the model the engine says answered
        #: (version, first token) of each engine request of the turn, in order: one, unless a
        #: weight switch cut it and it went on (`proxy.switching`).
        self._versions: list[tuple[str, int]] = []

    def received_event(
        self,
        *,
        api: Api,
        body: dict[str, Any],
        engine: str,
        policy_version: str,
        logprobs_mode: str,
        asked: Asked,
        chat: dict[str, Any] | None = None,
        replica: str | None = None,
        dropped_tools: list[dict[str, Any]] | None = None,
        images: list[ImagePart] | None = None,
    ) -> NewEvent:
        """Build (and so validate) the request_received event, before anything is forwarded.

        `body` is the agent's request as it sent it; `chat` the chat request it was translated
        to (`proxy.apis`; the body itself for chat): its sampling, messages and render options
        are what the next turn is compared with. `replica`: the proxy replica serving it.
        `dropped_tools`: the agent's tools the engine did not get (`proxy.apis.Dropped`).
        `images`: a translated request's images, which its recorded body refers to by hash as
        chat's does (`proxy.apis.ImagePart`).
        """
        chat = body if chat is None else chat
        self.api = api
        self.engine = engine
        start = chat.get("routed_experts_prompt_start")
        self.routed_experts_start = start if isinstance(start, int) and start > 0 else 0
        payload: dict[str, Any] = {
            "request_id": self.request_id,
            "api": api,
            "body": body,
            "sampling": sampling_of(chat),
            "engine": engine,
            "policy_version": policy_version,
            "logprobs_mode": logprobs_mode,
            "stream": bool(chat.get("stream")),
            "asked": asked.as_json(),
            "received_at": time.time(),
        }
        if replica is not None:
            payload["replica"] = replica
        if dropped_tools:
            payload["dropped_tools"] = dropped_tools
        messages = chat.get("messages")
        recorded = messages
        if api != "completions" and isinstance(messages, list):
            # Images go into the record once per session, and the body refers to them by hash.
            # Their events follow this one at the next drain.
            recorded = self._take_images(messages, payload, images or [])
            if images and recorded is not messages:
                payload["body"] = referenced_body(body, images, recorded)
        if api != "completions" and isinstance(recorded, list):
            self._messages = (len(recorded), orjson.dumps(recorded))
            self._render_key = render_key(chat)
            # Only a request with history can continue a turn; without, it costs no look-up (a
            # session used as a plain endpoint holds thousands of one-call lineages).
            if any(m.get("role") == "assistant" for m in recorded if isinstance(m, dict)):
                self.candidates = self.turns.continued_by(self._messages[1])
        if api == "chat" and isinstance(recorded, list):
            # Only chat stores messages by reference: the other APIs' bodies are their own.
            continued = self._messages_continued()
            if continued is not None:
                n_messages = continued.n_messages
                payload["body"] = {**body, "messages": recorded[n_messages:]}
                payload["messages_prefix"] = stored(
                    MessagesPrefix, request_id=continued.request_id, n_messages=n_messages
                )
            elif recorded is not messages:
                payload["body"] = {**body, "messages": recorded}
        return self._event(RequestReceived, stored(RequestReceived, **payload))

    def _take_images(
        self, messages: list[Any], payload: dict[str, Any], images: list[ImagePart]
    ) -> list[Any]:
        """The messages as recorded: each image replaced by its reference. The images new to
        the session wait in the outbox as `image_recorded` events; `payload` gets the count,
        the placeholder id, and for a translated API the hashes in order (`images`, its
        body's own shape being no chat messages)."""
        params = {id(image.chat_part): image.param for image in images}
        found = referenced(messages, self.max_image_bytes, params)
        if not found.n_images:
            return messages
        payload["n_images"] = found.n_images
        if images:
            payload["images"] = found.hashes
        if self.image_token_id is not None:
            payload["image_token_id"] = self.image_token_id
        for sha256, image in found.images.items():
            if sha256 not in self._images:
                self._outbox.append(self._event(ImageRecorded, dump(image.payload())))
        self._images = self._images | found.images.keys()
        self.turns.images = self._images  # later requests of the session refer to them
        return found.messages

    @property
    def messages_json(self) -> bytes:
        """The request's messages as orjson serialises them (chat; b"" otherwise)."""
        return self._messages[1]

    def _messages_continued(self) -> Turn | None:
        """The deepest remembered chat turn whose messages this request repeats first, which
        `messages_prefix` names (then its body stores only the rest); else None.

        Found by the messages' serialisation (`SessionTurns.continued_by`): `[A,B]` and
        `[A,B,C]` agree up to the former's closing bracket, where the latter has a comma, and
        JSON values delimit themselves, so the first messages are the same values.
        """
        for turn in self.candidates:
            if turn.api == "chat" and turn.n_messages:
                return turn
        return None

    def generating_on(self, version: str) -> None:
        """The tokens recorded from now on come from policy `version` (an engine request of
        this turn begins; a continuation after a switch begins a new span)."""
        at = self.tokens_of(0)
        if self._versions and self._versions[-1][1] == at:
            self._versions.pop()  # the request before generated nothing
        if not self._versions or self._versions[-1][0] != version:
            self._versions.append((version, at))  # the same version goes on in one span

    def tokens_of(self, index: int) -> int:
        """How many tokens choice `index` has received so far."""
        buffer = self._choices.get(index)
        return 0 if buffer is None else buffer.n_tokens

    def generated(self, index: int = 0) -> list[int]:
        """The ids choice `index` has received so far, in order."""
        packed = b"".join(self._completions.get(index, ()))
        recorded = decode_token_ids(packed) if packed else None
        buffer = self._choices.get(index)
        held = buffer.token_ids if buffer else []
        return ([] if recorded is None else recorded.tolist()) + held

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt the engine echoed, once it did."""
        prompt = decode_token_ids(self._prompt) if self._prompt else None
        return None if prompt is None else prompt.tolist()

    def version_spans(self, index: int) -> list[VersionSpan]:
        """Which version generated which of choice `index`'s tokens, as stored."""
        n = self.tokens_of(index)
        versions = self._versions if index == 0 else self._versions[:1]  # n > 1 is never cut
        spans = []
        for i, (version, start) in enumerate(versions):
            end = versions[i + 1][1] if i + 1 < len(versions) else n
            spans.append(VersionSpan(version=version, start=start, end=end))
        return spans

    async def emit(self, event: NewEvent) -> None:
        """Queue one event of this request's stream."""
        self.version += 1
        await self.writer.put(self.stream_id, self.version, event)

    def record(self, extracted: Extracted) -> None:
        """Take what an answer or a stream chunk carries; full chunks wait in the outbox.

        Synchronous, so that a stream pays for one `drain()` per read, not one await per event.
        """
        if extracted.model is not None and self.response_model is None:
            self.response_model = extracted.model
        if extracted.prompt_token_ids is not None and not self.prompt_recorded:
            self.prompt_recorded = True
            self._outbox.append(self._prompt_event(extracted.prompt_token_ids))
        for choice in extracted.choices:
            buffer = self._choices.get(choice.index)
            if buffer is None:
                buffer = self._choices[choice.index] = _ChoiceBuffer()
            self._take(buffer, choice)
            if len(buffer.token_ids) >= self.chunk_tokens:
                self._chunk(choice.index, buffer)

    async def drain(self) -> None:
        """Queue the events `record()` made ready."""
        outbox, self._outbox = self._outbox, []
        for event in outbox:
            await self.emit(event)

    async def finished(self, usage: dict[str, Any] | None) -> None:
        """Write what is buffered, the side data the engine returned, and completion_finished."""
        self._all_chunks()
        await self.drain()
        for index in sorted(self._choices):
            routed = self._choices[index].routed_experts
            if routed:
                side = routing.side_data_event(
                    routed, request_id=self.request_id, choice=index, session_id=self.session_id,
                    run_id=self.run_id, engine=self.engine, start=self.routed_experts_start,
                )  # fmt: skip
                if side is not None:
                    await self.emit(side)
        choices, endings = [], []
        for index in sorted(self._choices):
            buffer = self._choices[index]
            choice: dict[str, Any] = {
                "index": index,
                "finish_reason": buffer.finish_reason,
                "stop_reason": buffer.stop_reason,
                "message": buffer.message or self._streamed_message(buffer),
                "n_tokens": buffer.n_tokens,
                "version_spans": self.version_spans(index),
            }
            if self.finish_reason_in_api is not None:
                ending = self.finish_reason_in_api(buffer.finish_reason, buffer.stop_reason)
                choice["api_finish_reason"] = ending
            choices.append(stored(FinishedChoice, **choice))
            endings.append(
                Ending(
                    b"".join(self._completions.get(index, ())),
                    buffer.finish_reason,
                    buffer.stop_reason,
                    choice["message"],
                )
            )
        now = time.monotonic()
        finished = stored(
            CompletionFinished,
            choices=choices,
            usage=usage,
            latency_s=now - self.started,
            ttft_s=None if self.first_token_at is None else self.first_token_at - self.started,
        )
        await self.emit(self._event(CompletionFinished, finished))
        self.ended = True
        # A later turn may reference and continue this one, once it is whole.
        whole = sorted(self._choices) == list(range(len(self._choices)))
        if self.on_completed is not None and self._prompt is not None and whole:
            self.on_completed(self._as_turn(tuple(endings)), self._extended(), self.plan.turn)
        if self.on_ended is not None:  # a tracer's (`proxy.tracing`): the typed payload
            self.on_ended(self, CompletionFinished.read(finished))

    def _as_turn(self, endings: tuple[Ending, ...]) -> Turn:
        n_messages, messages = self._messages
        prompt = self._prompt or b""
        key = messages_key(messages) if messages else b""
        return Turn(
            self.request_id, len(prompt) // 4, n_messages, len(messages), key, self._render_key,
            endings, api=self.api, held_prompt=prompt,
        )  # fmt: skip

    def _extended(self) -> Turn | None:
        """The remembered turn whose prompt + completion this prompt starts with (all but its
        end-of-turn id, when the template does not repeat it), if any."""
        reference, prompt = self._reference, self._prompt or b""
        if reference is None:
            return None
        tokens = reference.tokens
        shared = shared_prefix(prompt, tokens)
        eot = bool(reference.choices) and reference.choices[0].finish_reason == "stop"
        return reference if 4 * shared >= len(tokens) - (4 if eot else 0) else None

    async def failed(self, reason: str, message: str, status: int | None = None) -> None:
        """Write what is buffered (partial tokens are kept) and the request_failed event."""
        if self.ended:
            return
        self._all_chunks()
        await self.drain()
        failure = RequestFailed(
            reason=reason,
            status=status,
            message=message,
            latency_s=time.monotonic() - self.started,
            partial_tokens={str(i): b.n_tokens for i, b in sorted(self._choices.items())},
            version_spans={str(i): self.version_spans(i) for i in self._choices}
            if self._versions
            else None,
        )
        await self.emit(self._event(RequestFailed, dump(failure)))
        self.ended = True
        if self.on_ended is not None:
            self.on_ended(self, failure)

    @property
    def prompt_tokens(self) -> int | None:
        """How many prompt tokens the engine echoed (and the log holds), once it did."""
        return None if self._prompt is None else len(self._prompt) // 4

    @property
    def completion_tokens(self) -> int:
        """How many tokens the choices generated so far, recorded or still buffered."""
        return sum(buffer.n_tokens for buffer in self._choices.values())

    @property
    def extends(self) -> str | None:
        """The request id of the remembered turn whose tokens this prompt extends, if any."""
        turn = self._extended() if self._prompt is not None else None
        return None if turn is None else turn.request_id

    # -- internals ----------------------------------------------------------------------------

    def _prompt_event(self, token_ids: list[int]) -> NewEvent:
        """The prompt_tokens event: whole, or what follows the part shared with `previous`.

        The prompt is packed (and checked) once; the event then takes a view of it. A chat
        prompt also says how it reached the engine, checked against what the engine echoed.
        """
        packed = self._prompt = encode_token_ids(token_ids)
        ids = np.frombuffer(packed, TOKEN_DTYPE)
        payload: dict[str, Any] = {"choice": None}
        if self._messages[0]:
            if self.plan.source == "continued" and packed != self.plan.packed:
                # The engine rendered the messages itself: its echo is the truth, and says so.
                self.plan = RENDERED._replace(fallback="engine_ignored_token_prompt")
            payload |= _prompt_source(self.plan)
            if self.on_prompt is not None:
                self.on_prompt(self.plan)
        # Stored against the turn it continues, else the deepest whose messages it repeats,
        # else the session's latest (a new conversation often repeats the system prompt).
        reference = self.plan.turn or next(iter(self.candidates), None) or self.turns.latest
        self._reference = reference
        shared = 0 if reference is None else shared_prefix(packed, reference.tokens)
        if reference is None or shared < MIN_SHARED_TOKENS:
            return self._event(PromptTokens, stored(PromptTokens, **payload), token_ids=ids)
        payload["prefix"] = stored(PromptPrefix, request_id=reference.request_id, n_tokens=shared)
        payload["n_tokens"] = len(ids)
        return self._event(PromptTokens, stored(PromptTokens, **payload), token_ids=ids[shared:])

    def _event(
        self,
        kind: type[Payload],
        payload: dict[str, Any],
        *,
        token_ids: list[int] | np.ndarray | None = None,
        logprobs: list[float] | None = None,
    ) -> NewEvent:
        """The event of `kind` storing `payload` (`payloads.stored(kind, ...)`, or a dump)."""
        try:
            return NewEvent(
                kind.event_type,  # type: ignore[arg-type]  # NewEvent makes it an EventType
                session_id=self.session_id,
                run_id=self.run_id,
                payload=payload,
                token_ids=token_ids,
                logprobs=logprobs,
            )
        except BadEvent as exc:
            if "NUL" not in str(exc):
                raise
        # PostgreSQL's jsonb cannot hold U+0000, which models do emit (and tool output may
        # carry). The text in a payload is for people; the token ids are the record, and they
        # are kept exactly. So NUL becomes U+FFFD in the text, and the event says so.
        cleaned = kind.read({**_without_nul(payload), "nul_replaced": True})
        return self._event(kind, dump(cleaned), token_ids=token_ids, logprobs=logprobs)

    def _take(self, buffer: _ChoiceBuffer, choice: ChoiceTokens) -> None:
        if choice.token_ids and self.first_token_at is None:
            self.first_token_at = time.monotonic()
        buffer.token_ids.extend(choice.token_ids)
        if choice.logprobs is None:
            buffer.logprobs_complete = buffer.logprobs_complete and not choice.token_ids
        else:
            buffer.logprobs.extend(choice.logprobs)
        buffer.text.append(choice.text)
        buffer.n_tokens += len(choice.token_ids)
        buffer.finish_reason = choice.finish_reason or buffer.finish_reason
        buffer.stop_reason = choice.stop_reason or buffer.stop_reason
        if choice.message is not None:
            buffer.message = choice.message
        if choice.delta:
            self._merge_delta(buffer, choice.delta)
        if choice.routed_experts:
            buffer.routed_experts = choice.routed_experts

    @staticmethod
    def _merge_delta(buffer: _ChoiceBuffer, delta: dict[str, Any]) -> None:
        buffer.role = delta.get("role") or buffer.role
        if delta.get("content"):
            buffer.content.append(delta["content"])
        for call in delta.get("tool_calls") or ():
            merged = buffer.tool_calls.setdefault(
                int(call.get("index") or 0), {"function": {"name": "", "arguments": ""}}
            )
            for key in ("id", "type"):
                if call.get(key):
                    merged[key] = call[key]
            function = call.get("function") or {}
            merged["function"]["name"] += function.get("name") or ""
            merged["function"]["arguments"] += function.get("arguments") or ""

    @staticmethod
    def _streamed_message(buffer: _ChoiceBuffer) -> dict[str, Any] | None:
        if buffer.role is None and not buffer.content and not buffer.tool_calls:
            return None
        message: dict[str, Any] = {
            "role": buffer.role or "assistant",
            "content": "".join(buffer.content) or None,
        }
        if buffer.tool_calls:
            message["tool_calls"] = [buffer.tool_calls[i] for i in sorted(buffer.tool_calls)]
        return message

    def _chunk(self, index: int, buffer: _ChoiceBuffer) -> None:
        if not buffer.token_ids:
            return
        logprobs = buffer.logprobs if buffer.logprobs_complete else None
        event = self._event(
            CompletionChunk,
            CompletionChunk.stored(index, "".join(buffer.text)),
            token_ids=buffer.token_ids,
            logprobs=logprobs,
        )
        self.tokens_recorded += len(buffer.token_ids)
        if event.token_bytes is not None:
            self._completions.setdefault(index, []).append(event.token_bytes)
        buffer.token_ids, buffer.logprobs, buffer.text = [], [], []
        buffer.logprobs_complete = True
        self._outbox.append(event)

    def _all_chunks(self) -> None:
        for index in sorted(self._choices):
            self._chunk(index, self._choices[index])
