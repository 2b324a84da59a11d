"""What the recording proxy costs, against going direct and a bare pass-through, in the same run.

    python benchmarks/proxy_overhead.py [--quick] [--duration 4] [--runs 2] [--sessions-soak 1000]
                                        [--context-tokens 0] [--vllm] [--apis]
                                        [--baseline DIR] [--floors] [--tracing]

Starts the instant fake engine (tests/proxy/fake_engine.py, cached answers), the floor
(benchmarks/passthrough.py: aiohttp relay, no recording) and `trajstore proxy` recording into a
scratch database; "direct" is load straight to the engine. This process drives closed-loop load
(C workers, each sending chat completions of max_tokens 64 back to back for a fixed time),
non-streaming and streaming, and reads each server's CPU time from /proc before and after: for
trajstore also that of its PostgreSQL backends, after its writer has drained. Then every session
is finished and the tokens stored are reconciled with the tokens the clients received, and a
soak sends N concurrent streaming requests, one per fresh session, through trajstore. With
`--vllm`, a fourth target "direct+ids" sends the engine directly what trajstore sends it (token
ids and logprobs asked for), which separates the engine's cost of them from the proxy's own.
With `--context-tokens N`, each request carries N tokens of earlier turns (tool calls and their
output), as an agent deep into an episode sends it: the proxy parses, forwards and records it.
With `--apis`, trajstore is also measured serving the same requests as Anthropic Messages and
OpenAI Responses (translated to the engine's chat completions and back, `proxy.apis`), each on
its own sessions, and their CPU per request is printed against chat's.

`--baseline DIR` also serves another checkout's proxy (e.g. `git worktree add /tmp/base main`),
"trajstore-baseline", recording into the same database, in the same rotation: before and after,
same machine, same run. `--floors` adds the floor's pass-through served as a bare ASGI app by
the proxy's own server ("floor-asgi": uvicorn, `proxy.server`), which tells the server's share
of the proxy's cost from the proxy's own work. `--tracing` adds two more proxies of this
checkout with OpenTelemetry tracing on (`proxy.tracing`, `TRAJSTORE_TRACING=otlp`):
"trajstore-traced" exporting to a real OTLP/HTTP receiver in this process
(tests/proxy/otlp_receiver.py, decoding every batch), "trajstore-traced-down" to a closed port
(a collector that is down); their CPU per request is printed against "trajstore"'s, tracing off,
same run, and the spans received against the requests sent.

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one; it needs the right to
create databases. Prints medians over the runs, then the ratios the proxy is held to. Exits
non-zero when a token is lost or the soak sees an error. The servers and requests are in
`overhead_servers.py`, the load and the sessions in `overhead_load.py`, the report in
`overhead_report.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from overhead_load import (
    DbBackends,
    Load,
    Route,
    Sample,
    Tally,
    Target,
    create_sessions,
    finish_sessions,
    new_client,
    one_request,
    percentile,
    reconcile,
)
from overhead_report import (
    print_apis,
    print_ratios,
    print_table,
    print_throughput,
    print_tracing,
    summarise,
)
from overhead_servers import (
    ENGINE_MAIN,
    MAX_TOKENS,
    MESSAGES,
    ROOT,
    Servers,
    answer_sizes,
    history,
    proxy_argv,
    request_body,
    start_vllm,
)
from overhead_servers import Server as Server  # the other benchmarks import these from here
from overhead_servers import cpu_seconds as cpu_seconds
from overhead_servers import free_port as free_port

from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import database_url

# -- the run ------------------------------------------------------------------------------------


@dataclass
class Plan:
    """What to measure, from the command line."""

    levels: list[int]
    seconds: float
    runs: int
    soak: int
    vllm: bool = False  # a real vLLM (CPU, generated tiny model) instead of the fake engine
    apis: bool = False  # also Anthropic Messages and OpenAI Responses through trajstore
    baseline: Path | None = None  # another checkout's proxy, measured beside this one
    floors: bool = False  # also the pass-through as a bare ASGI app on the proxy's server
    tracing: bool = False  # also proxies with tracing on: a live collector, and one down


async def soak(http: aiohttp.ClientSession, targets: list[Target], db: DbBackends, n: int) -> bool:
    """N concurrent streaming sessions through trajstore, one request each; then reconcile
    (everything stored against everything every trajstore target's clients received)."""
    target = next(t for t in targets if t.name == "trajstore")
    assert target.server is not None
    routes = await create_sessions(http, target.server.url, [f"soak-{i}" for i in range(n)])
    tally = Tally()
    body = request_body(True)
    started = time.perf_counter()
    async with new_client() as client:
        await asyncio.gather(*(one_request(client, route, True, body, tally) for route in routes))
    elapsed = time.perf_counter() - started
    target.received_tokens += tally.tokens
    await finish_sessions(http, routes)
    errors = sum(tally.errors.values())
    print(
        f"\nsoak: {n} concurrent streaming sessions through trajstore in {elapsed:.2f} s: "
        f"p50 {1000 * percentile(tally.latencies, 0.5):.0f} ms, "
        f"p99 {1000 * percentile(tally.latencies, 0.99):.0f} ms, "
        f"ttft p50 {1000 * percentile(tally.ttfts, 0.5):.0f} ms, errors {errors}"
        + "".join(f"\n  {count} x {kind}" for kind, count in tally.errors.items())
    )
    return await reconcile(targets, db, f"after the soak of {n}") and errors == 0


async def collected(db: DbBackends, received: Any, sessions: int) -> bool:
    """Every call through trajstore-traced, and each of its finished sessions, reached the
    collector as a span (waiting up to 15 s for the exporter's last batches)."""
    calls = await db.conn.fetchval(
        "SELECT count(*) FROM events WHERE event_type = 'request_received' "
        "AND session_id LIKE 'trajstore-traced-%' AND session_id NOT LIKE 'trajstore-traced-down%'"
    )
    expected = calls + sessions
    deadline = time.monotonic() + 15
    while len(received.spans) < expected and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    got = len(received.spans)
    verdict = "ok" if got == expected else "MISMATCH"
    print(f"tracing: {got} spans received for {calls} calls and {sessions} sessions: {verdict}")
    return got == expected


async def main(plan: Plan) -> int:
    url = await asyncio.to_thread(database_url)
    dbs = Databases(url)
    servers = Servers()
    http = new_client()  # for everything but the load itself
    conn: asyncpg.Connection | None = None
    tracing = contextlib.ExitStack()  # the OTLP receiver of --tracing
    try:
        await dbs.setup()
        scratch = await dbs.fresh()
        python = sys.executable
        if plan.vllm:
            engine = await asyncio.to_thread(start_vllm, servers)
        else:
            engine = servers.start("engine", [python, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
        await servers.wait_ready(engine, http, "/health")
        passthrough = [python, "benchmarks/passthrough.py", "--engine", engine.url]
        floor = servers.start("floor", [*passthrough, "--port", "{port}"])
        env = {**os.environ, "TRAJSTORE_DATABASE_URL": scratch}
        serve = ["proxy", "--engine", engine.url, "--port", "{port}"]
        ours = servers.start("trajstore", [*proxy_argv(python, None), *serve], env=env)
        await servers.wait_ready(floor, http, "/health")  # the engine's, through the floor
        await servers.wait_ready(ours, http, "/health")
        conn = await asyncpg.connect(asyncpg_dsn(scratch))
        db = DbBackends(conn, scratch.partition("?")[0].rpartition("/")[2])
        print(await answer_sizes(http, engine.url))

        chat = "/v1/chat/completions"
        routes = await create_sessions(
            http, ours.url, [f"bench-{i}" for i in range(max(plan.levels))]
        )  # a session per worker
        targets = [
            Target("direct", [Route(engine.url + chat, {})], []),
            Target("floor", [Route(floor.url + chat, {})], [floor.process.pid], floor),
            Target("trajstore", routes, [ours.process.pid], ours),
        ]
        if plan.floors:
            asgi = servers.start("floor-asgi", [*passthrough, "--asgi", "--port", "{port}"])
            await servers.wait_ready(asgi, http, "/health")
            targets.append(Target("floor-asgi", [Route(asgi.url + chat, {})], [asgi.process.pid]))
        if plan.baseline is not None:
            argv = [*proxy_argv(python, plan.baseline), *serve]
            base = servers.start("trajstore-baseline", argv, env=env)
            await servers.wait_ready(base, http, "/health")
            base_routes = await create_sessions(
                http, base.url, [f"baseline-{i}" for i in range(max(plan.levels))]
            )
            routes += base_routes
            targets.append(Target("trajstore-baseline", base_routes, [base.process.pid], base))
        for api in ("messages", "responses") if plan.apis else ():
            api_routes = await create_sessions(
                http, ours.url, [f"bench-{api}-{i}" for i in range(max(plan.levels))], api
            )
            routes += api_routes
            targets.append(
                Target(f"trajstore-{api}", api_routes, [ours.process.pid], ours, api=api)
            )
        if plan.vllm:  # the engine's own cost of what training needs, apart from the proxy's
            targets.append(
                Target("direct+ids", [Route(engine.url + chat, {})], [], asks_like_trajstore=True)
            )
        if plan.tracing:
            sys.path.insert(0, str(ROOT))  # tests/proxy/otlp_receiver.py: the collector
            from tests.proxy import otlp_receiver

            spans = tracing.enter_context(otlp_receiver.http_receiver())
            for name, collector in (
                ("trajstore-traced", spans[0]),
                ("trajstore-traced-down", f"http://127.0.0.1:{free_port()}"),
            ):
                traced_env = {
                    **env,
                    "TRAJSTORE_TRACING": "otlp",
                    "OTEL_EXPORTER_OTLP_ENDPOINT": collector,
                    "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                }
                traced = servers.start(name, [*proxy_argv(python, None), *serve], env=traced_env)
                await servers.wait_ready(traced, http, "/health")
                traced_routes = await create_sessions(
                    http, traced.url, [f"{name}-{i}" for i in range(max(plan.levels))]
                )
                routes += traced_routes
                targets.append(Target(name, traced_routes, [traced.process.pid], traced))
        load = Load(http, engine.process.pid, db, usage=plan.vllm)
        samples: dict[tuple[str, str, int], list[Sample]] = {}
        for stream in (False, True):
            mode = "stream" if stream else "non-stream"
            for conc in plan.levels:
                for run in range(plan.runs):
                    # Rotate who goes first, so no target always meets the warmest machine.
                    shift = run % len(targets)
                    for target in targets[shift:] + targets[:shift]:
                        sample = await load.measure(target, stream, conc, plan.seconds)
                        samples.setdefault((target.name, mode, conc), []).append(sample)
        rows = {
            key: summarise(samples[key])
            for key in sorted(samples, key=lambda k: (k[1] == "stream", k[2], k[0]))
        }
        print(f"\nmedians of {plan.runs} run(s) of {plan.seconds:g} s, max_tokens {MAX_TOKENS}")
        print_table(rows)
        if plan.vllm:
            print_throughput(rows, plan.levels)
        else:
            print_ratios(rows, plan.levels)
        if plan.apis:
            print_apis(rows, plan.levels)
        if plan.tracing:
            print_tracing(rows, plan.levels)
        print()
        await finish_sessions(http, routes)
        ok = await reconcile(targets, db, "load runs")
        if plan.tracing:
            ok = await collected(db, spans[1], max(plan.levels)) and ok
        if plan.soak:
            ok = await soak(http, targets, db, plan.soak) and ok
        return 0 if ok else 1
    finally:
        await http.close()
        if conn is not None:
            await conn.close()
        servers.stop()
        tracing.close()
        await dbs.drop_all()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a ~40 s run, for CI")
    parser.add_argument(
        "--duration", type=float, help="seconds per measurement [4; quick 2; vllm 12]"
    )
    parser.add_argument("--runs", type=int, help="runs per measurement [2; quick 1]")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", help="worker counts [1 64 256; quick 1 64]"
    )
    parser.add_argument(
        "--sessions-soak", type=int, help="sessions of the soak, 0: none [1000; quick 200]"
    )
    parser.add_argument(
        "--context-tokens", type=int, default=0,
        help="earlier turns each request carries (about 4 bytes a token) [0: a two-message chat]",
    )  # fmt: skip
    parser.add_argument(
        "--vllm", action="store_true",
        help="against a real vLLM (CPU) on the generated tiny model, at modest concurrency "
        "[levels 1 4 16], reporting throughput against direct",
    )  # fmt: skip
    parser.add_argument(
        "--apis", action="store_true",
        help="also measure Anthropic Messages and OpenAI Responses through trajstore",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", type=Path, metavar="DIR",
        help="also serve the proxy of another checkout (a worktree of main, say) in the same run",
    )  # fmt: skip
    parser.add_argument(
        "--tracing", action="store_true",
        help="also proxies with OpenTelemetry tracing on: to a live OTLP receiver, and to a "
        "collector that is down",
    )  # fmt: skip
    parser.add_argument(
        "--floors", action="store_true",
        help="also the pass-through as a bare ASGI app on the proxy's server (floor-asgi)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.context_tokens:
        MESSAGES[1:1] = history(args.context_tokens)
    soak_sessions = args.sessions_soak
    if soak_sessions is None:
        soak_sessions = 200 if args.quick else 1000
    default_levels = [1, 4, 16] if args.vllm else [1, 64] if args.quick else [1, 64, 256]
    plan = Plan(
        levels=args.concurrency or default_levels,
        # A real engine on the CPU answers a few requests a second: 4 s would be a handful.
        seconds=args.duration or (2.0 if args.quick else 12.0 if args.vllm else 4.0),
        runs=args.runs or (1 if args.quick else 2),
        soak=0 if args.vllm else soak_sessions,
        vllm=args.vllm,
        apis=args.apis,
        baseline=args.baseline,
        floors=args.floors,
        tracing=args.tracing,
    )
    if 1 not in plan.levels:
        parser.error("the concurrency levels must include 1 (the added-latency figure)")
    sys.exit(uvloop.run(main(plan)))
