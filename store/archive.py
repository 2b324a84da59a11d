"""Retention without loss: whole days of the log to Parquet, verified, then detached and dropped.

`archive(store, before, out)` takes the partitions of `events` wholly before `before` (UTC) and:
1. refuses, before writing anything, if one holds an event of a session still active (created,
   never finished): its remaining events would be split between the archive and the log;
2. writes each to `out/<partition>.parquet` (every column, in log order) and computes a SHA-256
   of the file and one over its rows (`_row_digest`), from the rows as PostgreSQL sent them;
3. reads every file back and checks the file's digest, the rows' digest, the row count and the
   exact list of positions against the partition, then writes `manifest.json`;
4. only then, partition by partition in a transaction that first checks the partition still
   holds exactly what was written: seals its keys into `event_keys` if its day was not sealed
   yet, forgets them (except each stream's last version), detaches the partition and drops it
   (`keep`: detach only, keys kept, so it can be attached again).
Any failure before step 4 raises `ArchiveError` and leaves the log untouched.

Archived sessions stay readable: `archived_events` reads a session's events from the files and
`rebuild_archived_session` folds them (with any still in the log) into the session, its samples
and its timeline, exactly as the projector and `trajstore show` would from the log.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import asyncpg
import pyarrow as pa
import pyarrow.parquet as pq

from trajstore.store import keys, queries
from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.errors import ArchiveError, SessionNotFound
from trajstore.store.events import RecordedEvent
from trajstore.store.eventstore import EventStore
from trajstore.store.partitions import Partition, list_partitions
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import SessionRecord, rebuild_session
from trajstore.store.timeline import Entry, timeline

MANIFEST = "manifest.json"
FORMAT = 1
_ROWS_PER_GROUP = 20_000

#: The archive files' columns: `RecordedEvent.FIELDS` with the payload as JSON text.
ARROW_SCHEMA = pa.schema(
    [
        ("position", pa.int64()),
        ("tx_id", pa.uint64()),
        ("event_id", pa.string()),
        ("stream_id", pa.string()),
        ("stream_version", pa.int64()),
        ("session_id", pa.string()),
        ("run_id", pa.string()),
        ("event_type", pa.string()),
        ("recorded_at", pa.timestamp("us", tz="UTC")),
        ("payload", pa.string()),
        ("token_ids", pa.binary()),
        ("logprobs", pa.binary()),
        ("side_data", pa.binary()),
    ]
)


@dataclass(frozen=True)
class ArchivedPartition:
    """One archived partition, as the manifest records it."""

    name: str
    day: str
    file: str
    rows: int
    min_position: int
    max_position: int
    file_sha256: str
    rows_sha256: str
    bytes_in_database: int


@dataclass(frozen=True)
class ArchiveResult:
    """What `archive` did: the partitions written (and detached, and dropped unless kept)."""

    partitions: list[ArchivedPartition]
    dropped: bool


# -- writing -------------------------------------------------------------------------------------


def _canonical(row: Sequence[Any]) -> list[Any]:
    """A row as the archive stores it: uuid as text, the rest as PostgreSQL sent it."""
    values = list(row)
    values[2] = str(values[2])
    return values


def _row_digest(digest: Any, row: Sequence[Any]) -> None:
    """Feed one row, field by field and length-prefixed, to a running SHA-256 (one update a
    row: the per-field calls were most of an archive's time)."""
    parts = []
    for value in row:
        if value is None:
            parts.append(b"\x00")
            continue
        if isinstance(value, bytes):
            data = value
        elif isinstance(value, dt.datetime):
            data = value.astimezone(dt.UTC).isoformat().encode()
        else:
            data = str(value).encode()
        parts += (b"\x01", len(data).to_bytes(8, "little"), data)
    digest.update(b"".join(parts))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


async def export_partition(
    conn: asyncpg.Connection, partition: Partition, out: Path
) -> ArchivedPartition:
    """Write one partition to `out/<name>.parquet` (through a temporary name) and digest it."""
    path = out / f"{partition.name}.parquet"
    partial = path.with_suffix(".parquet.partial")
    digest = hashlib.sha256()
    rows, low, high = 0, 0, 0
    with pq.ParquetWriter(partial, ARROW_SCHEMA, compression="zstd") as writer:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            batch: list[list[Any]] = []
            # Rows in pages of a row group, not asyncpg's default 50 a round trip.
            cursor = conn.cursor(queries.read_partition(partition.name), prefetch=_ROWS_PER_GROUP)
            async for record in cursor:
                row = _canonical(record)
                _row_digest(digest, row)
                batch.append(row)
                low = row[0] if rows == 0 else min(low, row[0])
                high = max(high, row[0])
                rows += 1
                if len(batch) == _ROWS_PER_GROUP:
                    writer.write_table(_table(batch))
                    batch = []
            if batch or rows == 0:
                writer.write_table(_table(batch))
    os.replace(partial, path)
    return ArchivedPartition(
        name=partition.name,
        day=str(partition.day),
        file=path.name,
        rows=rows,
        min_position=low,
        max_position=high,
        file_sha256=_file_sha256(path),
        rows_sha256=digest.hexdigest(),
        bytes_in_database=partition.bytes,
    )


def _table(rows: list[list[Any]]) -> pa.Table:
    columns: list[Sequence[Any]] = [[] for _ in ARROW_SCHEMA]
    if rows:
        columns = list(zip(*rows, strict=True))
    return pa.Table.from_arrays(
        [
            pa.array(list(col), type=field.type)
            for col, field in zip(columns, ARROW_SCHEMA, strict=True)
        ],
        schema=ARROW_SCHEMA,
    )


# -- verifying -----------------------------------------------------------------------------------


def _file_rows(path: Path) -> Iterable[list[Any]]:
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_ROWS_PER_GROUP):
        yield from (list(row.values()) for row in batch.to_pylist())


def verify_file(out: Path, entry: ArchivedPartition, positions: list[int]) -> None:
    """Check that the file reads back as exactly the partition: same file digest, rows digest,
    count and positions; `ArchiveError` otherwise."""
    path = out / entry.file
    try:
        if _file_sha256(path) != entry.file_sha256:
            raise ArchiveError(f"{path} changed after it was written; nothing was dropped")
        digest = hashlib.sha256()
        read_positions = []
        for row in _file_rows(path):
            _row_digest(digest, row)
            read_positions.append(row[0])
    except (OSError, pa.ArrowException) as exc:
        raise ArchiveError(f"{path} does not read back ({exc}); nothing was dropped") from exc
    if digest.hexdigest() != entry.rows_sha256:
        raise ArchiveError(f"{path} reads back different rows; nothing was dropped")
    if sorted(read_positions) != positions or len(read_positions) != entry.rows:
        raise ArchiveError(
            f"{path} holds {len(read_positions)} events, the partition {len(positions)} "
            "(or other positions); nothing was dropped"
        )


# -- the whole run -------------------------------------------------------------------------------


async def archive(
    store: EventStore, before: dt.date, out: Path, *, keep: bool = False
) -> ArchiveResult:
    """Archive the partitions of `events` wholly before `before` (UTC) to `out`, verify the
    files, then detach (and unless `keep`, drop) them. See the module's docstring."""
    cutoff = dt.datetime.combine(before, dt.time(), dt.UTC)
    async with unavailable_as_store_error(), store.pool.acquire() as conn:
        targets = [p for p in await list_partitions(conn) if p.end is not None and p.end <= cutoff]
        if not targets:
            return ArchiveResult([], dropped=False)
        for partition in targets:
            active = [r[0] for r in await conn.fetch(queries.active_sessions_in(partition.name))]
            if active:
                raise ArchiveError(
                    f"refused: {partition.name} holds events of {len(active)} session(s) still "
                    f"active (created, never finished), e.g. {', '.join(active[:3])}; finish "
                    "them (or let the proxy's reaper) and archive again. Nothing was written."
                )
        try:
            await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
            entries = [await export_partition(conn, p, out) for p in targets]
        except OSError as exc:
            raise ArchiveError(f"cannot write the archive to {out}: {exc}") from exc
        for entry in entries:
            positions = [r[0] for r in await conn.fetch(queries.partition_positions(entry.name))]
            verify_file(out, entry, positions)
        _write_manifest(out, before, entries)
        for entry in entries:
            await _detach(conn, entry, keep=keep)
    return ArchiveResult(entries, dropped=not keep)


async def _detach(conn: asyncpg.Connection, entry: ArchivedPartition, *, keep: bool) -> None:
    async with conn.transaction():
        # DETACH takes ACCESS EXCLUSIVE on events: wait briefly, never queue appends for long.
        await conn.execute("SET LOCAL lock_timeout = '5s'")
        await conn.execute(f"LOCK TABLE {entry.name} IN ACCESS EXCLUSIVE MODE")
        positions = [r[0] for r in await conn.fetch(queries.partition_positions(entry.name))]
        if len(positions) != entry.rows or (positions and positions[-1] != entry.max_position):
            raise ArchiveError(f"{entry.name} changed while it was archived; run the archive again")
        # Its keys to event_keys first (the day may not be sealed yet): detached, its events are
        # no longer in `events` for the uniqueness checks to find.
        await conn.execute(keys.seal_keys_of(entry.name))
        if not keep:
            await conn.execute(keys.forget_keys_of(entry.name))
        await conn.execute(f"ALTER TABLE events DETACH PARTITION {entry.name}")
        if not keep:
            await conn.execute(f"DROP TABLE {entry.name}")


def _write_manifest(out: Path, before: dt.date, entries: list[ArchivedPartition]) -> None:
    """Add the entries to `out/manifest.json` (earlier runs' entries stay), atomically."""
    path = out / MANIFEST
    manifest: dict[str, Any] = {"format": FORMAT, "partitions": []}
    if path.exists():
        manifest = json.loads(path.read_text())
    names = {e.name for e in entries}
    kept = [p for p in manifest["partitions"] if p["name"] not in names]
    manifest["partitions"] = sorted([*kept, *map(asdict, entries)], key=lambda p: p["name"])
    manifest["updated_at"] = dt.datetime.now(dt.UTC).isoformat()
    manifest["last_before"] = before.isoformat()
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, path)


# -- reading back --------------------------------------------------------------------------------


class ArchivedEvent(tuple):  # type: ignore[type-arg]
    """An event read back from an archive, with `RecordedEvent`'s attributes (a row in the same
    column order: `RecordedEvent.FIELDS`), so the session folds read it unchanged."""

    FIELDS = RecordedEvent.FIELDS
    position = RecordedEvent.position
    tx_id = RecordedEvent.tx_id
    stream_id = RecordedEvent.stream_id
    stream_version = RecordedEvent.stream_version
    session_id = RecordedEvent.session_id
    run_id = RecordedEvent.run_id
    type = RecordedEvent.type
    recorded_at = RecordedEvent.recorded_at
    packed_token_ids = RecordedEvent.packed_token_ids
    packed_logprobs = RecordedEvent.packed_logprobs
    packed_side_data = RecordedEvent.packed_side_data
    payload = RecordedEvent.__dict__["payload"]
    event_id = RecordedEvent.event_id
    token_ids = RecordedEvent.token_ids
    logprobs = RecordedEvent.logprobs
    n_tokens = RecordedEvent.n_tokens


def read_manifest(out: Path) -> dict[str, Any]:
    """The archive's manifest; `ArchiveError` when `out` holds none."""
    try:
        manifest: dict[str, Any] = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise ArchiveError(f"{out} holds no readable trajstore archive ({exc})") from exc
    return manifest


def archived_events(out: Path, session_id: str) -> list[RecordedEvent]:
    """A session's archived events, in log order (typed as `RecordedEvent`, which they mimic)."""
    events = []
    for entry in read_manifest(out)["partitions"]:
        table = pq.read_table(out / entry["file"], filters=[("session_id", "=", session_id)])
        for row in table.to_pylist():
            values = list(row.values())
            values[2] = uuid.UUID(values[2])
            # Archives written before side data existed have one column fewer.
            values += [None] * (len(ARROW_SCHEMA) - len(values))
            events.append(ArchivedEvent(values))
    events.sort(key=lambda e: (e.tx_id, e.position))
    return cast(list[RecordedEvent], events)


def archived_requests(
    out: Path, sessions: Iterable[str], streams: Iterable[str]
) -> list[tuple[str, str, str]]:
    """(stream_id, event_type, payload as JSON text) of the archive's `request_received` events
    of these sessions, and the `completion_finished` of these request streams: what the export
    reads of a session's requests from the log (`queries.READ_CONVERSATIONS`) when their days
    were archived."""
    wanted_sessions, wanted_streams = sorted(set(sessions)), set(streams)
    if not wanted_sessions:
        return []
    rows: list[tuple[str, str, str]] = []
    for entry in read_manifest(out)["partitions"]:
        table = pq.read_table(
            out / entry["file"],
            columns=["stream_id", "event_type", "payload"],
            filters=[
                ("session_id", "in", wanted_sessions),
                ("event_type", "in", ["request_received", "completion_finished"]),
            ],
        )
        rows += [
            (r["stream_id"], r["event_type"], r["payload"])
            for r in table.to_pylist()
            if r["event_type"] == "request_received" or r["stream_id"] in wanted_streams
        ]
    return rows


@dataclass
class RebuiltSession:
    """A session rebuilt from an archive (and the log): what the projector and `show` make."""

    session: SessionRecord
    samples: list[Sample]
    timeline: list[Entry]
    events: list[RecordedEvent]


def rebuild_archived_session(
    out: Path, session_id: str, live: Sequence[RecordedEvent] = ()
) -> RebuiltSession:
    """Rebuild a session, its samples and its timeline from the archive in `out`, with `live`
    (its events still in the log, e.g. a reward given after its day was archived)."""
    seen = set()
    events = []
    for event in [*archived_events(out, session_id), *live]:
        if event.position not in seen:
            seen.add(event.position)
            events.append(event)
    if not events:
        raise SessionNotFound(f"no session {session_id!r} in the archive {out} or the store")
    events.sort(key=lambda e: (e.tx_id, e.position))
    session = rebuild_session(session_id, events)
    samples = build_samples(rebuild_session(session_id, events, packed=True))
    lineage_of = {t: s.lineage for s in samples if s.alternative_of is None for t in s.turns}
    return RebuiltSession(session, samples, timeline(session, events, lineage_of), events)
