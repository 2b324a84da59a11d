"""Long agent sessions through the proxy, then every read path over them (issues 35, 43).

    python benchmarks/long_sessions.py [--quick] [--sessions 3] [--turns 5000] [--small 1000]
                                       [--runs 3] [--rounds 2] [--baseline DIR]

Starts the fake engine (tests/proxy/fake_engine.py, answering every request that has tools with
a tool call) and `trajstore proxy` recording into a scratch database. Then `--sessions` agents of
`--turns` model calls each, and one of `--small` calls, run at once through the proxy, shaped as
opencode's (the same shape tests/long_session.py writes straight to the log): a 2,000-token system
prompt and tools, then turn after turn the model's tool call and the tool's output (growing from
12 to 32 words over 5,000 turns) sent back with the whole conversation, and every
`SIDE_EVERY`-th call a title call of its own (another lineage). At 5,000 turns the last prompt is
past 180 k tokens. Each session is finished, then the tokens the agents were told they sent and
received (usage) are reconciled with what the log stores.

Then, on the small session and on one long one, each read path (medians of `--runs`):

- `GET /sessions/{id}` through the proxy (answered by its reader process, `proxy.reads`):
  without options (the whole session, streamed); every page of `PAGE` turns following `next`,
  cold (two other sessions read first, so the reader keeps this one no more) and kept; the first
  page cold; a page kept; one turn whole, as `?turn=N` and as `/turns/N`;
- the projection: the session's events read, folded and made samples (`store.samples`), as the
  projector does per session; then `trajstore project` once for all of them;
- `trajstore export` of the session (its own run), Parquet;
- `replay session --json`: read, rebuilt, lineages, timeline, JSON written (to /dev/null);
- the viewer: the session's page (its cache emptied first) and its last turn's body.

Then `--rounds` more rounds of every path over every long session. Each path's time at `--turns`
over its time at `--small`: linear in turns when it is near the ratio of turns. The proxy's
resident memory (and its reader's): before the sessions, at its peak (sampled every 50 ms),
after the writes, and after all the reads. With `--baseline DIR` (a checkout of main, say), that
checkout's proxy serves the proxy's read paths over the same database too: their times beside
this one's, and its memory before and after. Last, SQL over the `turns` view of the small run
and a long one, with the view as migration 0017 left it (the store migrated down) and as 0020
makes it, on the same data.

Exits non-zero when a token is missing from the log, when `GET /sessions/{id}` without options
is 10 MB or more at `--turns`, or when the proxy keeps 100 MB more than before.
TRAJSTORE_DATABASE_URL's server, else the embedded one (it needs the right to create
databases). `--quick` (CI): 2 sessions of 500 turns and one of 100, one run, one round.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import httpx
import orjson
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from overhead_servers import ROOT, Servers, proxy_argv

from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.store.export import export
from trajstore.store.projection import Projector

sys.path.insert(0, str(ROOT))
from tests.long_session import record_long_session
from trajstore.store.samples import build_samples
from trajstore.store.sessions import rebuild_session
from trajstore.trainer.timeline import gather, json_pieces
from trajstore.viewer import ViewerSettings, create_app

SYSTEM_WORDS = 2_000
COMPLETION = 8  #: tokens of each tool call the model makes (ending with end-of-turn)
MAX_TOKENS = 2 * COMPLETION  #: asked for: the engine stops before, on its end-of-turn token
SIDE_EVERY = 50  #: every 50th call is a title call: a lineage of its own
MAX_GET_BYTES = 10 << 20  #: GET /sessions/{id} without options, at --turns
MAX_KEPT_BYTES = 100 << 20  #: proxy resident memory after everything, over before
PAGE = 100  #: turns per page of the paged reads (a viewer's page)
ENGINE_MAIN = f"""
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(call_tools=True, completion_tokens={COMPLETION}),
                         int(sys.argv[2])))
"""
PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                           "parameters": PATH}}]  # fmt: skip


def tool_output(turn: int) -> str:
    """What the tool sends back after `turn`: 12 words, growing by one every 250 turns."""
    return " ".join(f"out{turn}_{j}" for j in range(12 + turn // 250))


@dataclass
class Tally:
    """What the agents were told (usage), to reconcile with the log."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    longest_prompt: int = 0


class Agent:
    """One opencode-shaped session: its conversation kept serialised, a message appended a turn
    (re-serialising 100 k tokens of history every turn would make the agent the benchmark)."""

    def __init__(self, http: aiohttp.ClientSession, proxy: str, session_id: str, run: str) -> None:
        self.http, self.proxy, self.session_id, self.run = http, proxy, session_id, run
        system = {"role": "system", "content": " ".join(f"sys{j}" for j in range(SYSTEM_WORDS))}
        task = {"role": "user", "content": "The test in tests/test_io.py fails; fix it."}
        self.messages = b"[" + orjson.dumps(system) + b"," + orjson.dumps(task)
        self.head = b'{"model":"tiny","max_tokens":%d,"tools":%s,"messages":' % (
            MAX_TOKENS, orjson.dumps(TOOLS))  # fmt: skip
        self.headers: dict[str, str] = {}
        self.url = ""

    async def run_turns(self, turns: int, tally: Tally) -> None:
        create = {"run_id": self.run, "session_id": self.session_id}
        created = await self._post(f"{self.proxy}/sessions", orjson.dumps(create))
        self.headers = {"Authorization": f"Bearer {created['api_key']}"}
        self.url = created["base_url"] + "/chat/completions"
        started = time.perf_counter()
        for turn in range(turns):
            if turn and turn % 1000 == 0 and self.session_id == "long-0":
                print(f"  {self.session_id}: {turn} turns, {time.perf_counter() - started:.0f} s, "
                      f"prompt {tally.longest_prompt:,} tokens", flush=True)  # fmt: skip
            if turn % SIDE_EVERY == SIDE_EVERY - 1:
                title = [{"role": "user", "content": f"A title for this session, call {turn}"}]
                body = orjson.dumps({"model": "tiny", "max_tokens": MAX_TOKENS, "messages": title})
                self._count(await self._post(self.url, body, self.headers), tally)
                continue
            answer = await self._post(self.url, self.head + self.messages + b"]}", self.headers)
            self._count(answer, tally)
            reply = {k: v for k, v in answer["choices"][0]["message"].items() if v is not None}
            result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                      "content": tool_output(turn)}  # fmt: skip
            self.messages += b"," + orjson.dumps(reply) + b"," + orjson.dumps(result)
        orchestrator = {"Authorization": f"Bearer {created['orchestrator_key']}"}
        finish = f"{self.proxy}/sessions/{self.session_id}/finish"
        await self._post(finish, b'{"status":"completed"}', orchestrator)

    @staticmethod
    def _count(answer: dict[str, object], tally: Tally) -> None:
        usage = answer["usage"]
        assert isinstance(usage, dict)
        tally.prompt_tokens += usage["prompt_tokens"]
        tally.completion_tokens += usage["completion_tokens"]
        tally.longest_prompt = max(tally.longest_prompt, usage["prompt_tokens"])
        tally.calls += 1

    async def _post(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> dict:
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with self.http.post(url, data=body, headers=headers) as resp:
            if resp.status not in (200, 201):
                raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:500]}")
            answer: dict = await resp.json(loads=orjson.loads)
            return answer


def children(pid: int) -> list[int]:
    """The processes `pid` started (the proxy's session reader), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


class ResidentMemory:
    """Resident sets summed over `pids()`, sampled every 50 ms in a thread: now, and the peak
    since a mark."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def now(self) -> int:
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        return total

    def mark(self) -> None:
        self.peak = self.now()

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.now())

    def stop(self) -> None:
        self._stop.set()


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
        size, address = 0, f"{base}?limit={PAGE}"
        while address:
            async with http.get(address) as resp:
                body = await resp.read()
            size += len(body)
            address = orjson.loads(body)["next"]
        return size

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
        size, address = 0, f"{base}?limit={PAGE}"
        while address:
            async with http.get(address) as resp:
                body = await resp.read()
            size += len(body)
            address = orjson.loads(body)["next"]
        return size

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


def mib(n: float) -> str:
    return f"{n / (1 << 20):7.1f} MiB"


async def main(args: argparse.Namespace) -> int:
    dbs = Databases(await asyncio.to_thread(database_url))
    servers = Servers()
    failed = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        try:
            await dbs.setup()
            url = await dbs.fresh()
            python = sys.executable
            engine = servers.start("engine", [python, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
            await servers.wait_ready(engine, http, "/health")
            env = {**os.environ, "TRAJSTORE_DATABASE_URL": url}
            serve = ["proxy", "--engine", engine.url, "--port", "{port}"]
            proxy = servers.start("trajstore", [*proxy_argv(python, None), *serve], env=env)
            await servers.wait_ready(proxy, http, "/health")
            memory = ResidentMemory(lambda: [proxy.process.pid])
            reader = ResidentMemory(lambda: children(proxy.process.pid))
            before = memory.now()

            # The sessions, at once: `--sessions` long ones and a small one.
            plan = [(f"long-{i}", args.turns) for i in range(args.sessions)]
            plan.append(("small", args.small))
            through = plan
            if args.direct is not None:
                # Read at full size on a loaded machine: the sessions written straight to the
                # log in tests/long_session.py's shape, and one of `--direct` calls through the
                # proxy for the figures of writing.
                async with await EventStore.open(url) as store:
                    for name, turns in plan:
                        await record_long_session(store, turns, session_id=name,
                                                  run_id=f"run-{name}")  # fmt: skip
                through = [("writer", args.direct)]
            tallies = {name: Tally() for name, _ in through}
            start = time.perf_counter()
            await asyncio.gather(*(
                Agent(http, proxy.url, name, f"run-{name}").run_turns(turns, tallies[name])
                for name, turns in through
            ))  # fmt: skip
            wrote = time.perf_counter() - start
            after_writes, peak_writes = memory.now(), memory.peak
            calls = sum(t.calls for t in tallies.values())
            longest = max(t.longest_prompt for t in tallies.values())
            print(f"{len(through)} session(s) ({', '.join(f'{t:,}' for _, t in through)} calls) "
                  f"through the proxy in {wrote:.1f} s ({calls / wrote:.0f} calls/s); "
                  f"longest prompt {longest:,} tokens")  # fmt: skip

            # Tokens the agents were told of = tokens the log holds.
            async with await EventStore.open(url) as store:
                for name, _ in through:
                    record = rebuild_session(name, await store.read_session(name))
                    stored_prompt = sum(t.n_prompt_tokens or 0 for t in record.turns)
                    stored_completion = sum(len(c.token_ids) for t in record.turns
                                            for c in t.choices.values())  # fmt: skip
                    tally = tallies[name]
                    received = (tally.prompt_tokens, tally.completion_tokens)
                    ok = (stored_prompt, stored_completion) == received
                    failed |= not ok
                    print(f"  {name}: received {tally.prompt_tokens:,} prompt + "
                          f"{tally.completion_tokens:,} completion tokens, stored "
                          f"{stored_prompt:,} + {stored_completion:,}: "
                          f"{'ok' if ok else 'MISMATCH'}")  # fmt: skip
                start = time.perf_counter()
                projected = await Projector(store).run_once()
                print(f"  trajstore project: {projected} sessions in "
                      f"{time.perf_counter() - start:.2f} s")  # fmt: skip

            # Every read path, on the small session and on a long one, timed; then `--rounds`
            # more of every path over every long session.
            memory.mark()
            reader.mark()
            names = [name for name, _ in plan]
            app = create_app(url, ViewerSettings())
            async with app.router.lifespan_context(app):
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://v") as viewer:

                    async def paths(name: str, turns: int, runs: int) -> dict[str, Reading]:
                        others = [other for other in names if other != name][:2]
                        return await read_paths(http, proxy.url, url, viewer, name, f"run-{name}",
                                                turns, runs, others)  # fmt: skip

                    small = await paths("small", args.small, args.runs)
                    large = await paths("long-0", args.turns, args.runs)
                    for round_ in range(args.rounds):
                        for name, turns in plan[:-1]:
                            await paths(name, turns, 1)
                        print(
                            f"  round {round_ + 1} of every read path over the long sessions: "
                            f"proxy {mib(memory.now())}, reader {mib(reader.now())}",
                            flush=True,
                        )
            peak_reads, reader_peak = memory.peak, reader.peak
            await asyncio.sleep(1)
            after, reader_after = memory.now(), reader.now()
            memory.stop()
            reader.stop()

            ratio = args.turns / args.small
            print(f"\nread paths, medians of {args.runs} run(s): {args.small:,} turns, "
                  f"{args.turns:,} turns, their ratio (linear: about {ratio:.0f}x)")  # fmt: skip
            print(f"  {'path':<30} {'small':>9} {'large':>9} {'ratio':>6} {'large answer':>14}")
            for name, reading in large.items():
                times = reading.median / small[name].median
                print(f"  {name:<30} {small[name].median:8.3f}s {reading.median:8.3f}s "
                      f"{times:5.1f}x {mib(reading.size):>14}")  # fmt: skip
            whole = large["GET /sessions/{id}"].size
            size_ok = whole < MAX_GET_BYTES
            failed |= not size_ok
            print(f"\nGET /sessions/{{id}} at {args.turns:,} turns: {mib(whole)} "
                  f"({'ok' if size_ok else 'OVER'}: under {mib(MAX_GET_BYTES)})")  # fmt: skip
            kept_ok = after - before < MAX_KEPT_BYTES
            failed |= not kept_ok
            print("proxy resident memory:")
            print(f"  before the sessions  {mib(before)}")
            print(f"  peak while writing   {mib(peak_writes)}")
            print(f"  after the writes     {mib(after_writes)}")
            print(f"  peak while reading   {mib(peak_reads)}")
            print(f"  after everything     {mib(after)}  ({mib(after - before)} over before: "
                  f"{'ok' if kept_ok else 'OVER'}, under {mib(MAX_KEPT_BYTES)})")  # fmt: skip
            print(f"the session reader (proxy.reader, its own process): peak {mib(reader_peak)}, "
                  f"after the reads {mib(reader_after)} (it exits when idle)")  # fmt: skip
            pages = f"  every page of {PAGE}, cold"
            grew = large[pages].median / small[pages].median
            print(f"paged reads: every page of {PAGE} turns, cold, took {grew:.1f}x as long at "
                  f"{args.turns:,} turns as at {args.small:,} (linear: about {ratio:.0f}x; a "
                  f"rebuild per page: about {ratio * ratio:.0f}x)")  # fmt: skip

            if args.baseline:
                # The same proxy reads, served by another checkout's proxy (main: before).
                env = {**os.environ, "TRAJSTORE_DATABASE_URL": url}
                argv = [*proxy_argv(python, Path(args.baseline)), *serve]
                other = servers.start("trajstore-baseline", argv, env=env)
                await servers.wait_ready(other, http, "/health")
                base_memory = ResidentMemory(lambda: [other.process.pid])
                base_before = base_memory.now()
                was_small = await baseline_paths(http, other.url, "small", args.small, args.runs)
                was_large = await baseline_paths(http, other.url, "long-0", args.turns, args.runs)
                for _ in range(args.rounds):
                    for name, turns in plan[:-1]:
                        await baseline_paths(http, other.url, name, turns, 1, paged=False)
                base_peak = base_memory.peak
                await asyncio.sleep(1)
                base_after = base_memory.now()
                base_memory.stop()
                print(f"\nthe proxy's reads, {args.baseline} (before) and this checkout (after), "
                      f"medians of {args.runs}")  # fmt: skip
                print(f"  {'path':<30} {'before':>9} {'after':>9} {'before':>9} {'after':>9}")
                print(f"  {'':<30} {args.small:>9,} {args.small:>9,} {args.turns:>9,} "
                      f"{args.turns:>9,}")  # fmt: skip
                for name, was in was_large.items():
                    print(f"  {name:<30} {was_small[name].median:8.3f}s "
                          f"{small[name].median:8.3f}s {was.median:8.3f}s "
                          f"{large[name].median:8.3f}s")  # fmt: skip
                print(f"  its resident memory: {mib(base_before)} before the reads, peak "
                      f"{mib(base_peak)}, after {mib(base_after)} ({mib(base_after - base_before)}"
                      " over before)")  # fmt: skip

            # SQL over the turns view, before (0017) and after migration 0020, same data.
            sql = await turns_sql(url, [("run-small", args.small), ("run-long-0", args.turns)],
                                  whole_up_to=args.small)  # fmt: skip
            print(f"\nSQL over `turns` WHERE run_id = ..., least of 2 (>{SQL_TIMEOUT_S}: cut off)")
            print(f"  {'query':<34} {'run':<11} {'0017':>9} {'0020':>9}")

            def secs(value: float | None) -> str:
                return f"{value:8.3f}s" if value is not None else f"{'>' + str(SQL_TIMEOUT_S):>8}s"

            for (name, run), took in sql["after"].items():
                was = sql["before"].get((name, run), "-")
                was_text = secs(was) if was != "-" else f"{'-':>9}"  # type: ignore[arg-type]
                print(f"  {name:<34} {run:<11} {was_text} {secs(took)}")
        finally:
            servers.stop()
            await dbs.drop_all()
    return 1 if failed else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI: 2 x 500 turns and 100, 1 run")
    parser.add_argument("--sessions", type=int, default=3, help="long sessions at once")
    parser.add_argument("--turns", type=int, default=5_000, help="model calls per long session")
    parser.add_argument("--small", type=int, default=1_000, help="model calls of the small one")
    parser.add_argument("--runs", type=int, default=3, help="reads of each path (medians)")
    parser.add_argument(
        "--direct",
        type=int,
        metavar="N",
        help="write the sessions straight to the log, and "
        "N calls through the proxy (a loaded machine: 5,000 turns through it take an hour)",
    )
    parser.add_argument(
        "--baseline", metavar="DIR", help="also time the proxy's reads served by DIR's proxy"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="untimed rounds of every path over every long session (memory)",
    )
    args = parser.parse_args()
    if args.quick:
        args.sessions, args.turns, args.small, args.runs, args.rounds = 2, 500, 100, 1, 1
    return args


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
