"""One run's latency while another floods the same engine, with and without fair admission.

    python benchmarks/fairness.py [--quick] [--duration 6] [--runs 3] [--capacity 4]
                                  [--flood 32] [--workers 2] [--engine-delay 0.05] [--spread 0.5]

Starts a fake engine that serves at most `capacity` requests at once and queues the rest in
arrival order, as vLLM does past its batch (`max_num_seqs`); each request takes `engine-delay`
seconds there, give or take `spread` of it (uniformly: agents' answers differ in length; with
`--spread 0` every request takes as long, the flood's requests end together, and another run's
request that arrives just after waits a whole request for the next slot). Then, for each
mode, a `trajstore proxy` recording into a scratch database:

- `no admission`: the proxy as its users get it by default, every request passed on at once;
- `fair`: `TRAJSTORE_ADMISSION_MAX_IN_FLIGHT` = `capacity`, so requests wait in the proxy, where
  the runs take turns (`proxy.admission`), instead of in the engine's one FIFO.

In each mode run B (`workers` closed-loop agents, one session each) is measured alone (its
baseline), then while run A floods (`flood` closed-loop agents sending back to back). Printed:
B's p50 and p99 in both phases and the ratio loaded ÷ baseline, medians over the runs; the
target for `fair` is a p50 ratio of at most 1.5. Non-streamed chat completions of 8 tokens; the
engine's work is a sleep, so the figures are the queueing, not the machine's CPU (sized for two
cores: the flood is bounded by the engine's capacity). Exits non-zero when a request fails.

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one; it needs the right to
create databases.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
import orjson
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from proxy_overhead import ROOT, Servers, new_client, percentile

from trajstore.client import AsyncClient
from trajstore.store.embedded import database_url

#: The engine in its own process: the fake vLLM, slow by `delay`, serving `capacity` at once.
ENGINE_MAIN = """
import asyncio, random, sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

class Busy(FakeEngine):
    def __init__(self, capacity, delay, spread):
        super().__init__()
        self.slots = asyncio.Semaphore(capacity)  # FIFO: waiters are served in arrival order
        self.work = (delay * (1 - spread), delay * (1 + spread))

    async def _serve(self, request, api):
        async with self.slots:
            await asyncio.sleep(random.uniform(*self.work))
            return await super()._serve(request, api)

engine = Busy(int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5]))
uvloop.run(serve_forever(engine, int(sys.argv[2])))
"""

#: Run A's agents in a process of their own, so that B's clock is not shared with the flood's:
#: they send requests back to back until the process is ended.
FLOOD_MAIN = """
import asyncio, sys
import aiohttp, orjson, uvloop

async def agent(http, url, headers, body):
    while True:
        try:
            async with http.post(url, data=body, headers=headers) as resp:
                await resp.read()
        except aiohttp.ClientError:
            await asyncio.sleep(0.01)

async def main():
    routes, body = orjson.loads(sys.argv[1]), sys.argv[2].encode()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        await asyncio.gather(*(agent(http, url, headers, body) for url, headers in routes))

uvloop.run(main())
"""

BODY = orjson.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "fix the test"}], "max_tokens": 8}
)


@dataclass
class Plan:
    """What to measure."""

    duration: float
    runs: int
    capacity: int
    flood: int
    workers: int
    engine_delay: float
    spread: float


@dataclass
class Tally:
    """What one run's agents saw."""

    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)


async def new_sessions(proxy: str, run_id: str, n: int) -> list[tuple[str, dict[str, str]]]:
    """`n` sessions of `run_id`: (chat URL, headers) of each."""
    routes = []
    async with AsyncClient(proxy) as client:
        for _ in range(n):
            created = await client.create_session(run_id)
            headers = {"Authorization": f"Bearer {created.api_key}"}
            headers["Content-Type"] = "application/json"
            routes.append((f"{created.base_url}/chat/completions", headers))
    return routes


async def agent(
    http: aiohttp.ClientSession,
    route: tuple[str, dict[str, str]],
    until: float,
    tally: Tally,
) -> None:
    """Send requests back to back until `until` (monotonic); latencies into `tally`."""
    url, headers = route
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            async with http.post(url, data=BODY, headers=headers) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            status, kind = 0, type(exc).__name__
        else:
            kind = f"HTTP {status}"
        if status == 200:
            tally.latencies.append(time.monotonic() - started)
        else:
            tally.errors[kind] += 1


async def phase(
    http: aiohttp.ClientSession,
    b_routes: list[tuple[str, dict[str, str]]],
    a_routes: list[tuple[str, dict[str, str]]],
    duration: float,
) -> Tally:
    """B's agents measured for `duration`, with A's flooding (when given, from its own process)
    from a second before B starts to after it ends: B never sees the flood ramp up or down."""
    flood = None
    if a_routes:
        argv = [sys.executable, "-c", FLOOD_MAIN, orjson.dumps(a_routes).decode(), BODY.decode()]
        flood = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.DEVNULL)
        await asyncio.sleep(1)
    try:
        tally = Tally()
        until = time.monotonic() + duration
        await asyncio.gather(*(agent(http, r, until, tally) for r in b_routes))
    finally:
        if flood is not None:
            flood.terminate()
            await flood.wait()
    return tally


@dataclass
class Figures:
    """B's latencies in one run of one mode."""

    base_p50: float
    base_p99: float
    loaded_p50: float
    loaded_p99: float
    errors: int

    @property
    def ratio_p50(self) -> float:
        return self.loaded_p50 / self.base_p50

    @property
    def ratio_p99(self) -> float:
        return self.loaded_p99 / self.base_p99


async def measure(
    servers: Servers, dbs: Databases, engine_url: str, fair: bool, plan: Plan
) -> list[Figures]:
    """Start a proxy for the mode and run B alone, then B beside A's flood, `plan.runs` times."""
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": await dbs.fresh()}
    env.pop("TRAJSTORE_ADMISSION_MAX_IN_FLIGHT", None)
    if fair:
        env["TRAJSTORE_ADMISSION_MAX_IN_FLIGHT"] = str(plan.capacity)
    argv = [sys.executable, "-m", "trajstore", "proxy", "--engine", engine_url]
    proxy = servers.start("fair" if fair else "plain", [*argv, "--port", "{port}"], env=env)
    http = new_client()
    figures = []
    try:
        await servers.wait_ready(proxy, http, "/health")
        b_routes = await new_sessions(proxy.url, "run-b", plan.workers)
        a_routes = await new_sessions(proxy.url, "run-a", plan.flood)
        await phase(http, b_routes, [], 1.0)  # warm up: connections, caches
        for _ in range(plan.runs):
            alone = await phase(http, b_routes, [], plan.duration)
            loaded = await phase(http, b_routes, a_routes, plan.duration)
            figures.append(
                Figures(
                    percentile(alone.latencies, 0.5),
                    percentile(alone.latencies, 0.99),
                    percentile(loaded.latencies, 0.5),
                    percentile(loaded.latencies, 0.99),
                    sum(alone.errors.values()) + sum(loaded.errors.values()),
                )
            )
            for kind, count in (alone.errors + loaded.errors).items():
                print(f"  {count} x {kind}", file=sys.stderr)
    finally:
        await http.close()
        proxy.process.terminate()
        await asyncio.to_thread(proxy.process.wait, 15)
    return figures


def report(mode: str, figures: list[Figures]) -> None:
    def median(value: str) -> float:
        return float(statistics.median(getattr(f, value) for f in figures))

    print(
        f"{mode:<13} B alone p50 {1000 * median('base_p50'):6.1f} ms  p99 "
        f"{1000 * median('base_p99'):6.1f} ms | with A flooding p50 "
        f"{1000 * median('loaded_p50'):6.1f} ms  p99 {1000 * median('loaded_p99'):6.1f} ms | "
        f"ratio p50 {median('ratio_p50'):.2f}x  p99 {median('ratio_p99'):.2f}x"
    )


async def main(plan: Plan) -> int:
    dbs = Databases(await asyncio.to_thread(database_url))
    servers = Servers()
    http = new_client()
    try:
        await dbs.setup()
        engine = servers.start(
            "engine",
            [sys.executable, "-c", ENGINE_MAIN, str(ROOT), "{port}", str(plan.capacity),
             str(plan.engine_delay), str(plan.spread)],
        )  # fmt: skip
        await servers.wait_ready(engine, http, "/health")
        print(
            f"engine: {plan.capacity} at once, {1000 * plan.engine_delay:.0f} ms each "
            f"(+-{100 * plan.spread:.0f}%); run B: "
            f"{plan.workers} agents; run A: {plan.flood} agents flooding; {plan.runs} x "
            f"{plan.duration:.0f} s per phase (medians)"
        )
        plain = await measure(servers, dbs, engine.url, False, plan)
        report("no admission", plain)
        fair = await measure(servers, dbs, engine.url, True, plan)
        report("fair", fair)
        ratio = statistics.median(f.ratio_p50 for f in fair)
        print(f"fair: B's p50 with A flooding / alone = {ratio:.2f}x (target <= 1.5x)")
        return 1 if any(f.errors for f in plain + fair) else 0
    finally:
        await http.close()
        servers.stop()
        await dbs.drop_all()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~30 s run, for CI")
    parser.add_argument("--duration", type=float, help="seconds per phase [6; quick 3]")
    parser.add_argument("--runs", type=int, help="runs per mode [3; quick 1]")
    parser.add_argument("--capacity", type=int, default=4, help="engine's requests at once")
    parser.add_argument("--flood", type=int, default=32, help="run A's agents")
    parser.add_argument("--workers", type=int, default=2, help="run B's agents")
    parser.add_argument("--engine-delay", type=float, default=0.05, help="seconds per request")
    parser.add_argument("--spread", type=float, default=0.5, help="+- fraction of the delay")
    args = parser.parse_args()
    plan = Plan(
        duration=args.duration or (3.0 if args.quick else 6.0),
        runs=args.runs or (1 if args.quick else 3),
        capacity=args.capacity,
        flood=args.flood,
        workers=args.workers,
        engine_delay=args.engine_delay,
        spread=args.spread,
    )
    sys.exit(uvloop.run(main(plan)))
