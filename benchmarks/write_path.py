"""Where a writer batch's time goes on the partitioned log: each part toggled in the same run.

    python benchmarks/write_path.py [--tokens 500000] [--runs 5] [--revision 0016_lineages]

The rows of `benchmarks/ingest.py` (chunk events of 16 tokens) are COPYed in batches of 5,000,
one transaction each, by raw asyncpg from rows built before the clock starts, into a fresh clone
of a migrated store (with its days' partitions) per measurement, in these shapes:

- `log`: into `events`, exactly as `EventWriter` does (since migration 0017: its per-batch
  `trajstore_check_keys` first; partition routing and every trigger);
- then the same with one part more switched off each line: the uniqueness guard (at head: the
  batch's check and the row trigger, then the partitions' unique keys; at 0016: the statement
  trigger filling `event_keys`, with lines for its parts), the NOTIFY triggers, the secondary
  indexes, and the primary key (a heap alone);
- `raw`: the ingest benchmark's baseline, a plain table with the 7 indexes listed in
  `RAW_INDEXES`, no triggers, no unique keys;
- `writer`: `EventWriter` itself into `events`, its Python work included.

Each line prints the median milliseconds per batch split into COPY and COMMIT (fsync on) and its
time over `raw`'s; the difference between consecutive lines is what that part costs. (COPY
straight into a day's partition, to time the routing, measured slower than through the parent:
the partition needs a `nextval` default for the parent's identity in PostgreSQL 15; the line was
left out.)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ingest import (  # benchmarks/ is on sys.path when this runs as a script
    BATCH_SIZE,
    RAW_INDEXES,
    Databases,
    Workload,
    create_raw_table,
    make_workload,
    write_unchecked,
    write_with_writer,
)

from trajstore.store.connection import connect
from trajstore.store.embedded import database_url
from trajstore.store.keys import CHECK_KEYS, stream_runs
from trajstore.store.queries import INSERT_COLUMNS
from trajstore.store.writer import copy_row

#: Statements that switch every trigger on the partitions' parent and on each partition off
#: except those named in $1 (ALTER TABLE ... DISABLE TRIGGER on a partitioned table does not
#: reach the partitions' clones in PostgreSQL 15).
DISABLE_TRIGGERS = """
DO $$
DECLARE
    t record;
BEGIN
    FOR t IN SELECT tgrelid::regclass::text AS tab, tgname FROM pg_trigger
             WHERE NOT tgisinternal AND tgname LIKE ANY (string_to_array('{names}', ','))
               AND tgrelid IN (SELECT 'events'::regclass UNION
                               SELECT inhrelid FROM pg_inherits
                               WHERE inhparent = 'events'::regclass)
    LOOP
        EXECUTE format('ALTER TABLE %s DISABLE TRIGGER %I', t.tab, t.tgname);
    END LOOP;
END
$$"""

#: The triggers that guard event ids' and stream versions' uniqueness, by name pattern.
GUARD_TRIGGERS = "events_keys%,events_guard%"
NOTIFY_TRIGGERS = "events_notify%"

DROP_SECONDARY_INDEXES = """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT indexrelid::regclass::text FROM pg_index
                WHERE indrelid = 'events'::regclass AND NOT indisprimary
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
    -- Unique indexes of the partitions themselves (not clones of the parent's).
    FOR name IN SELECT x.indexrelid::regclass::text FROM pg_index x
                JOIN pg_inherits i ON i.inhrelid = x.indrelid
                WHERE i.inhparent = 'events'::regclass AND NOT x.indisprimary
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
END
$$"""

EVENT_KEYS_WITHOUT_STREAM_KEY = """
ALTER TABLE event_keys DROP CONSTRAINT IF EXISTS uq_event_keys_stream_id_stream_version"""

#: The guard trigger still fires (PostgreSQL still keeps the statement's transition table) but
#: stores nothing.
GUARD_DOES_NOTHING = """
CREATE OR REPLACE FUNCTION trajstore_guard_keys() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END
$$"""

#: Both unique keys on today's partition itself (an upper bound: the partition keeps its
#: non-unique (stream_id, stream_version) index too).
PARTITION_UNIQUE_KEYS = [
    "DO $$ BEGIN EXECUTE format('CREATE UNIQUE INDEX ON %I (event_id)', "
    "'events_' || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')); END $$",
    "DO $$ BEGIN EXECUTE format('CREATE UNIQUE INDEX ON %I (stream_id, stream_version)', "
    "'events_' || to_char(now() AT TIME ZONE 'UTC', 'YYYYMMDD')); END $$",
]


@dataclass
class Shape:
    """One way of storing the batches: statements run on the fresh store, then its target."""

    name: str
    setup: list[str]
    target: str = "events"  # or "raw": create_raw_table's
    check: bool = False  # call trajstore_check_keys before each COPY, as the writer does


_NO_TRIGGERS = DISABLE_TRIGGERS.format(names=f"{GUARD_TRIGGERS},{NOTIFY_TRIGGERS}")
_TAIL = [
    Shape("- NOTIFY triggers", [_NO_TRIGGERS]),
    Shape("- secondary indexes (PK only)", [_NO_TRIGGERS, DROP_SECONDARY_INDEXES]),
    Shape(
        "- primary key (heap only)",
        [_NO_TRIGGERS, DROP_SECONDARY_INDEXES, "ALTER TABLE events DROP CONSTRAINT pk_events"],
    ),
    Shape(f"raw: plain table, {len(RAW_INDEXES)} indexes", [], target="raw"),
]

#: The partitions' own unique keys (migration 0017), dropped.
DROP_PARTITION_UNIQUE_KEYS = """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT x.indexrelid::regclass::text FROM pg_index x
                JOIN pg_inherits i ON i.inhrelid = x.indrelid
                WHERE i.inhparent = 'events'::regclass AND x.indisunique AND NOT x.indisprimary
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
END
$$"""

#: The log since migration 0017: unique keys per partition, the writer's per-batch check.
SHAPES = [
    Shape("log (as EventWriter: check, COPY)", [], check=True),
    Shape("- the batch's check (trigger off)", [DISABLE_TRIGGERS.format(names=GUARD_TRIGGERS)]),
    Shape(
        "- the partition's unique keys",
        [DISABLE_TRIGGERS.format(names=GUARD_TRIGGERS), DROP_PARTITION_UNIQUE_KEYS],
    ),
    *_TAIL,
]

#: The log of migrations 0013-0016 (`--revision 0016_lineages`): keys in `event_keys`.
SHAPES_0016 = [
    Shape("log (as EventWriter COPYs)", []),
    Shape("  event_keys without (stream, version)", [EVENT_KEYS_WITHOUT_STREAM_KEY]),
    Shape(
        "  event_keys without unique indexes",
        [EVENT_KEYS_WITHOUT_STREAM_KEY, "ALTER TABLE event_keys DROP CONSTRAINT pk_event_keys"],
    ),
    Shape("  guard reads its transition table only", [GUARD_DOES_NOTHING]),
    Shape(
        "  keys unique in today's partition instead",
        [DISABLE_TRIGGERS.format(names=GUARD_TRIGGERS), *PARTITION_UNIQUE_KEYS],
    ),
    Shape("- uniqueness guard", [DISABLE_TRIGGERS.format(names=GUARD_TRIGGERS)]),
    *_TAIL,
]


@dataclass
class Timing:
    """Seconds of one run: COPY statements and COMMITs summed over its batches."""

    copy: float
    commit: float

    @property
    def total(self) -> float:
        return self.copy + self.commit


async def copy_batches(url: str, shape: Shape, rows: list[tuple[object, ...]]) -> Timing:
    """COPY `rows` in batches, one transaction each, into `shape`'s target on a fresh store."""
    conn = await connect(url)
    try:
        for statement in shape.setup:
            await conn.execute(statement)
        table = "events"
        if shape.target == "raw":
            table = await create_raw_table(conn)
        copying = committing = 0.0
        for i in range(0, len(rows), BATCH_SIZE):
            batch = rows[i : i + BATCH_SIZE]
            started = time.perf_counter()
            tx = conn.transaction()
            await tx.start()
            if shape.check:
                await conn.execute(CHECK_KEYS, *stream_runs(batch))
            await conn.copy_records_to_table(table, records=batch, columns=INSERT_COLUMNS)
            copied = time.perf_counter()
            await tx.commit()
            copying += copied - started
            committing += time.perf_counter() - copied
        return Timing(copying, committing)
    finally:
        await conn.close()


async def main(n_tokens: int, runs: int, revision: str) -> None:
    shapes = SHAPES if revision == "head" else SHAPES_0016
    url = await asyncio.to_thread(database_url)
    workload: Workload = make_workload(n_tokens)
    rows = [
        copy_row(stream, version, e)
        for stream, events in workload.streams
        for version, e in enumerate(events, start=1)
    ]
    gc.collect()
    gc.freeze()
    batches = -(-len(rows) // BATCH_SIZE)
    print(f"{len(rows)} chunk events ({workload.n_tokens} tokens) in {batches} batches a run")
    dbs = Databases(url)
    await dbs.setup(revision)
    print(f"the store migrated to {revision}")
    timings: dict[str, list[Timing]] = {s.name: [] for s in shapes}
    writer: list[float] = []
    try:
        work: list[tuple[str, Callable[[str], Awaitable[None]]]] = []
        for shape in shapes:

            async def measure(db: str, shape: Shape = shape) -> None:
                timings[shape.name].append(await copy_batches(db, shape, rows))

            work.append((shape.name, measure))

        async def measure_writer(db: str) -> None:
            write = write_with_writer if revision == "head" else write_unchecked
            writer.append(await write(db, workload))

        work.append(("writer", measure_writer))
        for run in range(runs):
            # Rotate the order, so no shape always runs first (or on the warmest server).
            turn = run % len(work)
            for _, measure_one in work[turn:] + work[:turn]:
                await measure_one(await dbs.fresh())
    finally:
        await dbs.drop_all()

    raw = statistics.median(t.total for t in timings[shapes[-1].name])
    print(f"medians of {runs} runs, milliseconds per batch of {BATCH_SIZE}; x raw = time / raw's")
    print(f"{'shape':<40} {'COPY':>7} {'COMMIT':>7} {'total':>7} {'x raw':>6}")
    for shape in shapes:
        ts = timings[shape.name]
        copy = statistics.median(t.copy for t in ts) / batches * 1e3
        commit = statistics.median(t.commit for t in ts) / batches * 1e3
        total = statistics.median(t.total for t in ts)
        print(
            f"{shape.name:<40} {copy:7.2f} {commit:7.2f} {total / batches * 1e3:7.2f} "
            f"{total / raw:6.2f}"
        )
    mine = statistics.median(writer)
    print(
        f"{'writer: EventWriter into the log':<40} {'':>7} {'':>7} {mine / batches * 1e3:7.2f} "
        f"{mine / raw:6.2f}   (raw / writer = {raw / mine:.2f}x)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=500_000, help="tokens to write per run")
    parser.add_argument("--runs", type=int, default=5, help="runs per shape")
    parser.add_argument(
        "--revision",
        default="head",
        help="migrate the store to this revision (0016_lineages: the log before migration 0017)",
    )
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.runs, args.revision))
