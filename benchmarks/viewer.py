"""The viewer on a long session: a 64-turn, 100,000-token session's page, against the JSON read
of the same session.

    python benchmarks/viewer.py [--runs 7] [--no-browser]

Records one session as the proxy does (benchmarks/projection.py's `record`: prompts stored as
references plus new tokens, 16-token completion chunks with logprobs): a 4,000-token first prompt,
64 turns of 256 generated tokens, 1,264-token tool results between them, so its one sample holds
100,016 tokens. Then, over HTTP to the viewer served by uvicorn on this machine:

- baseline: what `GET /sessions/{id}` of the proxy does (read the session's events, rebuild it,
  serialise it to JSON), in process;
- page, cold: `GET /sessions/{id}` of the viewer with its session cache emptied first (read,
  rebuild, build the samples, the timeline, render);
- page, warm: the same page again (the log did not change, so the rebuilt session is reused);
- turn: `GET /sessions/{id}/turns/63`, the last turn's body and token strip (what opening it
  fetches), warm;
- browser: with Debian's chromium and Playwright present, the page loaded in a headless browser
  until its `load` event, cold (cache emptied).

Prints medians and each as a ratio of the baseline. The target: the page, cold, under a second.
TRAJSTORE_DATABASE_URL's server, else the embedded one (it needs the right to create databases).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from ingest import Databases  # benchmarks/ingest.py, next to this file
from projection import Shape, record  # benchmarks/projection.py

from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.store.sessions import rebuild_session
from trajstore.viewer import ViewerSettings, create_app

SHAPE = Shape(turns=64, first_prompt=4000, completion=256, tool_result=1264, sessions=1)
SESSION = "s0"
CHROMIUM = Path("/usr/bin/chromium")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.asynccontextmanager
async def viewer(url: str) -> AsyncIterator[tuple[str, Any]]:
    """The viewer served by uvicorn on a free port: its URL and its app."""
    app = create_app(url, ViewerSettings())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110 (uvicorn has no event to await)
        await asyncio.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        await task


async def median_s(runs: int, work: Callable[[], Awaitable[Any]],
                   before: Callable[[], None] | None = None) -> float:  # fmt: skip
    times = []
    for _ in range(runs + 1):  # the first run warms connections and imports; not counted
        if before is not None:
            before()
        start = time.perf_counter()
        await work()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


async def browser_load_s(runs: int, page_url: str, clear: Callable[[], None]) -> float | None:
    """The page's `load` in headless chromium, cold; None without chromium or Playwright."""
    try:
        from playwright.async_api import async_playwright
    except ImportError:
        return None
    if not await asyncio.to_thread(CHROMIUM.exists):
        return None
    async with async_playwright() as p:
        browser = await p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        page = await browser.new_page()
        try:
            return await median_s(runs, lambda: page.goto(page_url, wait_until="load"), clear)
        finally:
            await browser.close()


async def main(runs: int, with_browser: bool) -> None:
    databases = Databases(database_url())
    await databases.setup()
    try:
        url = await databases.fresh()
        await record(url, SHAPE)
        async with await EventStore.open(url) as store:

            async def baseline() -> bytes:
                events = await store.read_session(SESSION)
                return orjson.dumps(rebuild_session(SESSION, events).as_json())

            baseline_s = await median_s(runs, baseline)
            json_size = len(await baseline())
        async with viewer(url) as (base, app), httpx.AsyncClient(timeout=60) as http:
            clear = app.state.viewer.sessions.clear
            page_url = f"{base}/sessions/{SESSION}"

            async def get(path: str) -> httpx.Response:
                answer = await http.get(path)
                answer.raise_for_status()
                return answer

            cold_s = await median_s(runs, lambda: get(page_url), clear)
            warm_s = await median_s(runs, lambda: get(page_url))
            turn_s = await median_s(runs, lambda: get(f"{page_url}/turns/63"))
            page_size = len((await get(page_url)).content)
            turn_size = len((await get(f"{page_url}/turns/63")).content)
            view = await app.state.viewer.sessions.get(app.state.viewer.store, SESSION)
            tokens = view.samples[0].n_tokens
            browser_s = await browser_load_s(runs, page_url, clear) if with_browser else None
    finally:
        await databases.drop_all()

    print(f"one session: {SHAPE.turns} turns, one sample of {tokens:,} tokens; medians of {runs}")
    print(f"{'':34}{'seconds':>9}{'x baseline':>12}{'bytes':>12}")
    rows = [
        ("baseline: JSON GET /sessions/{id}", baseline_s, json_size),
        ("viewer page, cold", cold_s, page_size),
        ("viewer page, warm", warm_s, page_size),
        ("viewer turn 63 body, warm", turn_s, turn_size),
    ]
    if browser_s is not None:
        rows.append(("chromium page load, cold", browser_s, page_size))
    for name, seconds, size in rows:
        print(f"{name:34}{seconds:>9.3f}{seconds / baseline_s:>11.2f}x{size:>12,}")
    verdict = "under" if cold_s < 1 and (browser_s or 0) < 1 else "OVER"
    print(f"target: the page, cold, under 1 s: {verdict}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-browser", action="store_true", help="skip the chromium measurement")
    args = parser.parse_args()
    asyncio.run(main(args.runs, not args.no_browser))
