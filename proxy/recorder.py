"""Recording one model request as events, through the store's background writer.

Every request gets its own stream (`request-<id>`), numbered by this recorder alone, so replicas
never contend (see `store.events`). Nothing here awaits the database: events go to the
`EventWriter`'s queue, and only when that queue is over its hard limit does `put()` wait, which
slows the stream instead of dropping tokens. Each event's payload is built in the stored form
of its typed model (`store.payloads_request`; the prose is in `store.sessions`).

The request_received payload is built by `proxy.received`, the prompt_tokens payload by
`proxy.prompts`; each choice's tokens wait in a `proxy.choice_buffer.ChoiceBuffer` until a
chunk event is full.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from trajstore.proxy import routing
from trajstore.proxy.apis.base import ImagePart
from trajstore.proxy.choice_buffer import ChoiceBuffer
from trajstore.proxy.continuation import RENDERED, Plan
from trajstore.proxy.images import DEFAULT_MAX_IMAGE_BYTES
from trajstore.proxy.lineages import Ending, SessionTurns, Turn, messages_key
from trajstore.proxy.prompts import prompt_payload
from trajstore.proxy.received import received
from trajstore.proxy.wire import Api, Asked, Extracted
from trajstore.store import BadEvent, EventWriter, NewEvent, request_stream
from trajstore.store.payloads import Payload, VersionSpan, dump, stored
from trajstore.store.payloads_request import (
    CompletionChunk,
    CompletionFinished,
    FinishedChoice,
    ImageRecorded,
    PromptTokens,
    RequestFailed,
    RequestReceived,
)
from trajstore.store.tokens import TOKEN_DTYPE, decode_token_ids, encode_token_ids, shared_prefix

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


def new_request_id() -> str:
    """A fresh, unique request id: 128 random bits, as hex (cheaper than uuid4, as unique)."""
    return f"{random.getrandbits(128):032x}"


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
        self._choices: dict[int, ChoiceBuffer] = {}
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
        """Build (and so validate) the request_received event, before anything is forwarded
        (`proxy.received`, which says what each argument is); `chat` is the chat request the
        body was translated to, the body itself when omitted."""
        chat = body if chat is None else chat
        self.api = api
        self.engine = engine
        start = chat.get("routed_experts_prompt_start")
        self.routed_experts_start = start if isinstance(start, int) and start > 0 else 0
        request = received(
            self.request_id, api=api, body=body, chat=chat, engine=engine,
            policy_version=policy_version, logprobs_mode=logprobs_mode, asked=asked,
            replica=replica, dropped_tools=dropped_tools, images=images or [], turns=self.turns,
            max_image_bytes=self.max_image_bytes, image_token_id=self.image_token_id,
        )  # fmt: skip
        self._messages, self._render_key = request.messages, request.render_key
        self.candidates = request.candidates
        event = self._event(RequestReceived, request.payload)
        # The images new to the session follow it, at the next drain.
        for image in request.new_images:
            self._outbox.append(self._event(ImageRecorded, dump(image.payload())))
        return event

    @property
    def messages_json(self) -> bytes:
        """The request's messages as orjson serialises them (chat; b"" otherwise)."""
        return self._messages[1]

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
        """Which version generated which of choice `index`'s tokens."""
        return [VersionSpan(version=v, start=s, end=e) for v, s, e in self._spans(index)]

    def _spans(self, index: int) -> list[tuple[str, int, int]]:
        """(version, start, end) of each span of choice `index`'s tokens."""
        n = self.tokens_of(index)
        versions = self._versions if index == 0 else self._versions[:1]  # n > 1 is never cut
        return [
            (version, start, versions[i + 1][1] if i + 1 < len(versions) else n)
            for i, (version, start) in enumerate(versions)
        ]

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
                buffer = self._choices[choice.index] = ChoiceBuffer()
            if choice.token_ids and self.first_token_at is None:
                self.first_token_at = time.monotonic()
            buffer.take(choice)
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
                "message": buffer.final_message(),
                "n_tokens": buffer.n_tokens,
                # Stored forms, not models: every completion_finished carries them.
                "version_spans": [
                    stored(VersionSpan, version=v, start=s, end=e) for v, s, e in self._spans(index)
                ],
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
        """The prompt_tokens event: whole, or what follows the part shared with an earlier turn
        (`proxy.prompts`).

        The prompt is packed (and checked) once; the event then takes a view of it. A chat
        prompt also says how it reached the engine, checked against what the engine echoed.
        """
        packed = self._prompt = encode_token_ids(token_ids)
        ids = np.frombuffer(packed, TOKEN_DTYPE)
        plan: Plan | None = None
        if self._messages[0]:
            if self.plan.source == "continued" and packed != self.plan.packed:
                # The engine rendered the messages itself: its echo is the truth, and says so.
                self.plan = RENDERED._replace(fallback="engine_ignored_token_prompt")
            plan = self.plan
            if self.on_prompt is not None:
                self.on_prompt(plan)
        # Stored against the turn it continues, else the deepest whose messages it repeats,
        # else the session's latest (a new conversation often repeats the system prompt).
        reference = self.plan.turn or next(iter(self.candidates), None) or self.turns.latest
        self._reference = reference
        payload, shared = prompt_payload(packed, plan, reference)
        return self._event(PromptTokens, payload, token_ids=ids[shared:])

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

    def _chunk(self, index: int, buffer: ChoiceBuffer) -> None:
        if not buffer.token_ids:
            return
        token_ids, logprobs, text = buffer.take_chunk()
        event = self._event(
            CompletionChunk,
            CompletionChunk.stored(index, text),
            token_ids=token_ids,
            logprobs=logprobs,
        )
        self.tokens_recorded += len(token_ids)
        if event.token_bytes is not None:
            self._completions.setdefault(index, []).append(event.token_bytes)
        self._outbox.append(event)

    def _all_chunks(self) -> None:
        for index in sorted(self._choices):
            self._chunk(index, self._choices[index])
