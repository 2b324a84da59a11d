"""Typed, versioned event payloads: the event contract as code.

Every event type has one payload class here, a frozen pydantic model with a `schema_version`.
Writers build the model (`NewEvent(type, payload=Model(...))` or `dump(model)`); readers get it
back typed with `load(event_type, raw)`, which reads every shape the log has ever held: a payload
stored at an older version goes through the upcasters registered for its type, one version at a
time, before it is validated as today's model.

The stored JSON carries the version under `VERSION_KEY` when it is above 1, so the payloads of
releases written before versions existed (no key) read as version 1. Unknown fields are kept
(`extra="allow"`): a reader never drops what a newer writer added. A payload is stored with the
fields its writer set, None included, and without the defaults it left alone (so today's JSON is
what the recorder wrote before the contract was code, and the SQL views read it unchanged).

    raw dict ──upcast v1→v2→…→current──▶ model_validate ──▶ typed payload

The contract itself, one class per event type, is declared by concept beside this module:
`store.payloads_session` (a session's own facts and the trainer's steps) and
`store.payloads_request` (one model request's events); `store.events` imports them, so every
reader of the store has them registered. `python -m trajstore.store.catalogue` prints them as the
catalogue docs/architecture.md holds (`store.catalogue`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Literal, Self, TypeVar

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

    @classmethod
    def read(cls, raw: Mapping[str, Any]) -> Self:
        """A stored payload of this class's event type, typed (`load`)."""
        payload = load(cls.event_type, raw)
        if not isinstance(payload, cls):
            raise BadEvent(f"{cls.event_type} is declared as {type(payload).__name__}")
        return payload


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


def stored(cls: type[BaseModel], **fields: Any) -> dict[str, Any]:
    """What `dump(cls(**fields))` stores, built without a model: for the recorder, which writes
    several payloads per request (one per 16 generated tokens), where building and dumping
    models cost its recorded answer about a quarter more CPU (`benchmarks/proxy_costs.py`).
    An undeclared field is refused, as a typo would otherwise be stored as an unknown one;
    parts may be given as models or as their stored form. Readers always validate (`load`).
    Only the fields whose type can hold a part are walked, as `dump` does: a request's body of
    thousands of messages is stored as given, not copied value by value."""
    declared, nested, version = _SHAPES.get(cls) or _shape(cls)
    if not declared.issuperset(fields):
        raise TypeError(f"{cls.__name__} declares no {sorted(set(fields) - declared)}")
    raw = fields  # a new dict per call (keyword arguments): ours to fill
    for name in nested.intersection(fields):
        raw[name] = _plain(raw[name])
    if version > 1:
        raw[VERSION_KEY] = version
    return raw


#: model class -> (its field names, those that can hold a part, the version it stores), for
#: `stored`: looked up once per class, not per payload.
_SHAPES: dict[type[BaseModel], tuple[frozenset[str], frozenset[str], int]] = {}


def _shape(cls: type[BaseModel]) -> tuple[frozenset[str], frozenset[str], int]:
    version = cls.schema_version if issubclass(cls, Payload) else 1
    shape = _SHAPES[cls] = (frozenset(cls.model_fields), _nested(cls), version)
    return shape


def dump(payload: BaseModel) -> dict[str, Any]:
    """The JSON-ready dict stored for `payload`, with its version when above 1: the fields its
    writer set (None included) and the unknown ones it carries, not the defaults it left. A
    part of a payload (a nested model) dumps the same way, without a version."""
    raw = _fields(payload)
    if isinstance(payload, Payload) and payload.schema_version > 1:
        raw[VERSION_KEY] = payload.schema_version
    return raw


def _fields(model: BaseModel) -> dict[str, Any]:
    # The field values as they are (no copy of a body of thousands of messages: orjson writes
    # them); pydantic's model_dump would walk and copy every value, several times the cost of
    # the whole event on the recorder's path. Only fields that can hold a model are converted.
    given = model.__pydantic_fields_set__
    raw = {name: value for name, value in model.__dict__.items() if name in given}
    for name in _nested(type(model)) & given:
        raw[name] = _plain(raw[name])
    if model.__pydantic_extra__:
        raw.update(model.__pydantic_extra__)
    return raw


#: model class -> the names of its fields whose type holds a model (dumped field by field).
_NESTED: dict[type[BaseModel], frozenset[str]] = {}


def _nested(cls: type[BaseModel]) -> frozenset[str]:
    names = _NESTED.get(cls)
    if names is None:
        fields = cls.model_fields.items()
        names = _NESTED[cls] = frozenset(n for n, f in fields if _holds_model(f.annotation))
    return names


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(arg) for arg in getattr(annotation, "__args__", ()))


#: Values `_plain` returns as they are, by exact type: looked up first, as `isinstance` against
#: `BaseModel` (an ABC) costs about 0.2 us a value, and most values of a payload are scalars.
_LEAVES = frozenset({str, int, float, bool, type(None)})


def _plain(value: Any) -> Any:
    kind = type(value)
    if kind in _LEAVES:
        return value
    if kind is dict:
        return {key: _plain(item) for key, item in value.items()}
    if kind is list:
        return [_plain(item) for item in value]
    if isinstance(value, BaseModel):
        return _fields(value)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


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


def upcast(event_type: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A stored payload as today's contract reads it, as JSON (for views that show payloads
    whole, such as a timeline); a type this release does not declare stays as stored."""
    if event_type not in PAYLOADS:
        return dict(raw)
    return dump(load(event_type, raw))


# -- policy versions over a turn's tokens, and the switches that change them (issue 44) ----------


class VersionSpan(BaseModel):
    """Which policy version generated a run of a choice's tokens: `[start, end)` over its
    generated tokens, in order. A turn switched mid-generation has several (`proxy.switching`)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    version: str
    start: int
    end: int


@payload_type
class PolicyVersionSet(Payload):
    """The admin named the policy version engines serve, outside a switch
    (`POST /admin/engines/policy-version`, after a weight sync the proxy did not run): every
    turn those engines start from now on records `version`."""

    event_type: ClassVar[str] = "policy_version_set"
    version: str
    engines: list[str]  #: the engines it names (their URLs)
    previous: dict[str, str] = {}  #: engine URL -> the version it served before
    set_at: float  #: the proxy's clock


class _Switch(Payload):
    """What every event of one weight switch says."""

    switch_id: str
    version: str  #: the policy version going live
    engines: list[str]  #: the engines switching (their URLs)
    checkpoint: str | None = None  #: where the weights are (a path or URI), when told
    began_at: float  #: the proxy's clock when the switch began


@payload_type
class PolicySwitchBegan(_Switch):
    """Engines begin to load new weights: their turns in flight are cut where the proxy
    received them, and their new requests are held until the switch ends."""

    event_type: ClassVar[str] = "policy_switch_began"
    interrupted: int = 0  #: turns in flight cut at the switch, to continue on the new version


@payload_type
class PolicySwitchLive(_Switch):
    """The new weights serve: every token generated on these engines from now on is `version`'s."""

    event_type: ClassVar[str] = "policy_switch_live"
    live_at: float
    previous: dict[str, str] = {}  #: engine URL -> the version it served before


@payload_type
class PolicySwitchFailed(_Switch):
    """The switch was given up (the weights failed to load, or no word came in time): the
    engines serve the version they served before, and what was held goes on there."""

    event_type: ClassVar[str] = "policy_switch_failed"
    failed_at: float
    reason: str


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
