"""What the partitioned log's upkeep costs: moving a store to it, and archiving days of it.

    python benchmarks/partitions.py [--quick] [--events 500000]

1. Migration 0013 on a store of N chunk events (16 tokens each, over four days), against the
   baseline of copying the same table with the same indexes in one statement
   (`INSERT INTO copy SELECT * FROM events`): the time appends wait behind its lock. Then the
   revisions after it (0017 builds each partition's unique keys, appends waiting too).
2. `trajstore archive` of the three days before today (Parquet, checksums, read back, verified,
   detached, dropped), against the baseline of reading the same rows out raw (`COPY ... TO` a
   file): what checksums, Parquet and the verification add. Also the space it frees.

Uses TRAJSTORE_DATABASE_URL's server (else the embedded one); needs the right to create
databases. One run each (a migration cannot be repeated on the same store): noisy on shared
cores, so read the ratios, not the last digit.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from pathlib import Path

import asyncpg
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script

from trajstore.store import migrations
from trajstore.store.archive import archive
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import database_url
from trajstore.store.eventstore import EventStore
from trajstore.store.partitions import ensure_partitions, list_partitions

BEFORE_PARTITIONS = "0012_process_roles"
PARTITIONS = "0013_partitioned_events"
#: N chunk events as the proxy writes them: 64 a request, 512 a session, spread over four days.
FILL = """
INSERT INTO events (event_id, stream_id, stream_version, session_id, run_id, event_type,
                    recorded_at, payload, token_ids, logprobs)
SELECT gen_random_uuid(), 'request-' || (i / 64), i % 64 + 1, 'session-' || (i / 512), 'bench',
       'completion_chunk', now() - make_interval(days => (i * 4 / $1)),
       jsonb_build_object('choice', 0, 'text', repeat('lorem ipsum ', 8), 'n', i),
       decode(repeat(md5(i::text), 4), 'hex'), decode(repeat(md5((i + 1)::text), 4), 'hex')
FROM generate_series(0, $1 - 1) AS i
"""


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


async def timed(work: Awaitable[object]) -> float:
    started = time.perf_counter()
    await work
    return time.perf_counter() - started


async def main(n_events: int) -> int:
    server = await asyncio.to_thread(database_url)
    name = f"trajstore_bench_partitions_{uuid.uuid4().hex[:8]}"
    databases = Databases(server)
    admin = await asyncpg.connect(asyncpg_dsn(databases.url_of("postgres")))
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = databases.url_of(name)
    try:
        await asyncio.to_thread(migrations.upgrade, url, BEFORE_PARTITIONS)
        conn = await asyncpg.connect(asyncpg_dsn(url))
        try:
            await conn.execute(FILL, n_events)
            await conn.execute("VACUUM ANALYZE events")
            size = await conn.fetchval("SELECT pg_total_relation_size('events')")
            await conn.execute("CREATE TABLE events_copy (LIKE events INCLUDING ALL)")
            copy_s = await timed(
                conn.execute("INSERT INTO events_copy OVERRIDING SYSTEM VALUE SELECT * FROM events")
            )
            await conn.execute("DROP TABLE events_copy")
        finally:
            await conn.close()
        migrate_s = await timed(asyncio.to_thread(migrations.upgrade, url, PARTITIONS))
        rest_s = await timed(asyncio.to_thread(migrations.upgrade, url))
        print(f"{n_events} chunk events, {size / 1e6:.0f} MB with indexes, over four days")
        print(
            f"migration 0013 {migrate_s:6.2f} s ({migrate_s / n_events * 1e6:5.1f} s a million "
            f"events)   copy of the table {copy_s:6.2f} s   ratio {migrate_s / copy_s:.2f}x"
        )
        print(
            f"then to head   {rest_s:6.2f} s ({rest_s / n_events * 1e6:5.1f} s a million "
            "events): 0017 builds each partition's unique keys under the lock"
        )

        today = dt.datetime.now(dt.UTC).date()
        async with await EventStore.open(url) as store:
            async with store.pool.acquire() as conn:
                await ensure_partitions(conn)
                days = [p for p in await list_partitions(conn) if p.day and p.day < today]
                rows = sum([await conn.fetchval(f"SELECT count(*) FROM {p.name}") for p in days])
                with tempfile.TemporaryDirectory(prefix="trajstore-bench-") as raw_dir:
                    started = time.perf_counter()
                    for p in days:
                        await conn.copy_from_query(
                            f"SELECT * FROM {p.name} ORDER BY tx_id, position",
                            output=str(Path(raw_dir) / p.name),
                        )
                    raw_s = time.perf_counter() - started
                freed_before = sum(p.bytes for p in days)
            with tempfile.TemporaryDirectory(prefix="trajstore-bench-") as out:
                archive_s = await timed(archive(store, today, Path(out)))
                files = await asyncio.to_thread(directory_bytes, Path(out))
            async with store.pool.acquire() as conn:
                left = {p.name for p in await list_partitions(conn)}
        gone = [p for p in days if p.name not in left]
        print(
            f"archive of {len(days)} days ({rows} events) {archive_s:6.2f} s "
            f"({rows / archive_s / 1e3:.0f} k events/s)   raw COPY out {raw_s:6.2f} s   "
            f"ratio {archive_s / raw_s:.2f}x"
        )
        print(
            f"freed {freed_before / 1e6:.0f} MB of the database ({len(gone)} of {len(days)} "
            f"partitions dropped) for {files / 1e6:.0f} MB of Parquet"
        )
        return 0 if len(gone) == len(days) else 1
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="100,000 events")
    parser.add_argument("--events", type=int, default=500_000)
    args = parser.parse_args()
    sys.exit(uvloop.run(main(100_000 if args.quick else args.events)))
