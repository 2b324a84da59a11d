"""Ingest and read throughput of the event store, against raw asyncpg in the same run.

    python benchmarks/ingest.py [--tokens 1000000] [--runs 7] [--before 0016_lineages]

Writes realistic completion chunks (16 tokens, float32 logprobs, ~120 B of JSON) for many
request streams through `EventWriter`, and the same rows with a raw asyncpg COPY into a plain
table (`create_raw_table`: the columns and defaults of `events`, not partitioned, no triggers, no
unique keys, the 7 indexes of `RAW_INDEXES`), in batches of the same size. The baseline is fixed
here rather than copied from `events`, so the ratio means the same thing whatever the log's
schema: the price of everything the log promises over a plain indexed table. Each measurement
gets a fresh database cloned from a migrated template (with its days' partitions), so runs do
not slow each other down. Then reads them back: `read_session` and `read_all` against plain
SELECTs of the same rows and columns (token ids turned into numpy arrays, as any reader must).

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one; it needs the right to
create databases. Prints medians and ratios (trajstore / raw): higher is better.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial

import asyncpg
import numpy as np

from trajstore.store import (
    EventStore,
    EventType,
    NewEvent,
    RecordedEvent,
    keys,
    migrations,
    queries,
)
from trajstore.store.connection import asyncpg_dsn, connect
from trajstore.store.embedded import database_url
from trajstore.store.partitions import DAYS_AHEAD, ensure_partitions_at, partition_name
from trajstore.store.writer import copy_row

TOKENS_PER_CHUNK = 16
CHUNKS_PER_REQUEST = 64
REQUESTS_PER_SESSION = 8
BATCH_SIZE = 5_000
#: The raw reads fetch every column of an event too, with asyncpg's default codecs.
RAW_COLUMNS = (
    "position, tx_id, event_id, stream_id, stream_version, session_id, run_id, event_type, "
    "recorded_at, payload, token_ids, logprobs"
)
#: The raw baseline's indexes: those of `events` as partitioned by migration 0013 (what
#: `LIKE events INCLUDING ALL` gave it), the ones its readers need; none is unique but the key.
RAW_INDEXES = (
    "PRIMARY KEY (position, recorded_at)",
    "(stream_id, stream_version)",
    "(tx_id, position)",
    "(session_id, tx_id, position)",
    "(run_id)",
    "(tx_id, position) "
    "WHERE event_type IN ('session_finished', 'session_discarded', 'reward_assigned')",
    "(session_id, event_type) WHERE event_type IN ('session_created', 'session_finished')",
)


@dataclass
class Workload:
    """The events to write, grouped by request stream."""

    streams: list[tuple[str, list[NewEvent]]]
    sessions: list[str]

    @property
    def n_events(self) -> int:
        return sum(len(events) for _, events in self.streams)

    @property
    def n_tokens(self) -> int:
        return self.n_events * TOKENS_PER_CHUNK


def make_workload(n_tokens: int, seed: int = 0) -> Workload:
    """Chunk events like the proxy records, for about `n_tokens` tokens."""
    rng = np.random.default_rng(seed)
    n_requests = max(1, n_tokens // (TOKENS_PER_CHUNK * CHUNKS_PER_REQUEST))
    streams, sessions = [], []
    for r in range(n_requests):
        session = f"session-{r // REQUESTS_PER_SESSION}"
        if not sessions or sessions[-1] != session:
            sessions.append(session)
        events = [
            NewEvent(
                EventType.COMPLETION_CHUNK,
                session_id=session,
                run_id="bench",
                payload={"choice": 0, "text": "lorem ipsum dolor sit amet, " * 3, "n": c},
                token_ids=rng.integers(0, 151_000, TOKENS_PER_CHUNK, dtype=np.int32),
                logprobs=-rng.random(TOKENS_PER_CHUNK, dtype=np.float32) * 4,
            )
            for c in range(CHUNKS_PER_REQUEST)
        ]
        streams.append((f"request-{r}", events))
    return Workload(streams, sessions)


class Databases:
    """Fresh databases cloned from one migrated template."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.template = f"trajstore_bench_template_{uuid.uuid4().hex[:8]}"
        self.created: list[str] = []

    def url_of(self, name: str) -> str:
        base, _, query = self.url.partition("?")
        head, _, _ = base.rpartition("/")
        return f"{head}/{name}" + (f"?{query}" if query else "")

    async def _admin(self, sql: str) -> None:
        conn = await asyncpg.connect(asyncpg_dsn(self.url_of("postgres")))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    async def setup(self, revision: str = "head") -> None:
        """Migrate the template to `revision` and give it its days' partitions, as `trajstore
        migrate` does (without them every event would land in `events_default`)."""
        await self._admin(f'CREATE DATABASE "{self.template}"')
        self.created.append(self.template)
        await asyncio.to_thread(migrations.upgrade, self.url_of(self.template), revision)
        if revision == "head":
            await ensure_partitions_at(self.url_of(self.template))
            return
        # An earlier revision's partitions: as its `create_partition` made them (no unique keys).
        conn = await connect(self.url_of(self.template))
        try:
            today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
            for offset in range(DAYS_AHEAD + 1):
                day = today + dt.timedelta(days=offset)
                name = partition_name(day)
                await conn.execute(
                    f"CREATE TABLE {name} PARTITION OF events FOR VALUES FROM "
                    f"('{day} 00:00:00+00') TO ('{day + dt.timedelta(days=1)} 00:00:00+00')"
                )
                await conn.execute(
                    queries.NAME_PARTITION_INDEXES.format(partition=name, suffix=f"{day:%Y%m%d}")
                )
        finally:
            await conn.close()

    async def fresh(self) -> str:
        name = f"trajstore_bench_{uuid.uuid4().hex[:8]}"
        await self._admin(f'CREATE DATABASE "{name}" TEMPLATE "{self.template}"')
        self.created.append(name)
        return self.url_of(name)

    async def drop_all(self) -> None:
        for name in reversed(self.created):
            await self._admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def write_with_writer(url: str, workload: Workload) -> float:
    """Seconds from the first append to a completed flush(), through EventWriter."""
    async with await EventStore.open(url) as store:
        writer = store.writer(batch_size=BATCH_SIZE, max_pending=10 * workload.n_events)
        await writer.start()
        started = time.perf_counter()
        for stream, events in workload.streams:
            writer.append_many(stream, 1, events)
        await writer.flush()
        elapsed = time.perf_counter() - started
        await writer.close()
    return elapsed


async def create_raw_table(conn: asyncpg.Connection, name: str = "scratch") -> str:
    """The raw baseline's table: `events`' columns, defaults and storage, `RAW_INDEXES`."""
    await conn.execute(
        f"CREATE TABLE {name} (LIKE events INCLUDING DEFAULTS INCLUDING IDENTITY "
        "INCLUDING STORAGE INCLUDING COMPRESSION)"
    )
    for index in RAW_INDEXES:
        if index.startswith("PRIMARY KEY"):
            await conn.execute(f"ALTER TABLE {name} ADD {index}")
        else:
            await conn.execute(f"CREATE INDEX ON {name} {index}")
    return name


async def write_with_raw_copy(url: str, workload: Workload) -> float:
    """Seconds to COPY the same rows, in batches of the same size, into the raw table."""
    conn = await connect(url)
    try:
        await create_raw_table(conn)
        records = [
            copy_row(stream, version, e)
            for stream, events in workload.streams
            for version, e in enumerate(events, start=1)
        ]
        started = time.perf_counter()
        for i in range(0, len(records), BATCH_SIZE):
            async with conn.transaction():
                await conn.copy_records_to_table(
                    "scratch", records=records[i : i + BATCH_SIZE], columns=queries.INSERT_COLUMNS
                )
        return time.perf_counter() - started
    finally:
        await conn.close()


def tokens_of(event: RecordedEvent) -> int:
    """Touch the token ids and logprobs as numpy arrays, as the raw readers do."""
    ids, logprobs = event.token_ids, event.logprobs
    assert ids is not None and logprobs is not None
    return len(ids)


async def read_sessions(store: EventStore, sessions: list[str]) -> int:
    tokens = 0
    for session in sessions:
        tokens += sum(tokens_of(e) for e in await store.read_session(session))
    return tokens


async def read_sessions_raw(conn: asyncpg.Connection, sessions: list[str]) -> int:
    tokens = 0
    for session in sessions:
        rows = await conn.fetch(
            f"SELECT {RAW_COLUMNS} FROM events WHERE session_id = $1 ORDER BY position", session
        )
        for row in rows:
            tokens += len(np.frombuffer(row["token_ids"], dtype="<i4"))
            np.frombuffer(row["logprobs"], dtype="<f4")
    return tokens


async def read_all(store: EventStore) -> int:
    tokens, after = 0, 0
    while page := await store.read_all(after=after, limit=BATCH_SIZE):
        tokens += sum(tokens_of(e) for e in page)
        after = page[-1].position
    return tokens


async def read_all_raw(conn: asyncpg.Connection) -> int:
    tokens, after = 0, 0
    while rows := await conn.fetch(
        f"SELECT {RAW_COLUMNS} FROM events WHERE position > $1 ORDER BY position LIMIT $2",
        after,
        BATCH_SIZE,
    ):
        for row in rows:
            tokens += len(np.frombuffer(row["token_ids"], dtype="<i4"))
            np.frombuffer(row["logprobs"], dtype="<f4")
        after = rows[-1]["position"]
    return tokens


async def timed(work: Callable[[], Awaitable[int]]) -> tuple[float, int]:
    started = time.perf_counter()
    tokens = await work()
    return time.perf_counter() - started, tokens


def line(
    name: str, ours: list[float], raw: list[float], tokens: int, *, label: str = "trajstore",
    width: int = 14,
) -> str:  # fmt: skip
    """One result: medians as tokens/s and the ratio raw time / our time."""
    mine, base = statistics.median(ours), statistics.median(raw)
    return (
        f"{name:<{width}} {label} {tokens / mine / 1e6:6.2f} M tokens/s   "
        f"raw {tokens / base / 1e6:6.2f} M tokens/s   ratio {base / mine:5.2f}x"
    )


async def main(n_tokens: int, runs: int, before: str | None = None) -> None:
    url = await asyncio.to_thread(database_url)
    started = time.perf_counter()
    workload = make_workload(n_tokens)
    build_seconds = time.perf_counter() - started
    # The workload is scaffolding, not the system under test: keep the garbage collector from
    # walking its ~10^6 objects during every measurement (on both sides alike).
    gc.collect()
    gc.freeze()
    print(
        f"workload: {workload.n_events} chunk events, {workload.n_tokens} tokens, "
        f"{len(workload.streams)} request streams, {len(workload.sessions)} sessions; "
        f"building the NewEvents took {build_seconds / workload.n_events * 1e6:.1f} us/event"
    )
    print(
        "raw baseline: a plain table (events' columns and defaults; not partitioned, no "
        f"triggers, no unique keys) with {len(RAW_INDEXES)} indexes: " + "; ".join(RAW_INDEXES)
    )
    dbs = Databases(url)
    await dbs.setup()
    # The log of an earlier revision, written by this writer without its per-batch check (the
    # one thing the writer does differently since migration 0017: a no-op round trip instead).
    old = Databases(url) if before else None
    if old is not None and before is not None:
        await old.setup(before)
    try:
        writes: dict[str, list[float]] = {"ours": [], "raw": [], "before": []}
        for run in range(runs):
            # Rotate which goes first, so none always gets the warmer server.
            order = [("ours", write_with_writer, dbs), ("raw", write_with_raw_copy, dbs)]
            if old is not None:
                order.append(("before", write_unchecked, old))
            turn = run % len(order)
            for name, write, databases in order[turn:] + order[:turn]:
                writes[name].append(await write(await databases.fresh(), workload))
        stores: list[tuple[str, Databases, Writes]] = [("ours", dbs, write_with_writer)]
        if old is not None:
            stores.append(("before", old, write_unchecked))
        reads = await measure_reads(stores, workload, runs)
    finally:
        await dbs.drop_all()
        if old is not None:
            await old.drop_all()

    print(f"medians of {runs} runs; ratio = raw time / trajstore time (1.00x = as fast as raw)")
    for label, key in [("trajstore", "ours")] + ([(f"{before}", "before")] if old else []):
        print(f"-- {label}")
        r = reads[key]
        print(line("write", writes[key], writes["raw"], workload.n_tokens))
        print(line("read_session", r["session"], r["session raw"], workload.n_tokens))
        print(line("read_all", r["all"], r["all raw"], workload.n_tokens))


async def write_unchecked(url: str, workload: Workload) -> float:
    """`write_with_writer` on a log without `trajstore_check_keys` (before migration 0017)."""
    checked = keys.CHECK_KEYS
    keys.CHECK_KEYS = "SELECT $1::text[], $2::int8[], $3::int8[]"
    try:
        return await write_with_writer(url, workload)
    finally:
        keys.CHECK_KEYS = checked


#: A way to write the workload to a store: seconds it took.
Writes = Callable[[str, Workload], Awaitable[float]]


async def measure_reads(
    stores: list[tuple[str, Databases, Writes]],
    workload: Workload,
    runs: int,
) -> dict[str, dict[str, list[float]]]:
    """Seconds of each read, ours and raw, on a fresh store of each kind that its writer filled;
    the stores take turns within every run, so a busier minute weighs on all of them."""
    reads: dict[str, dict[str, list[float]]] = {}
    opened = []
    try:
        for key, databases, write in stores:
            url = await databases.fresh()
            await write(url, workload)
            store = await EventStore.open(url)
            opened.append((key, store, await asyncpg.connect(asyncpg_dsn(url))))
            reads[key] = {k: [] for k in ("session", "session raw", "all", "all raw")}
        for _ in range(runs):
            for key, store, raw_conn in opened:
                for name, work in (
                    ("session", partial(read_sessions, store, workload.sessions)),
                    ("session raw", partial(read_sessions_raw, raw_conn, workload.sessions)),
                    ("all", partial(read_all, store)),
                    ("all raw", partial(read_all_raw, raw_conn)),
                ):
                    seconds, tokens = await timed(work)
                    assert tokens == workload.n_tokens, (name, tokens)
                    reads[key][name].append(seconds)
    finally:
        for _, store, raw_conn in opened:
            await raw_conn.close()
            await store.close()
    return reads


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1_000_000, help="tokens to write per run")
    parser.add_argument("--runs", type=int, default=7, help="runs per measurement")
    parser.add_argument(
        "--before",
        metavar="REVISION",
        help="also measure the log migrated to REVISION (0016_lineages: before migration 0017)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.runs, args.before))
