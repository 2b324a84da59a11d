"""Events: the immutable facts the store keeps, as they go in (`NewEvent`) and come out
(`RecordedEvent`).

Streams are chosen so that several proxy replicas can record one session at once without
conflicting: each model request has its own stream (`request_stream(request_id)`), written by the
one replica that serves it, and the few session-level facts (created, reward, finished, discarded)
go to the session's own stream (`session_stream(session_id)`) with `ExpectedVersion.ANY`. Every
event carries its session id, so `read_session` needs no knowledge of the streams.
"""

from __future__ import annotations

import operator
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum, StrEnum
from typing import Any, overload

import asyncpg
import orjson

from trajstore.store import payloads_request, payloads_session  # noqa: F401  (registers the contract)
from trajstore.store.errors import BadEvent, PayloadTooLarge
from trajstore.store.payloads import Payload, dump
from trajstore.store.tokens import (
    Logprobs,
    LogprobsLike,
    TokenIds,
    TokenIdsLike,
    decode_logprobs,
    decode_token_ids,
    encode_logprobs,
    encode_token_ids,
)

#: Largest JSON payload one event may carry. Requests carry the whole chat history, so this is
#: generous; anything near it is more likely a bug than a conversation.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024

#: Longest stream, session or run id; ids are chosen by clients (trial ids), so they are bounded.
MAX_ID_LENGTH = 200


class EventType(StrEnum):
    """Every kind of fact the store records. Unknown types are refused on the way in."""

    SESSION_CREATED = "session_created"
    REQUEST_RECEIVED = "request_received"
    PROMPT_TOKENS = "prompt_tokens"
    COMPLETION_CHUNK = "completion_chunk"
    COMPLETION_FINISHED = "completion_finished"
    REQUEST_FAILED = "request_failed"
    REWARD_ASSIGNED = "reward_assigned"
    SESSION_FINISHED = "session_finished"
    SESSION_DISCARDED = "session_discarded"
    #: The admin named the version engines serve, outside a switch (`proxy.versions`).
    POLICY_VERSION_SET = "policy_version_set"
    #: A weight switch of engines (`proxy.switching`): began, went live, or failed to load.
    POLICY_SWITCH_BEGAN = "policy_switch_began"
    POLICY_SWITCH_LIVE = "policy_switch_live"
    POLICY_SWITCH_FAILED = "policy_switch_failed"
    TRAINING_STEP = "training_step"
    IMAGE_RECORDED = "image_recorded"
    #: Per-token arrays the engine returned with a turn (MoE routed experts), `store.side_data`.
    SIDE_DATA_RECORDED = "side_data_recorded"
    #: A scorer's per-token arrays for a projected sample (a teacher's logprobs), derived later.
    SAMPLE_SCORED = "sample_scored"
    #: A scorer could not score a sample: why, so that a gap is never silent.
    SCORING_FAILED = "scoring_failed"


#: The facts after which a session's samples must be (re)built, and that proxy replicas follow:
#: the commit of one wakes listeners of `store.schema.FACTS_CHANNEL`.
SESSION_FACTS = (
    EventType.SESSION_FINISHED.value,
    EventType.SESSION_DISCARDED.value,
    EventType.REWARD_ASSIGNED.value,
)


class ExpectedVersion(IntEnum):
    """Special values for `append(..., expected_version=...)`; any int >= 0 is an exact version."""

    ANY = -1  #: append at the end of the stream, whatever its version
    NO_STREAM = 0  #: the stream must not exist yet


def new_event_id() -> uuid.UUID:
    """A time-ordered (version 7, RFC 9562) UUID: the milliseconds since the epoch, then 74
    random bits from the `random` module (as unique as `uuid.uuid4()` for our purpose and several
    times cheaper: no system call per event; `random` reseeds after fork). Ids made one after the
    other sort one after the other, so each day partition's unique index on `event_id` grows at
    its right edge instead of touching (and logging) a random page per event."""
    rand = random.getrandbits(74)
    return uuid.UUID(
        int=(time.time_ns() // 1_000_000) << 80
        | 0x7 << 76  # version 7
        | (rand >> 62) << 64
        | 0b10 << 62  # the RFC's variant
        | rand & _RAND_B
    )


_RAND_B = (1 << 62) - 1


def request_stream(request_id: str) -> str:
    """The stream of one model request: written by the single replica that serves it."""
    return f"request-{request_id}"


def switch_stream(switch_id: str) -> str:
    """The stream of one weight switch (began, then live or failed), by the replica running it."""
    return f"switch-{switch_id}"


def version_set_stream(set_id: str) -> str:
    """The stream of one policy version the admin set (`policy_version_set`), alone in it."""
    return f"version-set-{set_id}"


def session_stream(session_id: str) -> str:
    """The stream of a session's own facts (created, reward, finished, discarded)."""
    return f"session-{session_id}"


def _check_id(name: str, value: str | None, *, required: bool = False) -> None:
    if value is None:
        if required:
            raise BadEvent(f"{name} is required")
        return
    if not isinstance(value, str) or not value:
        raise BadEvent(f"{name} must be a non-empty string, got {value!r}")
    if len(value) > MAX_ID_LENGTH:
        raise BadEvent(f"{name} is longer than {MAX_ID_LENGTH} characters")
    if "\x00" in value:
        raise BadEvent(f"{name} contains a NUL character")


def _contains_nul(value: Any) -> bool:
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, Mapping):
        return any(_contains_nul(k) or _contains_nul(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return any(_contains_nul(v) for v in value)
    return False


def encode_payload(payload: Mapping[str, Any]) -> bytes:
    """Serialise a payload to JSON once, refusing what PostgreSQL's jsonb cannot hold."""
    if not isinstance(payload, Mapping):
        raise BadEvent(f"payload must be a mapping, got {type(payload).__name__}")
    try:
        data = orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:  # orjson raises JSONEncodeError, a TypeError subclass
        raise BadEvent(f"payload is not JSON-serialisable: {exc}") from exc
    if len(data) > MAX_PAYLOAD_BYTES:
        raise PayloadTooLarge(
            f"payload is {len(data)} bytes; the limit is {MAX_PAYLOAD_BYTES} bytes"
        )
    # jsonb refuses \u0000. The escaped form is cheap to spot; confirm on the (rare) hit, since
    # a literal backslash before "u0000" would match too.
    if b"\\u0000" in data and _contains_nul(payload):
        raise BadEvent("payload contains a NUL character (\\u0000), which jsonb cannot store")
    return data


@dataclass(frozen=True, slots=True)
class NewEvent:
    """An event to append. Validated and encoded once, when it is made.

    `payload` is a typed `store.payloads.Payload` (stored as `payloads.dump` makes it) or, for
    the types not yet declared there, a mapping.
    `token_ids` and `logprobs` accept numpy arrays or Python lists; when both are given they must
    have the same length (logprob i belongs to token i).
    """

    type: EventType
    session_id: str | None = None
    run_id: str | None = None
    payload: Mapping[str, Any] | Payload = field(default_factory=dict)
    token_ids: TokenIdsLike | None = None
    logprobs: LogprobsLike | None = None
    #: Packed typed arrays described by the payload (`store.side_data.pack`), or None.
    side_data: bytes | None = None
    event_id: uuid.UUID = field(default_factory=new_event_id)
    # Encoded forms, filled in by __post_init__; these are what goes over the wire.
    payload_json: bytes = field(init=False, repr=False, compare=False)
    token_bytes: bytes | None = field(init=False, repr=False, compare=False)
    logprob_bytes: bytes | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "type", EventType(self.type))
        except ValueError:
            known = ", ".join(t.value for t in EventType)
            raise BadEvent(f"unknown event type {self.type!r}; known types: {known}") from None
        if not isinstance(self.event_id, uuid.UUID):
            raise BadEvent(f"event_id must be a uuid.UUID, got {type(self.event_id).__name__}")
        _check_id("session_id", self.session_id)
        _check_id("run_id", self.run_id)
        payload = self.payload
        if isinstance(payload, Payload):
            if payload.event_type != self.type:
                raise BadEvent(
                    f"a {type(payload).__name__} payload cannot go in a {self.type} event"
                )
            payload = dump(payload)
            object.__setattr__(self, "payload", payload)
        object.__setattr__(self, "payload_json", encode_payload(payload))
        tokens = None if self.token_ids is None else encode_token_ids(self.token_ids)
        logprobs = None if self.logprobs is None else encode_logprobs(self.logprobs)
        if tokens is not None and logprobs is not None and len(tokens) != len(logprobs):
            raise BadEvent(
                f"{len(tokens) // 4} token ids but {len(logprobs) // 4} logprobs; "
                "each token needs exactly one logprob"
            )
        object.__setattr__(self, "token_bytes", tokens)
        object.__setattr__(self, "logprob_bytes", logprobs)
        if self.side_data is not None and not isinstance(self.side_data, bytes):
            raise BadEvent(f"side_data must be bytes, got {type(self.side_data).__name__}")


class _ParsedPayload:
    """`RecordedEvent.payload`: parses the stored JSON on first access and keeps the result in
    the instance's `__dict__`, where later lookups find it before this (non-data) descriptor."""

    @overload
    def __get__(self, event: None, owner: type) -> _ParsedPayload: ...
    @overload
    def __get__(self, event: RecordedEvent, owner: type) -> dict[str, Any]: ...
    def __get__(self, event: RecordedEvent | None, owner: type) -> Any:
        if event is None:
            return self
        payload = event.__dict__["payload"] = orjson.loads(event[9])
        return payload


def _column(index: int, doc: str) -> Any:
    """A read-only attribute for one column of the row: `itemgetter` keeps the lookup in C."""
    return property(operator.itemgetter(index), doc=doc)


class RecordedEvent(asyncpg.Record):  # type: ignore[misc]  # asyncpg is untyped
    """An event as stored: its place in the log, its stream and its content.

    It *is* the database row: every query of events asks asyncpg for rows of this class
    (`record_class=RecordedEvent`), so reading many events costs no more than fetching them,
    and nothing is decoded until it is asked for. The payload is parsed once, on first access;
    token ids and logprobs are numpy views of the stored bytes. Columns follow `FIELDS`
    (`store.queries.EVENT_COLUMNS`).
    """

    #: The columns a row holds, in `store.queries.EVENT_COLUMNS` order.
    FIELDS = (
        "position", "tx_id", "event_id", "stream_id", "stream_version", "session_id", "run_id",
        "type", "recorded_at", "payload", "token_ids", "logprobs", "side_data",
    )  # fmt: skip

    position: int = _column(0, "The event's place in the log (unique, increasing with insertion).")
    tx_id: int = _column(
        1, "The id of the transaction that stored it; the log's order is (tx_id, position)."
    )
    stream_id: str = _column(3, "The stream the event belongs to.")
    stream_version: int = _column(4, "The event's number within its stream, from 1.")
    session_id: str | None = _column(5, "The session (agent episode) the event belongs to, if any.")
    run_id: str | None = _column(6, "The run the event belongs to, if any.")
    type: str = _column(
        7, "An `EventType` value (a str enum compares equal), or a newer type as text."
    )
    recorded_at: datetime = _column(
        8, "When the database stored the event (its transaction's start)."
    )
    packed_token_ids: bytes | None = _column(
        10, "Token ids as stored (little-endian int32 bytes), undecoded."
    )
    packed_logprobs: bytes | None = _column(
        11, "Logprobs as stored (little-endian float32 bytes), undecoded."
    )
    packed_side_data: bytes | None = _column(
        12, "Side-data arrays as stored (`store.side_data`), described by the payload."
    )
    #: The event's JSON payload, parsed on first access.
    payload = _ParsedPayload()

    @property
    def event_id(self) -> uuid.UUID:
        """The id the writer gave the event (its idempotency key)."""
        value = self[2]
        return value if type(value) is uuid.UUID else uuid.UUID(str(value))

    @property
    def token_ids(self) -> TokenIds | None:
        """Token ids as int32, or None when the event carries none."""
        return decode_token_ids(self[10])

    @property
    def logprobs(self) -> Logprobs | None:
        """Logprobs as float32 (one per token id), or None."""
        return decode_logprobs(self[11])

    @property
    def n_tokens(self) -> int:
        """How many token ids the event carries."""
        data = self[10]
        return 0 if data is None else len(data) // 4

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RecordedEvent):
            return NotImplemented
        return self.position == other.position and self.event_id == other.event_id

    def __hash__(self) -> int:
        return hash(self.position)

    def __repr__(self) -> str:
        return (
            f"RecordedEvent(position={self.position}, type={self.type!r}, "
            f"stream_id={self.stream_id!r}, stream_version={self.stream_version}, "
            f"session_id={self.session_id!r}, n_tokens={self.n_tokens})"
        )


def check_stream_id(stream_id: str) -> None:
    """Refuse stream ids the log cannot hold or that are surely mistakes."""
    if not isinstance(stream_id, str) or not stream_id:
        raise BadEvent(f"stream_id must be a non-empty string, got {stream_id!r}")
    if len(stream_id) > MAX_ID_LENGTH or "\x00" in stream_id:
        raise BadEvent(f"stream_id must be at most {MAX_ID_LENGTH} characters, without NUL")
