"""A test-only clock for the log: events recorded "on" a chosen day, through the store's own path.

`recorded_at` is the database's `now()` (its column default), so a test cannot pick it per event.
`recorded_on` swaps the column default of `events` for a fixed instant while the block runs:
`EventStore.append` and the writer's COPY then go through exactly their usual statements,
triggers, uniqueness keys and partition routing, only with another clock.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator

from trajstore.store import EventStore
from trajstore.store.partitions import create_partition


@contextlib.asynccontextmanager
async def recorded_on(store: EventStore, day: dt.date, hour: int = 12) -> AsyncIterator[None]:
    """Events appended inside the block are recorded at `hour` o'clock UTC on `day`."""
    at = dt.datetime.combine(day, dt.time(hour), dt.UTC).isoformat()
    await store.pool.execute(f"ALTER TABLE events ALTER COLUMN recorded_at SET DEFAULT '{at}'")
    try:
        yield
    finally:
        await store.pool.execute("ALTER TABLE events ALTER COLUMN recorded_at SET DEFAULT now()")


async def days_with_partitions(store: EventStore, *days: dt.date) -> None:
    """Create the partitions of these days."""
    async with store.pool.acquire() as conn:
        for day in days:
            await create_partition(conn, day)


def days_ago(n: int) -> dt.date:
    """The UTC date `n` days before today."""
    return dt.datetime.now(dt.UTC).date() - dt.timedelta(days=n)
