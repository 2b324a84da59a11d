"""The long sessions' read paths, timed (benchmarks/long_sessions.py reads them): the proxy's
`GET /sessions/{id}` in its forms, the projection, `trajstore export`, `replay session --json`,
the viewer; the proxy's reads as another checkout serves them; SQL over the `turns` view before and
after migration 0020.
"""

from __future__ import annotations

import asyncio
import io
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import httpx
import orjson

from trajstore.store import EventStore
from trajstore.store.export import export
from trajstore.store.samples import build_samples
from trajstore.store.sessions import rebuild_session
from trajstore.trainer.timeline import gather, json_pieces

PAGE = 100  #: turns per page of the paged reads (a viewer's page)


@dataclass
class Reading:
    """One read path's medians on one session."""

    seconds: list[float] = field(default_factory=list)
    size: int = 0  #: bytes answered, where there is an answer

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


async def timed(
    runs: int, read: Callable[[], Awaitable[int]], cold: Callable[[], Awaitable[None]] | None = None
) -> Reading:
    """The path read once untimed (connections, imports), then `runs` times (each after `cold`,
    untimed, when given)."""
    reading = Reading(size=await read())
    for _ in range(runs):
        if cold is not None:
            await cold()
        start = time.perf_counter()
        reading.size = await read()
        reading.seconds.append(time.perf_counter() - start)
    return reading


async def every_page(http: aiohttp.ClientSession, base: str) -> int:
    """Every page of `PAGE` turns of the session at `base`, following `next`: bytes read."""
    size, address = 0, f"{base}?limit={PAGE}"
    while address:
        async with http.get(address) as resp:
            body = await resp.read()
        size += len(body)
        address = orjson.loads(body)["next"]
    return size


async def read_paths(
    http: aiohttp.ClientSession, proxy: str, url: str, viewer: httpx.AsyncClient,
    session_id: str, run: str, turns: int, runs: int, others: list[str],
) -> dict[str, Reading]:  # fmt: skip
    """Every read path over one session, timed. `others`: two other sessions, read to push
    this one out of the reader's kept sessions before the cold reads."""
    base = f"{proxy}/sessions/{session_id}"

    async def get(address: str) -> int:
        async with http.get(address) as resp:
            assert resp.status == 200, await resp.text()
            size = 0
            async for piece in resp.content.iter_any():
                size += len(piece)
            return size

    async def cold() -> None:
        for other in others:
            await get(f"{proxy}/sessions/{other}?limit=1")

    async def pages() -> int:
        return await every_page(http, base)

    async def projection() -> int:
        async with await EventStore.open(url) as store:
            events = await store.read_session(session_id)
        record = rebuild_session(session_id, events, packed=True)
        return sum(s.n_tokens for s in build_samples(record)) * 4

    async def exported() -> int:
        with tempfile.TemporaryDirectory() as scratch:
            out = Path(scratch) / "session.parquet"
            async with await EventStore.open(url) as store:
                await export(store, out, runs=[run])
            return out.stat().st_size

    async def replay() -> int:
        gathered = await gather(url, session_id, None, None)
        sink = io.BytesIO()  # written a piece at a time, as to a terminal; kept only to size it
        for piece in json_pieces(gathered, None, None):
            sink.write(piece)
        return sink.tell()

    async def page() -> int:
        viewer_state = viewer._transport.app.state.viewer  # type: ignore[attr-defined]
        viewer_state.sessions.clear()  # cold: read and rebuilt
        answer = await viewer.get(f"/sessions/{session_id}")
        assert answer.status_code == 200
        return len(answer.content)

    async def turn_body() -> int:
        answer = await viewer.get(f"/sessions/{session_id}/turns/{turns - 2}")
        assert answer.status_code == 200
        return len(answer.content)

    return {
        "GET /sessions/{id}": await timed(runs, lambda: get(base)),
        f"  every page of {PAGE}, cold": await timed(runs, pages, cold),
        f"  every page of {PAGE}, kept": await timed(runs, pages),
        "  first page, cold": await timed(runs, lambda: get(f"{base}?limit={PAGE}"), cold),
        "  a page, kept": await timed(runs, lambda: get(f"{base}?after={turns // 2}&limit={PAGE}")),
        "  one turn whole (?turn=N)": await timed(runs, lambda: get(f"{base}?turn={turns - 2}")),
        "  one turn (/turns/N)": await timed(runs, lambda: get(f"{base}/turns/{turns - 2}")),
        "projection (fold + samples)": await timed(runs, projection),
        "trajstore export (Parquet)": await timed(runs, exported),
        "replay session --json": await timed(runs, replay),
        "viewer: page, cold": await timed(runs, page),
        "viewer: last turn's body": await timed(runs, turn_body),
    }


async def baseline_paths(
    http: aiohttp.ClientSession, proxy: str, session_id: str, turns: int, runs: int,
    *, paged: bool = True,
) -> dict[str, Reading]:  # fmt: skip
    """The proxy's read paths that both proxies serve, timed (another checkout's proxy); every
    page only when `paged` (a rebuild per page there: minutes at 5,000 turns)."""
    base = f"{proxy}/sessions/{session_id}"

    async def get(address: str) -> int:
        async with http.get(address) as resp:
            assert resp.status == 200, await resp.text()
            return len(await resp.read())

    async def pages() -> int:
        return await every_page(http, base)

    read = {"GET /sessions/{id}": await timed(runs, lambda: get(base))}
    if paged:
        read[f"  every page of {PAGE}, cold"] = await timed(runs, pages)
    read["  first page, cold"] = await timed(runs, lambda: get(f"{base}?limit={PAGE}"))
    read["  one turn whole (?turn=N)"] = await timed(runs, lambda: get(f"{base}?turn={turns - 2}"))
    return read


#: SQL over the `turns` view of one run, before (migration 0017's view) and after 0020.
TURNS_SQL = {
    "every column but whole messages": """
        SELECT session_id, request_id, position, api, engine, policy_version, tools, sampling,
               status, finish_reason, completion_text, tool_calls, n_tool_calls, prompt_tokens,
               completion_tokens, latency_s, ttft_s, failure, prompt_source, lineage
        FROM turns WHERE run_id = $1""",
    "... and what each turn stored": """
        SELECT request_id, messages_added, messages_prefix FROM turns WHERE run_id = $1""",
    "the last turn's whole messages": """
        SELECT messages FROM turns WHERE run_id = $1 ORDER BY position DESC LIMIT 1""",
    "every turn's whole messages": """
        SELECT sum(jsonb_array_length(messages)) FROM turns WHERE run_id = $1""",
}
SQL_TIMEOUT_S = 120
TIMEOUT_MS = SQL_TIMEOUT_S * 1000


async def turns_sql(url: str, runs: list[tuple[str, int]], whole_up_to: int) -> dict:
    """Each of TURNS_SQL on each run (least of 2), with the view as migration 0017 left it, then
    as 0020 makes it (the store migrated down and up again, same data). A query past
    SQL_TIMEOUT_S reads as None; every turn's whole messages only on runs of at most
    `whole_up_to` turns (they are the square of a session)."""
    from trajstore.store import migrations

    async def measure(revision: str) -> dict[tuple[str, str], float | None]:
        times: dict[tuple[str, str], float | None] = {}
        async with await EventStore.open(url) as store:
            for name, sql in TURNS_SQL.items():
                if revision == "0017" and "messages_added" in sql:
                    continue
                for run, turns in runs:
                    if name.startswith("every turn's") and turns > whole_up_to:
                        continue
                    best: float | None = None
                    for _ in range(2):
                        start = time.perf_counter()
                        try:
                            async with store.pool.acquire() as conn, conn.transaction():
                                await conn.execute(
                                    f"SET LOCAL statement_timeout = '{SQL_TIMEOUT_S}s'"
                                )
                                await conn.fetch(sql, run)
                        except asyncpg.QueryCanceledError:
                            best = None
                            break
                        took = time.perf_counter() - start
                        best = took if best is None else min(best, took)
                    times[name, run] = best
        return times

    after = await measure("0020")
    await asyncio.to_thread(migrations.downgrade, url, "0017_partition_keys")
    try:
        before = await measure("0017")
    finally:
        await asyncio.to_thread(migrations.upgrade, url, "head")
    return {"before": before, "after": after}
