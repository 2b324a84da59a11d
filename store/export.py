"""Export samples to Parquet (pyarrow, list columns) or JSON Lines, one record per sample.

A record is what a trainer outside trajstore needs: token ids, loss mask, behaviour logprobs,
reward, the conversation (the messages of the sample's last request and the model's reply),
lengths, tool turns, finish reason, and provenance (run, session, task, group, lineage with
its role and the lineage it forked from and where, branch, the requests it came from, engines,
policy versions, projection version, divergence). Parquet files read back with
`pandas.read_parquet` and `datasets.load_dataset("parquet", ...)`.

Images: the `images` column lists a sample's images in order, each with its sha256, source
(data or url), url, media type and the [start, end) of its placeholder ids in `token_ids`
(`store.samples`); the messages carry `trajstore-image:sha256:<hex>` in their place. With
`images_dir`, each data image the exported samples use is written there once, as a file named
by its sha256 (checked against the bytes); URL images are the URL's to fetch.

Side data (`store.side_data`): the `side_data` column lists a sample's per-token arrays, each
aligned with `token_ids` (first axis) and flattened row-major: its kind (`teacher_logprobs`,
`routed_experts`, ...), source (the teacher, the engine), name, dtype and shape; absent
positions hold NaN (floats; null in JSON) or the dtype's largest value (ids). A scorer's
failures are in the `scoring_failures` view, not here.

Samples are read from the served projection version in batches, so an export of any size runs
in bounded memory; `progress` is told how many records each batch wrote.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from trajstore.store import queries
from trajstore.store.archive import archived_requests
from trajstore.store.events import request_stream
from trajstore.store.eventstore import EventStore
from trajstore.store.payloads_request import CompletionFinished, RequestReceived
from trajstore.store.references import Messages
from trajstore.store.side_data import SampleFacts, read_sample_facts, sample_arrays

FORMATS = ("parquet", "jsonl")

_TOKENS = pa.list_(pa.int32())

#: One image of a sample (`store.samples`): start and end are null where it was not located.
IMAGE = pa.struct(
    [
        ("sha256", pa.string()),
        ("source", pa.string()),
        ("url", pa.string()),
        ("media_type", pa.string()),
        ("start", pa.int32()),
        ("end", pa.int32()),
        ("reason", pa.string()),  # why start and end are null
    ]
)

#: One per-token array of a sample (`store.side_data`), flattened row-major.
SIDE_ARRAY = pa.struct(
    [
        ("kind", pa.string()),
        ("source", pa.string()),
        ("name", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int32())),
        ("values", pa.list_(pa.float64())),  # float64 holds every dtype's values exactly
    ]
)

#: The Parquet schema; JSONL records carry the same fields.
SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("run_id", pa.string()),
        ("session_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("lineage", pa.int32()),  # which conversation of the session (`store.lineages`)
        ("role", pa.string()),  # its lineage's: main | subagent | side
        ("parent", pa.int32()),  # the lineage it forked from (null: a root)
        ("fork_at", pa.int32()),  # tokens it shares with that lineage
        ("branch", pa.int32()),
        ("alternative_of", pa.int32()),
        ("is_final", pa.bool_()),
        ("status", pa.string()),
        ("finish_reason", pa.string()),
        ("reward", pa.float64()),
        ("token_ids", _TOKENS),
        ("loss_mask", pa.list_(pa.uint8())),
        ("logprobs", pa.list_(pa.float32())),
        ("prompt_len", pa.int32()),
        ("response_len", pa.int32()),
        ("n_turns", pa.int32()),
        ("tool_turns", pa.int32()),
        ("messages", pa.string()),  # JSON: the last request's messages and the reply
        ("request_ids", pa.list_(pa.string())),
        ("engines", pa.list_(pa.string())),
        ("policy_versions", pa.list_(pa.string())),
        ("tags", pa.list_(pa.string())),
        ("divergence", pa.string()),  # JSON, or null for a session's first branch
        ("projection_version", pa.int32()),
        ("finished_at", pa.timestamp("us", tz="UTC")),
        ("images", pa.list_(IMAGE)),
        ("side_data", pa.list_(SIDE_ARRAY)),
    ]
)


async def count(store: EventStore, runs: list[str], statuses: list[str]) -> int:
    """How many samples an export with these filters writes."""
    return int(await store.pool.fetchval(queries.COUNT_EXPORT, runs or None, statuses or None))


async def records(
    store: EventStore,
    runs: list[str],
    statuses: list[str],
    batch_size: int = 500,
    archive: Path | None = None,
) -> AsyncIterator[list[dict[str, Any]]]:
    """The export's records, a batch at a time, in (run, session, lineage, branch) order; the
    messages of archived requests from `archive` (`_conversations`)."""
    after: tuple[str, str, int, int, str] = ("", "", -1, -1, "")
    while True:
        rows = await store.pool.fetch(
            queries.READ_EXPORT, runs or None, statuses or None, *after, batch_size
        )
        if not rows:
            return
        conversations = await _conversations(store, rows, archive)
        async with store.pool.acquire() as conn:
            facts = await read_sample_facts(conn, [row["sample_id"] for row in rows])
        yield [_record(row, conversations, facts.get(row["sample_id"])) for row in rows]
        last = rows[-1]
        after = (
            last["run_id"] or "", last["session_id"], last["lineage"], last["branch"],
            last["order_key"],
        )  # fmt: skip


async def _conversations(
    store: EventStore, rows: list[Any], archive: Path | None = None
) -> dict[str, Any]:
    """request id -> its whole messages followed by the model's reply (or prompt and text), for
    each row's last request. The requests of the rows' sessions are read in one pass (a sample's
    messages continue earlier requests of its session); with `archive` (a `trajstore archive`
    directory), those whose days were archived are read from it."""
    sessions = sorted({row["session_id"] for row in rows})
    streams = [request_stream(_last_request(row)) for row in rows]
    asked: dict[str, RequestReceived] = {}
    replies: dict[str, dict[str, Any]] = {}

    def take(stream_id: str, event_type: str, payload: dict[str, Any]) -> None:
        if event_type == "request_received":
            asked[stream_id] = RequestReceived.read(payload)
        else:
            finished = CompletionFinished.read(payload)
            reply = finished.choices[0].message if finished.choices else None
            if reply is not None:
                replies[stream_id] = reply

    for row in await store.pool.fetch(queries.READ_CONVERSATIONS, sessions, streams):
        take(row["stream_id"], row["event_type"], orjson.loads(row["payload"]))
    continued = (
        request_stream(received.messages_prefix.request_id)
        for received in asked.values()
        if received.messages_prefix is not None
    )
    if archive is not None and any(s not in asked for s in (*streams, *continued)):
        archived = await asyncio.to_thread(archived_requests, archive, sessions, streams)
        for stream_id, event_type, payload in archived:
            if stream_id not in asked or event_type != "request_received":
                take(stream_id, event_type, orjson.loads(payload))
    chains = Messages()
    for stream, received in asked.items():
        stored = received.body.get("messages")
        chains.add(stream.removeprefix("request-"), stored, received.messages_prefix)
    conversations: dict[str, Any] = {}
    for stream in streams:
        if stream not in asked:
            continue
        body = asked[stream].body
        messages = list(chains.whole(stream.removeprefix("request-")) or [])
        if "prompt" in body:  # the completions API: the prompt as a user turn
            messages.append({"role": "user", "content": body["prompt"]})
        if stream in replies:
            messages.append(replies[stream])
        conversations[stream.removeprefix("request-")] = messages
    return conversations


def _last_request(row: Any) -> str:
    return str(row["request_ids"][-1]) if row["request_ids"] else ""


def _side_data(row: Any, facts: SampleFacts | None) -> list[dict[str, Any]]:
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    return [
        {
            "kind": side.kind,
            "source": side.source or None,
            "name": name,
            "dtype": values.dtype.name,
            "shape": list(values.shape),
            "values": [None if v != v else v for v in values.astype(np.float64).ravel().tolist()],
        }
        for side in sample_arrays(row["token_ids"], mask, row["side"], row["side_data"], facts)
        for name, values in side.arrays.items()
    ]


def _record(row: Any, conversations: dict[str, Any], facts: SampleFacts | None) -> dict[str, Any]:
    return {
        "sample_id": str(row["sample_id"]),
        "run_id": row["run_id"],
        "session_id": row["session_id"],
        "task_id": row["task_id"],
        "group_id": row["group_id"],
        "lineage": row["lineage"],
        "role": row["role"],
        "parent": row["parent"],
        "fork_at": row["fork_at"],
        "branch": row["branch"],
        "alternative_of": row["alternative_of"],
        "is_final": row["is_final"],
        "status": row["status"],
        "finish_reason": row["finish_reason"],
        "reward": row["reward"],
        "token_ids": np.frombuffer(row["token_ids"], "<i4"),
        "loss_mask": np.frombuffer(row["loss_mask"], np.uint8),
        "logprobs": np.frombuffer(row["logprobs"], "<f4"),
        "prompt_len": row["prompt_len"],
        "response_len": row["response_len"],
        "n_turns": row["n_turns"],
        "tool_turns": row["tool_turns"],
        "messages": orjson.dumps(conversations.get(_last_request(row), [])).decode(),
        "request_ids": row["request_ids"],
        "engines": row["engines"],
        "policy_versions": row["policy_versions"],
        "tags": row["tags"],
        "divergence": None if row["divergence"] is None else bytes(row["divergence"]).decode(),
        "projection_version": row["projection_version"],
        "finished_at": row["finished_at"],
        "images": [] if row["images"] is None else orjson.loads(row["images"]),
        "side_data": _side_data(row, facts),
    }


async def write_images(
    store: EventStore, batch: list[dict[str, Any]], directory: Path, written: set[str]
) -> None:
    """Write the data images `batch` uses into `directory`, one file per sha256, named by it;
    those in `written` or already there are skipped. Bytes whose hash is not the one they were
    recorded under (a damaged log) raise `ValueError` rather than be written."""
    wanted: dict[str, str] = {}  # sha256 -> a session that recorded it
    for record in batch:
        for image in record["images"]:
            sha256 = image.get("sha256")
            if image.get("source") != "data" or not sha256 or sha256 in written:
                continue
            wanted.setdefault(sha256, record["session_id"])
    wanted = {s: session for s, session in wanted.items() if not _present(directory, s, written)}
    if not wanted:
        return
    rows = await store.pool.fetch(queries.READ_IMAGES, sorted(set(wanted.values())), sorted(wanted))
    for row in rows:
        _store_image(directory, row["sha256"], base64.b64decode(row["data"]))
        written.add(row["sha256"])


def _present(directory: Path, sha256: str, written: set[str]) -> bool:
    if (directory / sha256).exists():
        written.add(sha256)
        return True
    return False


def _store_image(directory: Path, sha256: str, data: bytes) -> None:
    """One image's file, whole or not at all (written aside, then renamed)."""
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"the image recorded as sha256 {sha256} has other bytes")
    directory.mkdir(parents=True, exist_ok=True)
    part = directory / f".{sha256}.part"
    part.write_bytes(data)
    part.replace(directory / sha256)


def _list_array(arrays: list[np.ndarray[Any, Any]], kind: pa.DataType) -> pa.Array:
    """A list column from numpy arrays, with one copy of the values (no Python lists)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=kind.value_type))


def _table(batch: list[dict[str, Any]]) -> pa.Table:
    columns = []
    for field in SCHEMA:
        values = [record[field.name] for record in batch]
        if field.name in ("token_ids", "loss_mask", "logprobs"):
            columns.append(_list_array(values, field.type))
        else:
            columns.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def _jsonl(record: dict[str, Any]) -> bytes:
    return orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


async def export(
    store: EventStore,
    out: Path,
    *,
    fmt: str = "parquet",
    runs: list[str] | None = None,
    statuses: list[str] | None = None,
    progress: Callable[[int], None] | None = None,
    images_dir: Path | None = None,
    archive: Path | None = None,
) -> int:
    """Write the selected samples to `out`; return how many records were written. With
    `images_dir`, also the bytes of their data images, one file per sha256 (`write_images`).
    With `archive` (a `trajstore archive` directory), the messages of samples whose days were
    archived come from it (the samples themselves stay in the database)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: use one of {', '.join(FORMATS)}")
    images_written: set[str] = set()
    written = 0
    writer: pq.ParquetWriter | None = None
    with out.open("wb") as sink:
        if fmt == "parquet":
            writer = pq.ParquetWriter(sink, SCHEMA)
        async for batch in records(store, runs or [], statuses or [], archive=archive):
            if images_dir is not None:
                await write_images(store, batch, images_dir, images_written)
            if writer is not None:
                writer.write_table(_table(batch))
            else:
                sink.write(b"".join(_jsonl(r) for r in batch))
            written += len(batch)
            if progress is not None:
                progress(len(batch))
        if writer is not None:
            writer.close()
    return written
