"""`trajstore sql "<query>"`: one read-only query, printed as a table.

The query runs in a READ ONLY transaction: the command is for looking at trajectories, and the
log is never changed by hand. Cells are shown for people: JSON compact, packed token arrays as
their length, long text cut to `max_width`.
"""

from __future__ import annotations

from typing import Any

import asyncpg
import orjson
from rich.console import Console
from rich.table import Table

from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.errors import BadQuery
from trajstore.store.eventstore import EventStore

#: Packed arrays of `samples`/`events` and what one element weighs.
_PACKED = {"token_ids": 4, "logprobs": 4, "loss_mask": 1}


def cell(value: Any, type_name: str, column: str, max_width: int) -> str:
    """How one value reads in the table."""
    if value is None:
        return ""
    if type_name == "bytea":
        size = _PACKED.get(column)
        return f"<{len(value) // size} tokens>" if size else f"<{len(value)} bytes>"
    if type_name in ("json", "jsonb"):
        # Store connections hand jsonb over as its raw JSON text (store.connection).
        raw = value if isinstance(value, bytes | bytearray) else orjson.dumps(value)
        text = bytes(raw).decode()
    elif isinstance(value, list | tuple):
        text = ", ".join(str(v) for v in value)
    elif isinstance(value, float):
        text = f"{value:.6g}"
    else:
        text = str(value)
    return text if len(text) <= max_width else text[: max_width - 1] + "…"


async def run_query(store: EventStore, query: str) -> tuple[list[tuple[str, str]], list[Any]]:
    """Run `query` read-only; return its columns (name, type) and rows."""
    async with unavailable_as_store_error(), store.pool.acquire() as conn:
        try:
            async with conn.transaction(readonly=True):
                statement = await conn.prepare(query)
                columns = [(a.name, a.type.name) for a in statement.get_attributes()]
                rows = await statement.fetch()
        except asyncpg.PostgresError as exc:  # PostgreSQL's message says what is wrong
            raise BadQuery(f"the query failed: {exc}") from exc
    return columns, rows


async def print_query(
    store: EventStore, query: str, *, max_width: int = 60, console: Console | None = None
) -> None:
    """Run `query` and print its rows as a table, then how many there were."""
    columns, rows = await run_query(store, query)
    console = console or Console()
    table = Table(*[name for name, _ in columns], show_lines=False)
    for row in rows:
        table.add_row(
            *[cell(row[i], kind, name, max_width) for i, (name, kind) in enumerate(columns)]
        )
    console.print(table)
    console.print(f"({len(rows)} row{'s' if len(rows) != 1 else ''})")
