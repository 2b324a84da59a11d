"""What an engine that dials in costs: a streamed request over a relay, against a direct one.

    python benchmarks/relay.py [--quick] [--requests 200] [--runs 3] [--tokens 64]

One fake engine process (tests/proxy/fake_engine.py, answering at once from a cache, so what is
measured is the proxy's and the relay's work). Two `trajstore proxy` processes record into
scratch databases: one reaches the engine at its URL, the other (`--relays-only`) through a
`trajstore relay` process that dialled in over a WebSocket. Both take the same streamed chat
requests, one after another (one agent at a time). CPU per request is utime + stime (/proc) of
the proxy, plus the relay's on the relayed path, over a run divided by its requests; latency is
taken at the client, to the stream's end. Runs alternate which path goes first. Figures are
medians; the relayed path is given as a ratio of the direct one, and its added p50 in ms.

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

import aiohttp
import orjson
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from overhead_report import print_sequential
from proxy_overhead import ROOT, Server, Servers, cpu_seconds

from trajstore.client import AsyncClient, SessionInfo
from trajstore.store.embedded import database_url

ENGINE_MAIN = """
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(instant=True), int(sys.argv[2])))
"""


async def ready(http: aiohttp.ClientSession, proxy: Server, deadline: float = 60.0) -> None:
    """Until the proxy has a healthy engine (for the relayed one: its relay dialled in)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        try:
            async with http.get(proxy.url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{proxy.name} has no healthy engine; its log:\n{proxy.log_tail()}")


async def streamed(http: aiohttp.ClientSession, session: SessionInfo, body: bytes) -> float:
    """One streamed chat request, read to its end; its latency."""
    headers = {"Authorization": f"Bearer {session.api_key}"}
    started = time.perf_counter()
    async with http.post(session.base_url + "/chat/completions", data=body,
                         headers=headers) as resp:  # fmt: skip
        raw = await resp.read()
    latency = time.perf_counter() - started
    if resp.status != 200 or not raw.rstrip().endswith(b"data: [DONE]"):
        raise RuntimeError(f"the proxy answered {resp.status}: {raw[-300:]!r}")
    return latency


async def measure(
    http: aiohttp.ClientSession, proxy: Server, pids: list[int], n: int, body: bytes, run: int
) -> tuple[list[float], list[float]]:
    """CPU seconds per request of each of `pids`, and the latencies, for `n` requests."""
    async with AsyncClient(proxy.url) as client:
        session = (await client.create_session(f"bench-{run}")).info
    await asyncio.sleep(0.3)  # the previous run's events written: not charged to this one
    before = [cpu_seconds([pid]) for pid in pids]
    latencies = [await streamed(http, session, body) for _ in range(n)]
    return [(cpu_seconds([pid]) - b) / n for pid, b in zip(pids, before, strict=True)], latencies


async def main(args: argparse.Namespace) -> int:
    dbs = Databases(await asyncio.to_thread(database_url))
    servers = Servers()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    body = orjson.dumps({
        "model": "tiny", "messages": [{"role": "user", "content": "Fix the failing test."}],
        "max_tokens": args.tokens, "stream": True,
    })  # fmt: skip
    try:
        await dbs.setup()
        python = sys.executable
        engine = servers.start("engine", [python, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
        await servers.wait_ready(engine, http, "/health")
        proxy = [python, "-m", "trajstore", "proxy", "--port", "{port}"]
        env = {**os.environ, "TRAJSTORE_DATABASE_URL": await dbs.fresh()}
        direct = servers.start("direct", [*proxy, "--engine", engine.url], env=env)
        env = {**os.environ, "TRAJSTORE_DATABASE_URL": await dbs.fresh()}
        relayed = servers.start("relayed", [*proxy, "--relays-only"], env=env)
        await servers.wait_ready(relayed, http, "/metrics")
        dial = ["--proxy", relayed.url, "--engine", engine.url, "--name", "bench"]
        relay = servers.start("relay", [python, "-m", "trajstore", "relay", *dial])
        await ready(http, direct)
        await ready(http, relayed)
        paths = {"direct": (direct, [direct.process.pid]),
                 "relay": (relayed, [relayed.process.pid, relay.process.pid])}  # fmt: skip
        cpu: dict[str, list[float]] = {name: [] for name in paths}
        relay_cpu: list[float] = []
        latency: dict[str, list[float]] = {name: [] for name in paths}
        for server, pids in paths.values():  # warm up
            await measure(http, server, pids, 20, body, -1)
        for run in range(args.runs):
            order = ["direct", "relay"] if run % 2 == 0 else ["relay", "direct"]
            for name in order:
                server, pids = paths[name]
                per_request, times = await measure(http, server, pids, args.requests, body, run)
                cpu[name].append(sum(per_request))
                latency[name] += times
                if name == "relay":
                    relay_cpu.append(per_request[1])
    finally:
        await http.close()
        servers.stop()
        await dbs.drop_all()

    print(f"relay: fake engine (instant), streamed chat of {args.tokens} tokens, "
          f"{args.requests} requests x {args.runs} runs per path, one at a time")  # fmt: skip
    print_sequential(cpu, latency, ("direct", "relay"), "request", widths=(8, 32))
    ratio = statistics.median(cpu["relay"]) / statistics.median(cpu["direct"])
    p50 = {name: statistics.median(latency[name]) for name in latency}
    added = p50["relay"] - p50["direct"]
    relay_alone = 1e3 * statistics.median(relay_cpu)
    print(f"over the relay: {ratio:.2f}x the direct path's CPU per request (proxy + relay; "
          f"the relay process alone {relay_alone:.3f} ms), "
          f"p50 {1e3 * added:+.2f} ms = {added / p50['direct']:+.1%}")  # fmt: skip
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run, for CI")
    parser.add_argument("--requests", type=int, help="requests per run and path [200; quick 50]")
    parser.add_argument("--runs", type=int, help="runs per path [3; quick 2]")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per answer [64]")
    args = parser.parse_args()
    args.requests = args.requests or (50 if args.quick else 200)
    args.runs = args.runs or (2 if args.quick else 3)
    sys.exit(uvloop.run(main(args)))
