"""Per-token side data: named, typed arrays beside the tokens (a teacher's logprobs, its top-k,
MoE routed experts), recorded once and immutable like every other fact.

One channel, two attachments (`docs/architecture.md`, "Per-token side data"):

- **to a turn**: what the engine returned with a completion (`side_data_recorded`, in the
  request's stream, written by the proxy). The projection places it in each sample at the
  positions its turn contributed (`samples.side` / `samples.side_data`).
- **to a sample**: derived later by a scorer (`sample_scored`, in the sample's own stream
  `sample-<id>`), aligned with the sample's generated tokens (loss mask 1, in order), with the
  hash of the token ids it scored. A failure is a fact too (`scoring_failed`). Readers align it
  with `token_ids` when they read (`aligned`): a score never rewrites a sample.

An event's arrays travel packed in its `side_data` column, one after the other, little-endian,
each described by an `ArraySpec` (name, dtype, shape, offset, bytes) in the payload: the log
stays one table, and a new kind of side data needs a name, not a column.

Aligned with a sample's `token_ids`, a position without a value holds `ABSENT`: NaN for
floats, the dtype's largest value for unsigned ids (chosen so that no real id reaches it).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import asyncpg
import numpy as np
import numpy.typing as npt
import orjson

from trajstore.store import payloads, queries
from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.errors import BadEvent
from trajstore.store.events import EventType, NewEvent, RecordedEvent
from trajstore.store.eventstore import EventStore
from trajstore.store.payloads import ArraySpec, SampleScored, ScoringFailed

#: The kinds of side data trajstore knows how to read (a kind is a name: others may come).
TEACHER_LOGPROBS = "teacher_logprobs"
TEACHER_TOPK = "teacher_topk"
ROUTED_EXPERTS = "routed_experts"

#: The array names of each kind's events.
LOGPROBS, TOPK_IDS, TOPK_LOGPROBS, EXPERTS = "logprobs", "topk_ids", "topk_logprobs", "experts"

_DTYPES = {"uint8", "uint16", "int32", "float16", "float32"}

_SCORE_NAMESPACE = uuid.UUID("0b7d3f7e-2a4c-4e2b-9b0e-39a1d2c5e7f4")


def sample_stream(sample_id: uuid.UUID | str) -> str:
    """The stream of a sample's derived facts (every scorer's scores and failures)."""
    return f"sample-{sample_id}"


def score_event_id(
    sample_id: uuid.UUID | str, kind: str, source: str, attempt: int = 0
) -> uuid.UUID:
    """Deterministic: scoring the same sample for the same kind and source again (a restart,
    a retried batch) appends the same event, which the log stores once (`EventStore.append`).
    A deliberate re-score passes a new `attempt`."""
    return uuid.uuid5(_SCORE_NAMESPACE, f"{sample_id}/{kind}/{source}/{attempt}")


def tokens_sha256(token_bytes: bytes) -> str:
    """The hash a score carries of the packed token ids it scored."""
    return hashlib.sha256(token_bytes).hexdigest()


def narrowest_uint(largest: int) -> np.dtype[Any]:
    """The narrowest unsigned dtype that holds ids up to `largest` and still has `ABSENT`
    (its own largest value) free."""
    for dtype in (np.uint8, np.uint16):
        if largest < np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int32)


def absent(dtype: np.dtype[Any]) -> Any:
    """The fill value of positions without data: NaN for floats, the dtype's largest value."""
    if dtype.kind == "f":
        return np.nan
    return np.iinfo(dtype).max


def pack(arrays: Mapping[str, npt.ArrayLike]) -> tuple[list[ArraySpec], bytes]:
    """Arrays (first axis: tokens) as the specs a payload lists and the bytes of `side_data`."""
    specs: list[ArraySpec] = []
    chunks: list[bytes] = []
    offset = 0
    for name, values in arrays.items():
        array = np.asarray(values)
        if array.dtype.name not in _DTYPES:
            raise BadEvent(f"side array {name!r} has dtype {array.dtype}; one of {sorted(_DTYPES)}")
        if array.ndim == 0:
            raise BadEvent(f"side array {name!r} needs a token axis")
        data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        specs.append(
            ArraySpec(
                name=name,
                dtype=array.dtype.name,  # type: ignore[arg-type]  # checked above
                shape=list(array.shape),
                offset=offset,
                nbytes=len(data),
            )
        )
        chunks.append(data)
        offset += len(data)
    return specs, b"".join(chunks)


def unpack(specs: Iterable[ArraySpec | Mapping[str, Any]], data: bytes | None) -> dict[str, Any]:
    """The arrays an event's payload describes, as read-only numpy views of its bytes."""
    out: dict[str, Any] = {}
    buffer = data or b""
    for raw in specs:
        spec = raw if isinstance(raw, ArraySpec) else ArraySpec.model_validate(raw)
        dtype = np.dtype(spec.dtype).newbyteorder("<")
        if spec.offset + spec.nbytes > len(buffer) or spec.nbytes != dtype.itemsize * int(
            np.prod(spec.shape)
        ):
            raise BadEvent(f"side array {spec.name!r} does not fit the event's side_data bytes")
        flat = np.frombuffer(buffer, dtype=dtype, count=spec.nbytes // dtype.itemsize,
                             offset=spec.offset)  # fmt: skip
        out[spec.name] = flat.reshape(spec.shape)
    return out


@dataclass(frozen=True)
class SideArrays:
    """One kind of side data from one source, aligned with a sample's `token_ids`."""

    kind: str
    source: str
    arrays: dict[str, Any]  #: name -> array whose first axis is the sample's tokens


def aligned_score(
    payload: SampleScored, data: bytes | None, token_bytes: bytes, loss_mask: npt.NDArray[Any]
) -> SideArrays:
    """A `sample_scored` fact spread over the sample's tokens: its values at the generated
    positions, `absent` elsewhere. `BadEvent` when it scored other tokens (a rebuilt sample)."""
    if payload.tokens_sha256 != tokens_sha256(token_bytes):
        raise BadEvent(
            f"the {payload.kind} of {payload.source!r} scored other tokens than sample "
            f"{payload.sample_id} holds now (rebuilt since?): score it again"
        )
    generated = np.flatnonzero(np.asarray(loss_mask) == 1)
    arrays = {}
    for name, values in unpack(payload.arrays, data).items():
        if len(values) != len(generated):
            raise BadEvent(
                f"{payload.kind} array {name!r} has {len(values)} rows for "
                f"{len(generated)} generated tokens"
            )
        full = np.full((len(loss_mask), *values.shape[1:]), absent(values.dtype), values.dtype)
        full[generated] = values
        arrays[name] = full
    return SideArrays(payload.kind, payload.source, arrays)


def latest(
    facts: Sequence[tuple[SampleScored, bytes | None]],
) -> list[tuple[SampleScored, bytes | None]]:
    """The last score per (kind, source), facts given in log order (a re-score wins)."""
    by_key: dict[tuple[str, str], tuple[SampleScored, bytes | None]] = {}
    for payload, data in facts:
        by_key[payload.kind, payload.source] = (payload, data)
    return list(by_key.values())


def scored_event(
    *,
    sample_id: uuid.UUID | str,
    session_id: str,
    run_id: str | None,
    source: str,
    token_bytes: bytes,
    loss_mask: npt.NDArray[Any],
    behaviour_logprobs: npt.NDArray[Any],
    arrays: Mapping[str, npt.NDArray[Any]],
    kind: str = TEACHER_LOGPROBS,
    model: str | None = None,
    top_k: int = 0,
    attempt: int = 0,
) -> NewEvent:
    """The `sample_scored` fact of a scorer's arrays for a sample's generated tokens (one row
    each, in order), with its deterministic event id (`score_event_id`) and the means SQL reads
    (teacher logprob, behaviour - teacher)."""
    generated = np.asarray(loss_mask) == 1
    n = int(generated.sum())
    for name, values in arrays.items():
        if len(values) != n:
            raise BadEvent(f"{name} has {len(values)} rows for {n} generated tokens")
    mean_logprob = mean_kl = None
    if LOGPROBS in arrays and n:
        teacher = np.asarray(arrays[LOGPROBS], np.float64)
        behaviour = np.asarray(behaviour_logprobs, np.float64)[generated]
        mean_logprob = float(teacher.mean())
        both = np.isfinite(behaviour) & np.isfinite(teacher)
        mean_kl = float((behaviour - teacher)[both].mean()) if both.any() else None
    specs, data = pack(arrays)
    payload = SampleScored(
        sample_id=str(sample_id),
        kind=kind,
        source=source,
        model=model,
        n_tokens=n,
        tokens_sha256=tokens_sha256(token_bytes),
        top_k=top_k,
        mean_logprob=mean_logprob,
        mean_reverse_kl=mean_kl,
        arrays=specs,
    )
    return NewEvent(
        EventType.SAMPLE_SCORED,
        session_id=session_id,
        run_id=run_id,
        payload=payload,
        side_data=data,
        event_id=score_event_id(sample_id, kind, source, attempt),
    )


def failed_event(
    *,
    sample_id: uuid.UUID | str,
    session_id: str,
    run_id: str | None,
    source: str,
    reason: str,
    message: str,
    kind: str = TEACHER_LOGPROBS,
) -> NewEvent:
    """The `scoring_failed` fact: this scorer could not score this sample, and why."""
    payload = ScoringFailed(
        sample_id=str(sample_id), kind=kind, source=source, reason=reason, message=message
    )
    return NewEvent(EventType.SCORING_FAILED, session_id=session_id, run_id=run_id, payload=payload)


@dataclass
class SampleFacts:
    """What scorers recorded about one sample: the latest score per (kind, source), and the
    failures (in log order)."""

    scores: list[tuple[SampleScored, bytes | None]]
    failures: list[ScoringFailed]


async def read_sample_facts(
    source: EventStore | asyncpg.Connection, sample_ids: Iterable[uuid.UUID | str]
) -> dict[uuid.UUID, SampleFacts]:
    """The derived facts of these samples (one indexed read): sample id -> its facts."""
    streams = sorted({sample_stream(s) for s in sample_ids})
    if not streams:
        return {}
    found: dict[uuid.UUID, SampleFacts] = {}
    async with AsyncExitStack() as stack:
        if isinstance(source, EventStore):
            await stack.enter_async_context(unavailable_as_store_error())
            conn: asyncpg.Connection = await stack.enter_async_context(source.pool.acquire())
        else:
            conn = source
        events = await conn.fetch(queries.READ_SAMPLE_FACTS, streams, record_class=RecordedEvent)
    for event in events:
        if event.type not in (EventType.SAMPLE_SCORED, EventType.SCORING_FAILED):
            continue  # a newer kind of derived fact
        fact = payloads.load(event.type, event.payload)
        assert isinstance(fact, SampleScored | ScoringFailed)
        facts = found.setdefault(uuid.UUID(fact.sample_id), SampleFacts([], []))
        if isinstance(fact, SampleScored):
            facts.scores.append((fact, event.packed_side_data))
        else:
            facts.failures.append(fact)
    for facts in found.values():
        facts.scores = latest(facts.scores)
    return found


def turn_arrays(side: Any, data: bytes | None) -> list[SideArrays]:
    """A sample row's turn-level side data (`samples.side`, `samples.side_data`), by kind and
    source, already aligned with its tokens by the projection."""
    if not side:
        return []
    specs = side if isinstance(side, list) else orjson.loads(side)
    grouped: dict[tuple[str, str], dict[str, Any]] = {}
    values = unpack(specs, data)
    for spec in specs:
        grouped.setdefault((spec["kind"], spec.get("source") or ""), {})[spec["name"]] = values[
            spec["name"]
        ]
    return [SideArrays(kind, source, arrays) for (kind, source), arrays in grouped.items()]


def sample_arrays(
    token_bytes: bytes,
    loss_mask: npt.NDArray[Any],
    side: Any,
    side_bytes: bytes | None,
    facts: SampleFacts | None,
) -> list[SideArrays]:
    """Every kind of side data of one sample, aligned with its `token_ids`: the turns' (from
    its row) and the scorers' latest (from `read_sample_facts`)."""
    out = turn_arrays(side, side_bytes)
    for payload, data in facts.scores if facts else []:
        out.append(aligned_score(payload, data, token_bytes, loss_mask))
    return out


#: The smallest sample id: where a scorer's walk over the samples starts.
FIRST = uuid.UUID(int=0)


async def unscored_samples(
    reader: EventStore | asyncpg.Connection,
    runs: Sequence[str] | None,
    *,
    kind: str,
    source: str,
    after: uuid.UUID = FIRST,
    limit: int = 256,
) -> list[asyncpg.Record]:
    """Samples (id, session, run, packed tokens, mask, behaviour logprobs) of `runs` (None:
    all) that `source` has not scored for `kind`, by id after `after`: what a scorer does next.
    A sample scored in the meantime is left out, so a restarted scorer scores nothing twice."""
    rows: list[asyncpg.Record] = await reader.fetch(
        queries.UNSCORED_SAMPLES, list(runs) if runs else None, kind, source, after, limit
    )
    return rows
