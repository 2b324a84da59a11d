"""Long agent sessions through the proxy, then every read path over them (issues 35, 43).

    python benchmarks/long_sessions.py [--quick] [--sessions 3] [--turns 5000] [--small 1000]
                                       [--runs 3] [--rounds 2] [--baseline DIR] [--direct N]

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
`--direct N`: the sessions written straight to the log (tests/long_session.py's shape) and N
calls through the proxy, so that a loaded machine reads at full size without an hour of writes.

This module is the command line, the run, the proxy's memory and the report; the agents and their
engine are in long_sessions_agents.py, the read paths and the SQL in long_sessions_reads.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from long_sessions_agents import ENGINE_MAIN, Agent, Tally
from long_sessions_reads import PAGE, SQL_TIMEOUT_S, Reading, baseline_paths, read_paths, turns_sql
from overhead_servers import ROOT, Servers, proxy_argv

from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.store.projection import Projector

sys.path.insert(0, str(ROOT))
from tests.long_session import record_long_session
from trajstore.store.sessions import rebuild_session
from trajstore.viewer import ViewerSettings, create_app

MAX_GET_BYTES = 10 << 20  #: GET /sessions/{id} without options, at --turns
MAX_KEPT_BYTES = 100 << 20  #: proxy resident memory after everything, over before


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
