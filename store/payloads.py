"""Typed, versioned event payloads: the event contract as code.

Every event type has one payload class here, a frozen pydantic model with a `schema_version`.
Writers build the model (`NewEvent(type, payload=Model(...))` or `dump(model)`); readers get it
back typed with `load(event_type, raw)`, which reads every shape the log has ever held: a payload
stored at an older version goes through the upcasters registered for its type, one version at a
time, before it is validated as today's model.

The stored JSON carries the version under `VERSION_KEY` when it is above 1, so the payloads of
releases written before versions existed (no key) read as version 1. Unknown fields are kept
(`extra="allow"`): a reader never drops what a newer writer added.

    raw dict ──upcast v1→v2→…→current──▶ model_validate ──▶ typed payload
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from trajstore.store.errors import BadEvent

#: Where a payload's schema version is stored in its JSON (absent means 1).
VERSION_KEY = "v"

#: One upcaster turns the raw payload of version N into that of version N + 1.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class Payload(BaseModel):
    """The base of every event payload: frozen, unknown fields kept, versioned."""

    model_config = ConfigDict(frozen=True, extra="allow")

    #: The event type (`store.events.EventType` value) this payload belongs to.
    event_type: ClassVar[str]
    #: Today's schema version; raise it with an upcaster from the version before.
    schema_version: ClassVar[int] = 1


#: event type -> its payload class.
PAYLOADS: dict[str, type[Payload]] = {}
#: (event type, version N) -> the upcaster from N to N + 1.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}

P = TypeVar("P", bound=type[Payload])


def payload_type(cls: P) -> P:
    """Register `cls` as the one payload class of `cls.event_type` (a class decorator)."""
    if cls.event_type in PAYLOADS:
        raise TypeError(f"{cls.event_type!r} already has payload {PAYLOADS[cls.event_type]}")
    PAYLOADS[cls.event_type] = cls
    return cls


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    """Register a function reading version `from_version` of `event_type` as the next one."""

    def register(function: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = function
        return function

    return register


def dump(payload: Payload) -> dict[str, Any]:
    """The JSON-ready dict stored for `payload`, with its version when above 1."""
    raw = payload.model_dump(mode="json", exclude_none=True)
    if payload.schema_version > 1:
        raw[VERSION_KEY] = payload.schema_version
    return raw


def load(event_type: str, raw: Mapping[str, Any]) -> Payload:
    """The typed payload of a stored event, upcast from whatever version it was written at."""
    cls = PAYLOADS.get(event_type)
    if cls is None:
        raise BadEvent(f"no payload type is declared for event type {event_type!r}")
    data = dict(raw)
    version = int(data.pop(VERSION_KEY, 1))
    if version > cls.schema_version:
        raise BadEvent(
            f"{event_type} payload is version {version}, newer than this release's "
            f"{cls.schema_version}: upgrade trajstore to read it"
        )
    while version < cls.schema_version:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise BadEvent(f"no upcaster reads {event_type} version {version}")
        data = step(data)
        version += 1
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise BadEvent(f"{event_type} payload does not match its schema: {exc}") from exc


# -- per-token side data (`store.side_data`) ----------------------------------------------------
#: The element types a side-data array may have (little-endian), narrowest first per kind.
SideDtype = Literal["uint8", "uint16", "int32", "float16", "float32"]


class ArraySpec(BaseModel):
    """One array packed in an event's `side_data` bytes: its name, element type, shape (the
    first axis is the tokens), and where its bytes lie in the column."""

    model_config = ConfigDict(frozen=True, extra="allow")

    name: str
    dtype: SideDtype
    shape: list[int]
    offset: int
    nbytes: int


@payload_type
class SideDataRecorded(Payload):
    """Per-token arrays an engine returned with a turn's completion (e.g. MoE routed experts),
    aligned with the tokens of choice `choice` from token `start` on; recorded by the proxy in
    the request's stream."""

    event_type: ClassVar[str] = "side_data_recorded"

    request_id: str
    choice: int = 0
    #: Which channel: `routed_experts`, ...
    kind: str
    #: Who produced it (the engine's name).
    source: str | None = None
    start: int = 0
    n_tokens: int
    arrays: list[ArraySpec]


@payload_type
class SampleScored(Payload):
    """A scorer's per-token arrays for one projected sample, aligned with the sample's
    generated tokens (loss mask 1, in order): a teacher's logprob of each, its top-k.

    Derived, never an update: a re-score is another event; readers take the latest per
    (sample, kind, source). `tokens_sha256` is the hash of the sample's packed token ids when
    scored, so a reader never aligns a score with other tokens."""

    event_type: ClassVar[str] = "sample_scored"

    sample_id: str
    #: Which channel: `teacher_logprobs` (with `teacher_topk` arrays when top-k was asked).
    kind: str
    #: The scorer's name (a teacher), chosen by whoever runs it: several sit side by side.
    source: str
    model: str | None = None
    n_tokens: int
    tokens_sha256: str
    top_k: int = 0
    #: Over the scored tokens: the teacher's mean logprob, and the mean of behaviour - teacher
    #: (the per-token reverse KL estimate on sampled tokens): for SQL without decoding arrays.
    mean_logprob: float | None = None
    mean_reverse_kl: float | None = None
    arrays: list[ArraySpec]


@payload_type
class ScoringFailed(Payload):
    """A scorer could not score a sample: the reason (a short code) and the engine's words."""

    event_type: ClassVar[str] = "scoring_failed"

    sample_id: str
    kind: str
    source: str
    #: vocabulary | too_long | engine | misaligned
    reason: str
    message: str
