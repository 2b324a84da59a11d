"""The daily partitions of `events`: named, created ahead of time, listed.

`events` is range-partitioned on `recorded_at` (the database's clock, UTC days): one partition
per day, `events_YYYYMMDD`, and `events_default` for rows outside them. Partitions are created
ahead by maintenance, never by the writer: creating one locks `events` (briefly, but behind any
long reader), which must not stall the proxy's hot path. `trajstore migrate` creates today's and
`DAYS_AHEAD` more (a month, so a store nobody maintains still gets its days for weeks);
`trajstore partitions --every 3600` (compose's `partitions` service; `trajstore up` does the
same) keeps it so, as would a daily cron job. Should maintenance fall behind all the same, rows
land in `events_default` rather than being refused; that day then gets no partition of its own,
and those rows are not archived (the listing warns).

The same upkeep *seals* the days that have closed (`seal_closed_days`): their events' unique keys
are copied to `event_keys`, so that a write's check against the days before it probes one index
(plus the days not sealed yet) however many days the log keeps (`store.schema`, `event_keys`).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass

import asyncpg

from trajstore.store import keys, queries
from trajstore.store.connection import connect
from trajstore.store.schema import DEFAULT_PARTITION

log = logging.getLogger(__name__)

#: How many days past today `ensure_partitions` creates by default. An empty partition costs
#: its indexes' first pages (about 100 kB); a missing one sends a day's events to the default.
DAYS_AHEAD = 31
_PREFIX = "events_"
#: How long partition DDL waits for its lock on `events` before giving up (until the next run).
_LOCK_TIMEOUT = "2s"


@dataclass(frozen=True, slots=True)
class Partition:
    """One partition of `events`: its day (None for the default one) and its size on disk."""

    name: str
    day: dt.date | None
    bytes: int

    @property
    def end(self) -> dt.datetime | None:
        """The first instant after the partition's day (UTC); None for the default one."""
        if self.day is None:
            return None
        return dt.datetime.combine(self.day + dt.timedelta(days=1), dt.time(), dt.UTC)


def partition_name(day: dt.date) -> str:
    """The name of the partition holding the events recorded on `day` (UTC)."""
    return f"{_PREFIX}{day:%Y%m%d}"


def _day_of(name: str) -> dt.date | None:
    if name == DEFAULT_PARTITION:
        return None
    return dt.datetime.strptime(name.removeprefix(_PREFIX), "%Y%m%d").date()


async def list_partitions(conn: asyncpg.Connection) -> list[Partition]:
    """Every partition of `events`, the default one first, then the days oldest first."""
    rows = await conn.fetch(queries.PARTITIONS)
    found = [Partition(r["name"], _day_of(r["name"]), r["bytes"]) for r in rows]
    return sorted(found, key=lambda p: (p.day is not None, p.day or dt.date.min))


async def create_partition(conn: asyncpg.Connection, day: dt.date) -> str:
    """Create the partition of `day` (UTC) if missing; returns its name.

    Fails (`asyncpg.CheckViolationError`) if the default partition holds rows of that day.
    """
    name = partition_name(day)
    start = f"{day.isoformat()} 00:00:00+00"
    end = f"{(day + dt.timedelta(days=1)).isoformat()} 00:00:00+00"
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
        exists = await conn.fetchval("SELECT to_regclass($1) IS NOT NULL", name)
        if not exists:
            await conn.execute(
                f"CREATE TABLE {name} PARTITION OF events FOR VALUES FROM ('{start}') TO ('{end}')"
            )
            await conn.execute(
                queries.NAME_PARTITION_INDEXES.format(partition=name, suffix=f"{day:%Y%m%d}")
            )
            for statement in keys.PARTITION_UNIQUE_KEYS:
                await conn.execute(statement.format(partition=name, suffix=f"{day:%Y%m%d}"))
    return name


async def seal_closed_days(conn: asyncpg.Connection) -> dt.datetime | None:
    """Copy the keys of every event recorded before today (UTC, the database's clock) and not
    sealed yet into `event_keys`; returns the new `through` (None when nothing was to seal).

    It first waits (SHARE lock, `_LOCK_TIMEOUT` at most, then gives up until the next run) for
    the transactions still writing into those days' partitions: a transaction stamped before
    midnight may commit after it, and its keys must not be missed.
    """
    async with conn.transaction():
        await conn.execute(f"SET LOCAL lock_timeout = '{_LOCK_TIMEOUT}'")
        through = await conn.fetchval(keys.SEALED_THROUGH)
        if through.tzinfo is None:  # asyncpg's -infinity: nothing sealed yet
            through = dt.datetime.min.replace(tzinfo=dt.UTC)
        today = await conn.fetchval("SELECT date_trunc('day', now(), 'UTC')")
        if through >= today:
            return None
        for partition in await list_partitions(conn):
            closing = partition.end is not None and through < partition.end <= today
            if partition.end is None or closing:  # the default one may hold such days too
                await conn.execute(f"LOCK TABLE {partition.name} IN SHARE MODE")
        await conn.execute(keys.SEAL_KEYS_BETWEEN, through, today)
        for statement in keys.SET_SEALED_THROUGH:
            await conn.execute(statement, *([today] if "$1" in statement else []))
    return dt.datetime.fromtimestamp(today.timestamp(), dt.UTC)


async def ensure_partitions(
    conn: asyncpg.Connection, *, days_ahead: int = DAYS_AHEAD, today: dt.date | None = None
) -> list[str]:
    """Create the partitions of today (the database's, UTC) and `days_ahead` more days that are
    missing, and seal the days that have closed (`seal_closed_days`); returns the names
    created. A day whose rows already sit in the default partition is skipped with a warning
    (archive it, or move its rows by hand)."""
    if today is None:
        today = await conn.fetchval("SELECT (now() AT TIME ZONE 'UTC')::date")
    existing = {p.day for p in await list_partitions(conn)}
    created = []
    for offset in range(days_ahead + 1):
        day = today + dt.timedelta(days=offset)
        if day in existing:
            continue
        try:
            created.append(await create_partition(conn, day))
        except asyncpg.CheckViolationError:
            log.warning(
                "events of %s are in %s: that day gets no partition", day, DEFAULT_PARTITION
            )
    try:
        await seal_closed_days(conn)
    except asyncpg.LockNotAvailableError:
        log.warning("a long transaction still writes into a closed day: sealed next time")
    return created


async def ensure_partitions_at(url: str, *, days_ahead: int = DAYS_AHEAD) -> list[str]:
    """`ensure_partitions` on a connection of its own to `url` (the owner's: it is DDL), for
    `trajstore migrate` and the stack's upkeep; `StoreUnavailable` when it cannot connect."""
    conn = await connect(url, application_name="trajstore-partitions")
    try:
        return await ensure_partitions(conn, days_ahead=days_ahead)
    finally:
        await conn.close()
