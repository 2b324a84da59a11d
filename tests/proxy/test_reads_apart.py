"""A long session read by every path while agents keep recording on the same proxy (issue 43).

The proxy runs as `trajstore proxy` in a process of its own, so its resident set is its own: the
reads of a 3,000-turn session (whole, every page, one turn both ways, the export, the timeline,
the viewer) must leave it where recording alone does, since the proxy hands reads to its reader
process (`proxy.reads`). Before, each read rebuilt the session inside the proxy and kept the
working set: +388 MiB after the reads of a 5,000-call session (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import free_port
from tests.long_session import record_long_session
from trajstore.proxy.reads import resident_bytes
from trajstore.store import EventStore
from trajstore.store.export import export
from trajstore.trainer.timeline import gather, json_pieces
from trajstore.viewer import ViewerSettings, create_app

TURNS = 3_000
#: What the reads may add to the proxy's resident set: the reader's client, a chunk in flight,
#: and what recording the agents' turns meanwhile grows (their contexts, far under
#: TRAJSTORE_CONTEXT_BYTES). One rebuild of this session inside the proxy took 150 MiB or more.
BOUND = 48 << 20


ENGINE_MAIN = """
import asyncio, sys
from tests.proxy.fake_engine import FakeEngine, serve_forever
asyncio.run(serve_forever(FakeEngine(), int(sys.argv[1])))
"""


@contextlib.asynccontextmanager
async def serving(argv: list[str], url: str, env: dict[str, str]) -> AsyncIterator[int]:
    """A server in a process of its own (its health answered): its pid. Apart from the test's
    event loop, which the reads below block for moments at a time."""
    process = await asyncio.to_thread(subprocess.Popen, argv, env=env, stdin=subprocess.DEVNULL)
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(600):
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(f"{url}/health")).status_code == 200:
                        break
                assert process.poll() is None, f"{argv} exited"
                await asyncio.sleep(0.1)
        yield process.pid
    finally:
        process.terminate()
        await asyncio.to_thread(process.wait, 30)


async def keep_recording(url: str, http: httpx.AsyncClient, stop: asyncio.Event) -> int:
    """An agent's turns, one after another, until `stop`: how many were answered."""
    created = (await http.post(f"{url}/sessions", json={"run_id": "live"})).json()
    agent = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "go on " * 30}]
    answered = 0
    while not stop.is_set():
        answer = await agent.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
        messages += [answer.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"and {answered}"}]  # fmt: skip
        answered += 1
        messages = messages[-40:] if len(messages) > 60 else messages  # bounded: not the subject
    await agent.close()
    return answered


@pytest.mark.slow
async def test_every_read_of_a_long_session_while_agents_record_leaves_the_proxy_s_memory(
    database_url: str,
) -> None:
    async with await EventStore.open(database_url) as store:
        await record_long_session(store, TURNS)  # opencode-shaped, 3,000 calls, session "long"
    engine, url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    proxy = [sys.executable, "-m", "trajstore", "proxy", "--engine", engine,
             "--port", url.rpartition(":")[2]]  # fmt: skip
    async with (
        serving([sys.executable, "-c", ENGINE_MAIN, engine.rpartition(":")[2]], engine, env),
        serving(proxy, url, env) as pid,
        httpx.AsyncClient(timeout=120) as http,
    ):
        base = f"{url}/sessions/long"
        stop = asyncio.Event()
        agents = [asyncio.create_task(keep_recording(url, http, stop)) for _ in range(2)]
        await asyncio.sleep(1.0)  # the agents under way, their sessions held
        assert (await http.get(f"{base}?limit=1")).status_code == 200  # the reader started
        before = resident_bytes(pid)
        assert before is not None

        whole = (await http.get(base)).json()
        assert whole["n_turns"] == len(whole["turns"]) == TURNS and whole["next"] is None
        walked, next_url = [], f"{base}?limit=500"
        while next_url:
            page = (await http.get(next_url)).json()
            walked += page["turns"]
            next_url = page["next"]
        assert [t["request_id"] for t in walked] == [t["request_id"] for t in whole["turns"]]
        for n in (0, 1, TURNS // 2, TURNS - 2):
            in_page = (await http.get(base, params={"turn": n})).json()["turns"][n]
            alone = (await http.get(f"{base}/turns/{n}")).json()
            # One turn whole, shaped as a page gives it (tools in full: it opens its own page).
            assert alone["prompt_token_ids"] == in_page["prompt_token_ids"]
            assert alone["messages"] == in_page["messages"]
            assert alone["index"] == n and alone["lineage"] == whole["turns"][n]["lineage"]
            listed = whole["turns"][n]
            gave = listed if listed["tools_from"] is None else whole["turns"][listed["tools_from"]]
            assert alone["tools"] == gave["tools"] and alone["tools_from"] is None
        with tempfile.TemporaryDirectory() as scratch:
            async with await EventStore.open(database_url) as store:
                await export(store, Path(scratch) / "out.parquet", runs=["run-long"])
            assert (Path(scratch) / "out.parquet").stat().st_size > 0
        sink = io.BytesIO()
        for piece in json_pieces(await gather(database_url, "long", None, None), None, None):
            sink.write(piece)
        assert sink.tell() > 0
        app = create_app(database_url, ViewerSettings())
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://v") as v,
        ):
            assert (await v.get("/sessions/long")).status_code == 200

        after = resident_bytes(pid)
        stop.set()
        answered = await asyncio.gather(*agents)
        assert all(n > 0 for n in answered)  # recording went on through every read
        missing = await http.get(f"{base}/turns/{TURNS}")
        assert missing.status_code == 404 and f"has {TURNS} turns" in missing.text
        assert after is not None and after - before < BOUND, (
            f"the proxy grew {(after - before) >> 20} MiB over its reads"
        )
