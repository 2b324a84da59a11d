"""A cluster's traffic at small scale: N proxy replicas, one PostgreSQL, K live agent sessions.

    python benchmarks/scale.py [--quick] [--replicas 1 2 4] [--sessions 1000 4000]
                               [--rate 300] [--duration 20] [--turns 4]

Starts the instant fake engine (tests/proxy/fake_engine.py) and, per configuration, N
`trajstore proxy` replicas recording into one fresh database. A load generator holds K sessions,
spread over the replicas as a load balancer with session affinity would spread them. Each session
is an agent: it takes a turn after an exponential think time (so that all of them together offer
`--rate` turns a second), carries its whole history back each turn (its answers and a tool's
output, about 250 tokens a turn), streams every other turn, and after `--turns` turns is finished
and replaced by a new one. Every turn asks for 64 tokens.

Per configuration it prints what was offered and what was served: turns/s, tokens/s stored,
events/s, the finish's p50/p99 (a finish waits until the session's events are durable on every
replica), the writer's lag (the oldest event not yet durable, the worst any replica reported,
sampled twice a second), and the costs: CPU seconds of each kind of process per million tokens
(the proxies, the database's backends for this database, the engine, this load generator), WAL
bytes and `events` bytes per token, and how busy the machine's cores were, all over the steady
phase; then every live session is finished at once, and that phase's CPU (all processes) per
session is `fin CPU`. Served turns/s
fall short of the offered rate by the think times of new sessions even when nothing is
saturated; a machine near 100% busy is, and the CPU columns say which process took it. Then it
reconciles: every token a client received is in the store (exit 1 if not).

2 cores run everything here, so the figures say what each part costs, not what a cluster does:
docs/performance.md projects them onto cores, and marks the projection as such.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
import orjson
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from overhead_load import RequestFailed, chat_chunks
from proxy_overhead import ENGINE_MAIN, DbBackends, Server, Servers, cpu_seconds, percentile

from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import database_url

ROOT = Path(__file__).resolve().parent.parent
RUN_ID = "scale"
MAX_TOKENS = 64
SYSTEM = "You are a careful coding agent. Read the failing test, then answer with a patch."
TASK = "tests/test_io.py::test_parse fails with a KeyError on 'id'; find the cause and fix it."
#: A tool's output, as an agent appends it after each turn: about 200 tokens.
TOOL_OUTPUT = "    assert parse(row)[key] == expected, (key, row)  # tests/test_io.py:41\n" * 12


@dataclass
class Plan:
    """What to run."""

    replicas: list[int]
    sessions: list[int]
    rate: float  # turns a second, offered by all sessions together
    seconds: float
    turns: int  # per session, then it is finished and replaced
    reap_interval: float = 10.0  # the replicas' reaper (TRAJSTORE_REAP_INTERVAL), its default


@dataclass
class Tally:
    """What the agents of one configuration saw."""

    turns: int = 0
    received_tokens: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    finish_latencies: list[float] = field(default_factory=list)
    turn_latencies: list[float] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


@dataclass
class Session:
    """A live session: where its agent sends turns, and as whom."""

    url: str
    agent: dict[str, str]
    orchestrator: dict[str, str]
    finish_url: str


async def create_session(http: aiohttp.ClientSession, replica: str, session_id: str) -> Session:
    body = {"run_id": RUN_ID, "session_id": session_id, "task_id": "scale"}
    async with http.post(replica + "/sessions", json=body) as resp:
        if resp.status != 201:
            raise RuntimeError(f"POST /sessions: {resp.status} {await resp.text()}")
        created = await resp.json()
    return Session(
        url=created["base_url"] + "/chat/completions",
        agent={"Authorization": f"Bearer {created['api_key']}"},
        orchestrator={"Authorization": f"Bearer {created['orchestrator_key']}"},
        finish_url=f"{replica}/sessions/{session_id}/finish",
    )


async def take_turn(
    http: aiohttp.ClientSession, session: Session, messages: list[dict[str, str]], stream: bool
) -> tuple[str, int]:
    """One model call; returns the answer's text and its completion tokens."""
    body = {"model": "tiny", "messages": messages, "max_tokens": MAX_TOKENS, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with http.post(session.url, data=orjson.dumps(body), headers=session.agent) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:100]}")
        if not stream:
            answer = orjson.loads(await resp.read())
            return answer["choices"][0]["message"]["content"] or "", answer["usage"][
                "completion_tokens"
            ]
        pieces: list[str] = []
        tokens = 0
        async for chunk in chat_chunks(resp):
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", ()):
                pieces.append((choice.get("delta") or {}).get("content") or "")
        return "".join(pieces), tokens


async def agent(
    http: aiohttp.ClientSession,
    replica: str,
    name: str,
    plan: Plan,
    mean_think: float,
    stop: asyncio.Event,
    tally: Tally,
    rng: random.Random,
) -> None:
    """Sessions one after another on `replica`: turns after think times, then a finish."""
    episode = 0
    while not stop.is_set():
        session_id = f"{name}-{episode}"
        episode += 1
        try:
            session = await create_session(http, replica, session_id)
        except (RuntimeError, aiohttp.ClientError) as exc:
            tally.error(f"create: {exc}"[:100])
            return
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
        for turn in range(plan.turns):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), rng.expovariate(1 / mean_think))
            if stop.is_set():
                break
            started = time.perf_counter()
            try:
                text, tokens = await take_turn(http, session, messages, stream=turn % 2 == 1)
            except (RuntimeError, RequestFailed, aiohttp.ClientError) as exc:
                tally.error(f"turn: {exc}"[:100])
                continue
            tally.turn_latencies.append(time.perf_counter() - started)
            tally.turns += 1
            tally.received_tokens += tokens
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": TOOL_OUTPUT})
        started = time.perf_counter()
        body = {"status": "completed"}
        async with http.post(session.finish_url, json=body, headers=session.orchestrator) as resp:
            if resp.status != 200:
                tally.error(f"finish: HTTP {resp.status}")
            elif not stop.is_set():  # finishes after the stop all wait together: not counted
                tally.finish_latencies.append(time.perf_counter() - started)


async def worst_writer_lag(
    http: aiohttp.ClientSession, replicas: list[Server], stop: asyncio.Event
) -> float:
    """The largest `trajstore_writer_lag_seconds` any replica reports, sampled every 0.5 s."""
    worst = 0.0
    while not stop.is_set():
        for replica in replicas:
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(replica.url + "/metrics") as resp:
                    for line in (await resp.text()).splitlines():
                        if line.startswith("trajstore_writer_lag_seconds "):
                            worst = max(worst, float(line.split()[1]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 0.5)
    return worst


@dataclass
class Row:
    """One configuration's figures."""

    replicas: int
    sessions: int
    offered: float
    turns_s: float
    tokens_s: float
    events_s: float
    turn_p50_ms: float
    finish_p50_ms: float
    finish_p99_ms: float
    lag_s: float
    cpu_per_mtok: dict[str, float]
    busy: float  # the machine's cores in use, all processes together, 0 to 1
    finish_all_ms: float  # CPU (all processes) per session of finishing every one at the end
    wal_per_token: float
    bytes_per_token: float
    received: int
    stored: int
    errors: int


async def run_configuration(
    dbs: Databases, servers: Servers, engine: Server, n_replicas: int, n_sessions: int, plan: Plan
) -> Row:
    """Start the replicas on a fresh database, drive the load, measure, stop the replicas."""
    scratch = await dbs.fresh()
    env = {
        **os.environ,
        "TRAJSTORE_DATABASE_URL": scratch,
        "TRAJSTORE_REAP_INTERVAL": str(plan.reap_interval),
    }
    argv = [sys.executable, "-m", "trajstore", "proxy", "--engine", engine.url, "--port", "{port}"]
    replicas = [servers.start(f"replica-{n_replicas}-{i}", argv, env) for i in range(n_replicas)]
    limits = aiohttp.TCPConnector(limit=512)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=limits, timeout=timeout) as http:
        for replica in replicas:
            await servers.wait_ready(replica, http, "/health")
        conn = await asyncpg.connect(asyncpg_dsn(scratch))
        backends = DbBackends(conn, scratch.partition("?")[0].rpartition("/")[2])
        try:
            stop = asyncio.Event()
            tally = Tally()
            rng = random.Random(n_replicas * 100_003 + n_sessions)
            mean_think = n_sessions / plan.rate
            lsn_before = await conn.fetchval("SELECT pg_current_wal_lsn()")
            events_before = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
            pids = {
                "proxies": [r.process.pid for r in replicas],
                "postgres": await backends.pids(),
                "engine": [engine.process.pid],
                "load": [os.getpid()],
            }
            cpu_before = {kind: cpu_seconds(p) for kind, p in pids.items()}
            started = time.perf_counter()
            lag = asyncio.create_task(worst_writer_lag(http, replicas, stop))
            agents = [
                asyncio.create_task(
                    agent(
                        http,
                        replicas[i % n_replicas].url,
                        f"s{n_replicas}-{i}",
                        plan,
                        mean_think,
                        stop,
                        tally,
                        rng,
                    )
                )
                for i in range(n_sessions)
            ]
            await asyncio.sleep(plan.seconds)
            # The steady phase ends here: its figures, before the sessions are all finished.
            stop.set()
            pids["postgres"] = sorted(  # backends the replicas opened meanwhile count too
                set(pids["postgres"]) | set(await backends.pids())
            )
            cpu = {kind: cpu_seconds(p) - cpu_before.get(kind, 0.0) for kind, p in pids.items()}
            elapsed = time.perf_counter() - started
            turns, received_then = tally.turns, tally.received_tokens
            events = await conn.fetchval("SELECT coalesce(max(position), 0) FROM events")
            wal = await conn.fetchval(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)", lsn_before
            )
            # The last phase: every live session finished at once (each finish waits for every
            # replica to flush the session: `proxy.replicas`), measured apart.
            cpu_at_stop = sum(cpu_seconds(p) for p in pids.values())
            await asyncio.gather(*agents)  # each finishes its session: durable on return
            pids["postgres"] = sorted(set(pids["postgres"]) | set(await backends.pids()))
            cpu_end = sum(cpu_seconds(p) for p in pids.values()) - cpu_at_stop
            worst_lag = await lag
            stored = await conn.fetchval(
                "SELECT coalesce(sum(length(token_ids) / 4), 0)::bigint FROM events "
                "WHERE event_type = 'completion_chunk'"
            )
            # The table and, when it is partitioned, every partition of it.
            size = await conn.fetchval(
                "SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('events')"
            )
        finally:
            await conn.close()
    for replica in replicas:
        replica.process.terminate()
    for replica in replicas:
        replica.process.wait(timeout=30)
    mtok = max(received_then, 1) / 1e6
    return Row(
        replicas=n_replicas,
        sessions=n_sessions,
        offered=plan.rate,
        turns_s=turns / elapsed,
        tokens_s=received_then / elapsed,
        events_s=(events - events_before) / elapsed,
        turn_p50_ms=1000 * statistics.median(tally.turn_latencies or [0.0]),
        finish_p50_ms=1000 * statistics.median(tally.finish_latencies or [0.0]),
        finish_p99_ms=1000 * percentile(tally.finish_latencies or [0.0], 0.99),
        lag_s=worst_lag,
        cpu_per_mtok={kind: seconds / mtok for kind, seconds in cpu.items()},
        busy=sum(cpu.values()) / elapsed / (os.cpu_count() or 1),
        finish_all_ms=1000 * cpu_end / n_sessions,
        wal_per_token=float(wal) / max(received_then, 1),
        bytes_per_token=size / max(stored, 1),
        received=tally.received_tokens,
        stored=stored,
        errors=sum(tally.errors.values()),
    )


def print_rows(rows: list[Row], seconds: float) -> None:
    print(f"\n{seconds:g} s a configuration; max_tokens {MAX_TOKENS}; CPU s per 1 M tokens stored")
    head = (
        f"{'replicas':>8} {'sessions':>8} {'offered':>7} {'turns/s':>7} {'tokens/s':>8} "
        f"{'events/s':>8} {'turn p50':>8} {'fin p50':>7} {'fin p99':>7} {'lag s':>5} "
        f"{'proxies':>7} {'postgres':>8} {'engine':>6} {'load':>6} {'busy':>4} {'fin CPU':>7} "
        f"{'WAL B/t':>7} {'disk B/t':>8}"
    )
    print(head)
    for r in rows:
        c = r.cpu_per_mtok
        print(
            f"{r.replicas:>8} {r.sessions:>8} {r.offered:>7.0f} {r.turns_s:>7.1f} "
            f"{r.tokens_s:>8.0f} {r.events_s:>8.0f} {r.turn_p50_ms:>6.1f}ms "
            f"{r.finish_p50_ms:>5.0f}ms {r.finish_p99_ms:>5.0f}ms {r.lag_s:>5.2f} "
            f"{c['proxies']:>7.0f} {c['postgres']:>8.0f} {c['engine']:>6.0f} {c['load']:>6.0f} "
            f"{r.busy:>4.0%} {r.finish_all_ms:>5.1f}ms {r.wal_per_token:>7.1f} "
            f"{r.bytes_per_token:>8.1f}"
        )


def print_verdicts(rows: list[Row]) -> bool:
    ok = True
    for r in rows:
        verdict = "ok" if r.stored == r.received else "MISMATCH"
        ok = ok and r.stored == r.received and r.errors == 0
        busiest = max(r.cpu_per_mtok, key=lambda kind: r.cpu_per_mtok[kind])
        share = r.cpu_per_mtok[busiest] / sum(r.cpu_per_mtok.values())
        state = f"the machine {r.busy:.0%} busy"
        if r.busy > 0.85:
            state += f": saturated, the {busiest} use {share:.0%} of the CPU"
        print(
            f"{r.replicas} replicas, {r.sessions} sessions: received {r.received} tokens, stored "
            f"{r.stored}: {verdict}; {r.errors} errors; {state}"
        )
    return ok


async def main(plan: Plan) -> int:
    url = await asyncio.to_thread(database_url)
    dbs = Databases(url)
    servers = Servers()
    try:
        await dbs.setup()
        engine = servers.start("engine", [sys.executable, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
        async with aiohttp.ClientSession() as http:
            await servers.wait_ready(engine, http, "/health")
        rows = []
        for n_sessions in plan.sessions:
            for n_replicas in plan.replicas:
                row = await run_configuration(dbs, servers, engine, n_replicas, n_sessions, plan)
                rows.append(row)
                print_rows([row], plan.seconds)
        print_rows(rows, plan.seconds)
        print()
        return 0 if print_verdicts(rows) else 1
    finally:
        servers.stop()
        await dbs.drop_all()


def parse_args() -> Plan:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="1 and 2 replicas, 200 sessions, 6 s")
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--rate", type=float, default=300.0, help="turns/s offered in all")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds a configuration")
    parser.add_argument("--turns", type=int, default=4, help="turns a session, then a finish")
    parser.add_argument(
        "--reap-interval", type=float, default=10.0, help="the replicas' TRAJSTORE_REAP_INTERVAL"
    )
    args = parser.parse_args()
    if args.quick:
        return Plan([1, 2], [200], min(args.rate, 100.0), 6.0, args.turns, args.reap_interval)
    return Plan(
        args.replicas, args.sessions, args.rate, args.duration, args.turns, args.reap_interval
    )


if __name__ == "__main__":
    sys.exit(uvloop.run(main(parse_args())))
