"""What the recording proxy costs, against going direct and a bare pass-through, in the same run.

    python benchmarks/proxy_overhead.py [--quick] [--duration 4] [--runs 2] [--sessions-soak 1000]
                                        [--context-tokens 0] [--vllm] [--apis]

Starts four processes: the instant fake engine (tests/proxy/fake_engine.py, cached answers), the
floor (benchmarks/passthrough.py: aiohttp relay, no recording) and `trajstore proxy` recording
into a scratch database; "direct" is load straight to the engine. This process drives closed-loop
load (C workers, each sending chat completions of max_tokens 64 back to back for a fixed time),
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

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one; it needs the right to
create databases. Prints medians over the runs, then the ratios the proxy is held to. Exits
non-zero when a token is lost or the soak sees an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import orjson
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script

from trajstore.proxy.wire import engine_body
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import database_url

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
RUN_ID = "proxy-overhead"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Requests each worker sends before a measurement: connections open, caches warm.
WARMUP_PER_WORKER = 2
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent. Answer with a patch."},
    {"role": "user", "content": "The test in tests/test_io.py fails with a KeyError; fix it."},
]


def history(tokens: int) -> list[dict[str, str]]:
    """An agent's earlier turns, about `tokens` tokens of them (four characters a token): tool
    calls and their results, as a request deep into an episode carries them."""
    turns: list[dict[str, str]] = []
    line = "    assert parse(row)[key] == expected, (key, row)  # tests/test_io.py\n"
    while sum(len(m["content"]) for m in turns) < 4 * tokens:
        turns.append({"role": "assistant", "content": "Let me look at the failing test first."})
        turns.append({"role": "tool", "content": line * 60})  # ~1,000 tokens of output
    return turns


#: The engine in its own process. FakeEngine keeps every request it saw, for tests; a benchmark
#: would grow it by a hundred thousand dicts, so it keeps only the last one here.
ENGINE_MAIN = """
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(instant=True), int(sys.argv[2])))
"""


def request_body(stream: bool, *, usage: bool = False, api: str = "chat") -> bytes:
    """A request as an agent sends it: no token ids or logprobs asked for.

    With `usage`, a chat stream asks for the usage chunk: a real model's tokens do not each
    carry text (a split UTF-8 character, the end-of-turn token), so counting text chunks
    undercounts. The same conversation as Anthropic Messages or OpenAI Responses (`api`): the
    system prompt as `system` / `instructions`, tool output as user turns.
    """
    system, rest = MESSAGES[0]["content"], MESSAGES[1:]
    turns = [{"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]}
             for m in rest]  # fmt: skip
    body: dict[str, object]
    if api == "messages":
        body = {"model": "tiny", "system": system, "messages": turns, "max_tokens": MAX_TOKENS}
    elif api == "responses":
        body = {"model": "tiny", "instructions": system, "input": turns}
        body["max_output_tokens"] = MAX_TOKENS
    else:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        if stream and usage:
            body["stream_options"] = {"include_usage": True}
    body["stream"] = stream
    return orjson.dumps(body)


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the processes and their waited-for children, from /proc/<pid>/stat."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue  # a backend that ended since we listed it
        fields = stat.rpartition(")")[2].split()  # the name may hold spaces; fields from 3 on
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / CLOCK_TICKS


@dataclass
class Server:
    """A process the benchmark started, and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Servers:
    """Starts the servers; `stop()` ends every one of them, whatever happened."""

    def __init__(self) -> None:
        self.started: list[Server] = []
        self.logs = tempfile.TemporaryDirectory(prefix="proxy-overhead-")

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Server:
        port = free_port()
        argv = [a.replace("{port}", str(port)) for a in argv]
        log = Path(self.logs.name) / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        server = Server(name, process, f"http://127.0.0.1:{port}", log)
        self.started.append(server)
        return server

    async def wait_ready(self, server: Server, http: aiohttp.ClientSession, path: str) -> None:
        """Until `path` answers 200; fail with the server's log if it exits or takes 60 s."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                break
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(server.url + path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{server.name} did not come up; its log:\n{server.log_tail()}")

    def stop(self) -> None:
        for server in reversed(self.started):  # the proxies before the engine they drain into
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in self.started:
            try:
                server.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
        self.logs.cleanup()


# -- load ---------------------------------------------------------------------------------------


@dataclass
class Route:
    """Where one worker sends its requests, and as whom."""

    url: str
    headers: dict[str, str]
    orchestrator: dict[str, str] = field(default_factory=dict)  # to finish the session


@dataclass
class Target:
    """One way to reach the engine: direct, through the floor, or through trajstore."""

    name: str
    routes: list[Route]  # worker i uses routes[i % len(routes)]
    pids: list[int]  # the server processes whose CPU time is charged to it
    server: Server | None = None
    received_tokens: int = 0  # completion tokens its clients were given, all measurements
    asks_like_trajstore: bool = False  # send the engine what trajstore sends it (ids, logprobs)
    api: str = "chat"  # the agent API its requests speak (chat | messages | responses)

    def route(self, worker: int) -> Route:
        return self.routes[worker % len(self.routes)]


class RequestFailed(Exception):
    """A request that did not end in a complete answer."""


@dataclass
class Tally:
    """What the workers of one measurement saw."""

    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)


def stream_event(api: str, data: dict[str, object]) -> tuple[int | None, bool, bool]:
    """One event of a Messages or Responses stream: (exact output tokens if it says them,
    whether it carried text, whether it ends the stream)."""
    kind = data.get("type")
    if kind == "error" or kind == "response.failed":
        raise RequestFailed("error in stream")
    if api == "messages":
        usage = data.get("usage") if kind == "message_delta" else None
        text = kind == "content_block_delta"
        return (usage["output_tokens"] if usage else None), text, kind == "message_stop"  # type: ignore[index]
    final = kind in ("response.completed", "response.incomplete")
    tokens = data["response"]["usage"]["output_tokens"] if final else None  # type: ignore[index]
    return tokens, kind == "response.output_text.delta", final


async def one_request(
    http: aiohttp.ClientSession,
    route: Route,
    stream: bool,
    body: bytes,
    tally: Tally,
    api: str = "chat",
) -> None:
    """Send one request, read the whole answer, and tally latency, TTFT and tokens."""
    started = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    try:
        headers = {"Content-Type": "application/json", **route.headers}
        async with http.post(route.url, data=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                raise RequestFailed(f"HTTP {resp.status}")
            if not stream:
                usage = orjson.loads(await resp.read())["usage"]
                tokens = usage["completion_tokens" if api == "chat" else "output_tokens"]
            elif api != "chat":
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    exact, text, done = stream_event(api, orjson.loads(line[5:]))
                    if text and ttft is None:
                        ttft = time.perf_counter() - started
                    if exact is not None:
                        tokens = exact
                if not done:
                    raise RequestFailed("stream ended before its last event")
            else:
                done = False
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        continue
                    chunk = orjson.loads(data)
                    if "error" in chunk:
                        raise RequestFailed("error in stream")
                    if chunk.get("usage"):  # asked for with a real engine: exact counts
                        tokens = chunk["usage"]["completion_tokens"]
                    elif any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - started
                if not done:
                    raise RequestFailed("stream ended before [DONE]")
    except (RequestFailed, aiohttp.ClientError, TimeoutError) as exc:
        tally.errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
        return
    tally.latencies.append(time.perf_counter() - started)
    if ttft is not None:
        tally.ttfts.append(ttft)
    tally.tokens += tokens


@dataclass
class Sample:
    """One measurement of one target at one mode and concurrency."""

    requests: int
    errors: int
    seconds: float
    latencies: list[float]
    ttfts: list[float]
    cpu: dict[str, float]  # CPU seconds spent during the measurement, by process group


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def new_client() -> aiohttp.ClientSession:
    """A client with as many connections as there are workers."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=120)
    )


class Load:
    """Closed-loop load from this process, with the CPU time of everyone involved."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        engine_pid: int,
        db: DbBackends | None,
        *,
        usage: bool = False,
    ):
        self.http = http
        self.engine_pid = engine_pid
        self.db = db
        self.usage = usage

    async def measure(
        self, target: Target, stream: bool, concurrency: int, seconds: float
    ) -> Sample:
        # A client of its own: a connection left idle by the previous measurement may be closed
        # by the server (uvicorn's keep-alive is 5 s) just as it is reused, failing the request.
        async with new_client() as http:
            return await self._measure(http, target, stream, concurrency, seconds)

    async def _measure(
        self,
        http: aiohttp.ClientSession,
        target: Target,
        stream: bool,
        concurrency: int,
        seconds: float,
    ) -> Sample:
        body = request_body(stream, usage=self.usage, api=target.api)
        if target.asks_like_trajstore:
            body = orjson.dumps(engine_body("chat", orjson.loads(body)))
        warm = Tally()
        await asyncio.gather(
            *(
                one_request(http, target.route(w), stream, body, warm, target.api)
                for w in range(concurrency)
                for _ in range(WARMUP_PER_WORKER)
            )
        )
        await self._drain(target)
        tally = Tally()
        before = await self._cpu(target)
        started = time.perf_counter()
        deadline = started + seconds

        async def worker(w: int) -> None:
            route = target.route(w)
            while time.perf_counter() < deadline:
                await one_request(http, route, stream, body, tally, target.api)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - started
        await self._drain(target)  # the recording the requests caused is part of their cost
        after = await self._cpu(target)
        target.received_tokens += warm.tokens + tally.tokens
        errors = tally.errors + warm.errors
        for kind, count in errors.items():
            print(f"  {target.name} {concurrency=} stream={stream}: {count} x {kind}")
        return Sample(
            requests=len(tally.latencies),
            errors=sum(errors.values()),
            seconds=elapsed,
            latencies=tally.latencies,
            ttfts=tally.ttfts,
            cpu={k: after[k] - before[k] for k in before},
        )

    async def _cpu(self, target: Target) -> dict[str, float]:
        times = os.times()
        cpu = {
            "target": cpu_seconds(target.pids),
            "engine": cpu_seconds([self.engine_pid]),
            "client": times.user + times.system,
        }
        if target.name.startswith("trajstore") and self.db is not None:
            cpu["db"] = cpu_seconds(await self.db.pids())
        return cpu

    async def _drain(self, target: Target) -> None:
        """Wait until trajstore's writer has stored everything it was given."""
        if not target.name.startswith("trajstore") or target.server is None:
            return
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            async with self.http.get(target.server.url + "/health") as resp:
                if (await resp.json())["writer_pending"] == 0:
                    return
            await asyncio.sleep(0.02)
        raise RuntimeError("trajstore's writer did not drain within 60 s")


class DbBackends:
    """The PostgreSQL backends serving one database (the proxy's pool), for their CPU time."""

    def __init__(self, conn: asyncpg.Connection, database: str) -> None:
        self.conn = conn
        self.database = database

    async def pids(self) -> list[int]:
        rows = await self.conn.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            self.database,
        )
        return [row["pid"] for row in rows]

    async def stored_tokens(self) -> int:
        tokens: int = await self.conn.fetchval(
            "SELECT coalesce(sum(length(token_ids) / 4), 0)::bigint FROM events "
            "WHERE event_type = 'completion_chunk'"
        )
        return tokens


# -- trajstore sessions -------------------------------------------------------------------------


API_PATHS = {"chat": "/chat/completions", "messages": "/messages", "responses": "/responses"}


async def create_sessions(
    http: aiohttp.ClientSession, proxy_url: str, ids: list[str], api: str = "chat"
) -> list[Route]:
    """Create the sessions (32 at a time); the route of each is its own base URL and key."""
    limit = asyncio.Semaphore(32)

    async def create(session_id: str) -> Route:
        async with limit:
            body = {"run_id": RUN_ID, "session_id": session_id}
            async with http.post(proxy_url + "/sessions", json=body) as resp:
                if resp.status != 201:
                    raise RuntimeError(f"POST /sessions: {resp.status} {await resp.text()}")
                created = await resp.json()
        headers = {"Authorization": f"Bearer {created['api_key']}"}
        orchestrator = {"Authorization": f"Bearer {created['orchestrator_key']}"}
        return Route(created["base_url"] + API_PATHS[api], headers, orchestrator)

    return list(await asyncio.gather(*(create(i) for i in ids)))


async def finish_sessions(http: aiohttp.ClientSession, routes: list[Route]) -> None:
    """Finish every session (32 at a time): each makes its events durable first."""
    limit = asyncio.Semaphore(32)

    async def finish(route: Route) -> None:
        url = route.url.rpartition("/v1/")[0] + "/finish"
        async with (
            limit,
            http.post(url, json={"status": "completed"}, headers=route.orchestrator) as r,
        ):
            if r.status != 200:
                raise RuntimeError(f"finish: {r.status} {await r.text()}")

    await asyncio.gather(*(finish(route) for route in routes))


async def reconcile(targets: list[Target], db: DbBackends, what: str) -> bool:
    """Every token trajstore's clients received (over all its targets) is in the store."""
    stored = await db.stored_tokens()
    received = sum(t.received_tokens for t in targets if t.name.startswith("trajstore"))
    verdict = "ok" if stored == received else "MISMATCH"
    print(f"reconciliation ({what}): received {received} tokens, stored {stored} tokens: {verdict}")
    return stored == received


# -- report -------------------------------------------------------------------------------------


@dataclass
class Row:
    """Medians over the runs of one (target, mode, concurrency)."""

    rps: float
    p50: float
    p99: float
    ttft: float
    cpu: dict[str, float]  # ms per request
    errors: int


def summarise(samples: list[Sample]) -> Row:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    def per_request(key: str) -> float:
        return med([1000 * s.cpu[key] / max(s.requests, 1) for s in samples])

    return Row(
        rps=med([s.requests / s.seconds for s in samples]),
        p50=med([1000 * percentile(s.latencies, 0.5) for s in samples]),
        p99=med([1000 * percentile(s.latencies, 0.99) for s in samples]),
        ttft=med([1000 * percentile(s.ttfts, 0.5) for s in samples]),
        cpu={key: per_request(key) for key in samples[0].cpu},
        errors=sum(s.errors for s in samples),
    )


def fmt(value: float | None, spec: str = "8.2f") -> str:
    width = int(spec.split(".")[0])
    if value is None or value != value:  # None or NaN
        return "n/a".rjust(width)
    return format(value, spec)


def print_table(rows: dict[tuple[str, str, int], Row]) -> None:
    print(
        f"{'target':<19} {'mode':<10} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'+p50 ms':>8} {'ttft ms':>8} {'cpu/req':>8} {'db/req':>8} {'eng/req':>8} "
        f"{'cli/req':>8} {'errors':>6}"
    )
    for (name, mode, conc), row in rows.items():
        direct = rows[("direct", mode, conc)]
        print(
            f"{name:<19} {mode:<10} {conc:>4} {row.rps:8.0f} {row.p50:8.2f} {row.p99:8.2f} "
            f"{fmt(None if name == 'direct' else row.p50 - direct.p50)} "
            f"{fmt(row.ttft if mode == 'stream' else None)} "
            f"{fmt(None if name.startswith('direct') else row.cpu['target'], '8.3f')} "
            f"{fmt(row.cpu.get('db'), '8.3f')} {row.cpu['engine']:8.3f} "
            f"{row.cpu['client']:8.3f} {row.errors:6d}"
        )
    print(
        "(+p50: p50 minus direct's; cpu/req: the target server's CPU ms per request; db/req: "
        "trajstore's PostgreSQL backends'; eng/req: the engine's; cli/req: the load generator's)"
    )


def print_ratios(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\ntrajstore CPU/request ÷ floor CPU/request (target ≤ 2×; with its db backends):")
    for mode in ("non-stream", "stream"):
        parts = []
        for conc in levels:
            ours, floor = rows[("trajstore", mode, conc)].cpu, rows[("floor", mode, conc)].cpu
            ratio = ours["target"] / floor["target"]
            with_db = (ours["target"] + ours.get("db", 0.0)) / floor["target"]
            parts.append(f"c={conc} {ratio:.2f}× ({with_db:.2f}×)")
        print(f"  {mode:<10} " + "   ".join(parts))
    print("trajstore added p50 vs direct at concurrency 1 (target ≤ 1 ms):")
    for mode in ("non-stream", "stream"):
        direct, floor = rows[("direct", mode, 1)], rows[("floor", mode, 1)]
        ours = rows[("trajstore", mode, 1)]
        print(
            f"  {mode:<10} {ours.p50 - direct.p50:.3f} ms "
            f"(floor {floor.p50 - direct.p50:.3f} ms; trajstore over floor "
            f"{ours.p50 - floor.p50:.3f} ms)"
        )
    top = max(levels)
    print(f"trajstore p99 ÷ floor p99 at concurrency {top} (target ≤ 1.5×):")
    for mode in ("non-stream", "stream"):
        ours, floor = rows[("trajstore", mode, top)], rows[("floor", mode, top)]
        print(f"  {mode:<10} {ours.p99 / floor.p99:.2f}× ({ours.p99:.1f} / {floor.p99:.1f} ms)")


def print_apis(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\neach agent API's CPU/request through trajstore ÷ chat's (target ≤ 1.2×):")
    for api in ("messages", "responses"):
        for mode in ("non-stream", "stream"):
            parts = []
            for conc in levels:
                chat = rows[("trajstore", mode, conc)].cpu["target"]
                ours = rows[(f"trajstore-{api}", mode, conc)].cpu["target"]
                parts.append(f"c={conc} {ours / chat:.2f}× ({ours:.3f} / {chat:.3f} ms)")
            print(f"  {api:<9} {mode:<10} " + "   ".join(parts))


def print_throughput(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\nagainst the real engine, trajstore req/s ÷ direct req/s (target ≥ 0.95×):")
    for mode in ("non-stream", "stream"):
        parts = []
        for conc in levels:
            ours, direct = rows[("trajstore", mode, conc)], rows[("direct", mode, conc)]
            parts.append(f"c={conc} {ours.rps / direct.rps:.2f}×")
        print(f"  {mode:<10} " + "   ".join(parts))
    print(
        "the engine asked directly for what trajstore asks it (token ids, logprobs) ÷ direct, "
        "and trajstore ÷ that (the proxy's own share):"
    )
    for mode in ("non-stream", "stream"):
        parts = []
        for conc in levels:
            direct = rows[("direct", mode, conc)]
            asked = rows[("direct+ids", mode, conc)]
            ours = rows[("trajstore", mode, conc)]
            parts.append(f"c={conc} {asked.rps / direct.rps:.2f}× / {ours.rps / asked.rps:.2f}×")
        print(f"  {mode:<10} " + "   ".join(parts))


def start_vllm(servers: Servers) -> Server:
    """A real vLLM (CPU build) on the generated tiny model, owned by `servers`."""
    from trajstore.tiny_model import build_tiny_model
    from trajstore.vllm_server import VllmServer

    model = build_tiny_model(Path(servers.logs.name) / "model")
    log = Path(servers.logs.name) / "engine.log"
    vllm = VllmServer(model, free_port(), log_file=log)
    vllm.start()
    assert vllm.process is not None
    server = Server("engine", vllm.process, vllm.url, log)
    servers.started.append(server)
    return server


async def answer_sizes(http: aiohttp.ClientSession, engine_url: str) -> str:
    """The engine's answer bytes as an agent asks, and as trajstore asks (ids and logprobs)."""
    sizes = []
    for stream in (False, True):
        plain = orjson.loads(request_body(stream))
        for body in (plain, engine_body("chat", plain)):
            async with http.post(engine_url + "/v1/chat/completions", json=body) as resp:
                sizes.append(len(await resp.read()))
    return (
        f"request body bytes {len(request_body(False))}; "
        f"engine answer bytes, as the agent asks / as trajstore asks: non-stream "
        f"{sizes[0]} / {sizes[1]}, stream {sizes[2]} / {sizes[3]}"
    )


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


async def main(plan: Plan) -> int:
    url = await asyncio.to_thread(database_url)
    dbs = Databases(url)
    servers = Servers()
    http = new_client()  # for everything but the load itself
    conn: asyncpg.Connection | None = None
    try:
        await dbs.setup()
        scratch = await dbs.fresh()
        python = sys.executable
        if plan.vllm:
            engine = await asyncio.to_thread(start_vllm, servers)
        else:
            engine = servers.start("engine", [python, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
        await servers.wait_ready(engine, http, "/health")
        floor = servers.start(
            "floor",
            [python, "benchmarks/passthrough.py", "--engine", engine.url, "--port", "{port}"],
        )
        env = {**os.environ, "TRAJSTORE_DATABASE_URL": scratch}
        ours = servers.start(
            "trajstore",
            [python, "-m", "trajstore", "proxy", "--engine", engine.url, "--port", "{port}"],
            env=env,
        )
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
        print()
        await finish_sessions(http, routes)
        ok = await reconcile(targets, db, "load runs")
        if plan.soak:
            ok = await soak(http, targets, db, plan.soak) and ok
        return 0 if ok else 1
    finally:
        await http.close()
        if conn is not None:
            await conn.close()
        servers.stop()
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
    )
    if 1 not in plan.levels:
        parser.error("the concurrency levels must include 1 (the added-latency figure)")
    sys.exit(uvloop.run(main(plan)))
