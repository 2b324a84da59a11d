"""Chaos: what trajstore promises when something breaks, checked by breaking it.

    python benchmarks/chaos.py [--quick] [--only NAME ...] [--seed N]

Six scenarios, run one after the other against a private PostgreSQL this suite starts (in a
temporary directory, on a free port: never the machine's server), each with processes of its
own (fake engines from tests/proxy/fake_engine.py, `trajstore proxy`, `trajstore project`):

1. pg-restart: N streaming multi-turn sessions through a proxy while PostgreSQL is stopped like a
   crash (`pg_ctl stop -m immediate`) and started again; every session is finished as it ends,
   a finish answered 503 is retried after its Retry-After. Tokens received by the agents must
   all be stored, no agent may see an error, every finish must succeed.
2. replica-kill: two proxy replicas sharing TRAJSTORE_SESSION_SECRET; sessions stream through B,
   which is SIGKILLed mid-stream. A's reaper must record each open turn of an active session as
   failed (`replica_lost`, with the tokens that reached the log); A serves the retried turns and
   finishes the sessions. Half the sessions are finished at once, before the reaper could look;
   one more session, left idle by its orchestrator, must be finished as `timeout`.
3. engine-kill: a proxy in front of two engine processes; one is SIGKILLed mid-stream. The cut
   streams must be recorded as failed with their tokens, and the sessions' next requests must be
   served by the other engine (agents retry a 502/503 the way the OpenAI client does).
4. projector-kill: M finished sessions; the live `trajstore project` is SIGKILLed part-way, more
   than once, then let catch up. Its samples must equal, sample for sample, those of a one-shot
   `trajstore project --once` on a copy of the same log: none lost, none doubled.
5. soak: N concurrent streams, one request each on a fresh session (proxy_overhead's soak): no
   error, and the tokens the clients received are the tokens stored.
6. api-fuzz: property-based requests against the running proxy: every route of its OpenAPI
   schema (schemathesis; positive and negative cases, and cases on a real session with its
   orchestrator key), and random JSON bodies for the chat completions, Messages and Responses
   routes (hypothesis). No 5xx, no hang (a client timeout), the proxy still healthy after.

Sizes, full / --quick: pg-restart 24 / 8 sessions of 3 turns; replica-kill and engine-kill 16 / 8
sessions; projector-kill 4,000 / 1,000 sessions and 3 / 2 kills; soak 1,000 / 200 streams; the
fuzz 50 / 10 cases per operation and pass, 300 / 50 per model-call route (`--seed` varies them).
The fuzz needs schemathesis (`pip install 'schemathesis>=4.32,<5'`).

Each scenario prints its figures; a table of verdicts ends the run. The exit status is 1 when a
promise is broken (or a scenario could not run), 0 otherwise. Every process and temporary
directory is removed at the end, on failure too. `--quick` (CI-sized) takes about two minutes on
2 cores. docs/reliability.md states the promises and the figures measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import orjson
import uvloop
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from projection import Shape, record
from proxy_overhead import ENGINE_MAIN as INSTANT_ENGINE_MAIN
from proxy_overhead import DbBackends, Server, Servers, Target, free_port, new_client, soak

from trajstore.proxy.engines import EnginePool
from trajstore.store import EventStore
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import EmbeddedPostgres
from trajstore.store.projection import Projector
from trajstore.store.roles import PROJECTOR_ROLE, RECORDER_ROLE, as_role

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
#: Seconds a fuzz case may take before it counts as a hang.
CASE_TIMEOUT = 10.0

#: A fake engine in its own process (so that it can be killed), with FakeEngine's options as
#: JSON. It answers what vLLM would refuse (a million choices, 10**9 top logprobs, a body the
#: fake cannot read) with vLLM's 400 instead of working on it for minutes or failing with a 500:
#: the fuzz looks for the proxy's 5xx, not the fake's.
ENGINE_MAIN = """
import json, sys
import orjson, uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, _error, serve_forever

BOUNDS = {"n": (1, 4), "top_logprobs": (0, 20), "logprobs": (0, 20)}
SLOPPY = (ValueError, TypeError, KeyError, AttributeError, IndexError, OverflowError)


def refusal(body):
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    for key, (low, high) in BOUNDS.items():
        value = body.get(key)
        if value is None or isinstance(value, bool):
            continue
        if not isinstance(value, int) or not low <= value <= high:
            return f"{key} must be an integer in [{low}, {high}]"
    return None


class Engine(FakeEngine):
    async def _serve(self, request, api):
        try:
            problem = refusal(orjson.loads(await request.read()))
        except orjson.JSONDecodeError as exc:
            problem = f"invalid JSON: {exc}"
        if problem is not None:
            return _error(400, problem)
        try:
            return await super()._serve(request, api)
        except SLOPPY as exc:
            return _error(400, f"invalid request: {type(exc).__name__}: {exc}")

    async def _tokenize(self, request):
        try:
            return await super()._tokenize(request)
        except SLOPPY as exc:
            return _error(400, f"invalid request: {type(exc).__name__}: {exc}")


uvloop.run(serve_forever(Engine(**json.loads(sys.argv[3])), int(sys.argv[2])))
"""


def say(*parts: object) -> None:
    print(*parts, flush=True)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# -- sizes --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """How big each scenario is: the full suite, or --quick."""

    pg_sessions: int
    replica_sessions: int
    engine_sessions: int
    projector_sessions: int
    projector_kills: int
    soak_streams: int
    schema_cases: int  # per operation and generation pass
    model_cases: int  # per model-call route
    limit: float  # seconds a scenario may take before it counts as hung

    @classmethod
    def of(cls, quick: bool) -> Sizes:
        if quick:
            return cls(8, 8, 8, 1000, 2, 200, 10, 50, 120.0)
        return cls(24, 16, 16, 4000, 3, 1000, 50, 300, 420.0)


# -- the suite's PostgreSQL and processes -------------------------------------------------------


def world_readable_tempdir(prefix: str) -> Path:
    """A temporary directory the unprivileged server user can enter (as tests/conftest.py)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


class Chaos:
    """The suite's own PostgreSQL (restartable), its databases, and the run's settings."""

    def __init__(self, sizes: Sizes, seed: int) -> None:
        self.sizes = sizes
        self.seed = seed
        self.dir = world_readable_tempdir("trajstore-chaos-")
        self.pg = EmbeddedPostgres(self.dir / "pg", free_port())
        self.dbs: Databases | None = None

    async def start(self) -> None:
        url = await asyncio.to_thread(self.pg.start)
        self.dbs = Databases(url)
        await self.dbs.setup()

    async def fresh(self) -> str:
        """A new migrated database (a clone of the template), dropped at the end."""
        assert self.dbs is not None
        return await self.dbs.fresh()

    async def clone(self, url: str) -> str:
        """A copy of the database at `url` (nobody may be connected to it)."""
        assert self.dbs is not None
        source = database_name(url)
        name = f"{source}_copy"
        await self.dbs._admin(f'CREATE DATABASE "{name}" TEMPLATE "{source}"')
        self.dbs.created.append(name)
        return self.dbs.url_of(name)

    async def close(self) -> None:
        try:
            if self.dbs is not None and self.pg.running_pid() is not None:
                await self.dbs.drop_all()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self.pg.stop)
            shutil.rmtree(self.dir, ignore_errors=True)


def database_name(url: str) -> str:
    return url.partition("?")[0].rpartition("/")[2]


def trajstore_env(database_url: str, **settings: object) -> dict[str, str]:
    """The environment of a trajstore process: ours less any TRAJSTORE_* (an admin key, another
    database), plus the database and the given settings. The proxy and the projector connect as
    their roles (store.roles), through the socket of the suite's server, which trusts them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATABASE_URL"] = database_url
    env["TRAJSTORE_RECORDER_DATABASE_URL"] = as_role(database_url, RECORDER_ROLE)
    env["TRAJSTORE_PROJECTOR_DATABASE_URL"] = as_role(database_url, PROJECTOR_ROLE)
    env.update({f"TRAJSTORE_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def start_engine(servers: Servers, name: str, **options: object) -> Server:
    argv = [PYTHON, "-c", ENGINE_MAIN, str(ROOT), "{port}", json.dumps(options)]
    return servers.start(name, argv)


def start_proxy(
    servers: Servers, name: str, engines: list[Server], database_url: str, **settings: object
) -> Server:
    argv = [PYTHON, "-m", "trajstore", "proxy", "--port", "{port}"]
    for engine in engines:
        argv += ["--engine", engine.url]
    return servers.start(name, argv, env=trajstore_env(database_url, **settings))


async def wait_ready(servers: Servers, http: aiohttp.ClientSession, *started: Server) -> None:
    for server in started:
        await servers.wait_ready(server, http, "/health")


def log_count(server: Server, pattern: str) -> int:
    return len(re.findall(pattern, server.log.read_text(errors="replace")))


async def fetch(url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        rows: list[asyncpg.Record] = await conn.fetch(sql, *args)
        return rows
    finally:
        await conn.close()


STORED_TOKENS = """
SELECT session_id, coalesce(sum(length(token_ids) / 4), 0)::bigint AS tokens
FROM events WHERE event_type = 'completion_chunk' GROUP BY session_id
"""
TURNS = """
SELECT session_id, request_id, started_at, engine, status, failure, completion_tokens
FROM turns ORDER BY session_id, started_at, position
"""
FAILURES = """
SELECT session_id, stream_id, recorded_at, payload FROM events
WHERE event_type = 'request_failed' ORDER BY position
"""


async def stored_tokens(url: str) -> dict[str, int]:
    return {r["session_id"]: r["tokens"] for r in await fetch(url, STORED_TOKENS)}


async def turns_by_session(url: str) -> dict[str, list[asyncpg.Record]]:
    turns: dict[str, list[asyncpg.Record]] = {}
    for row in await fetch(url, TURNS):
        turns.setdefault(row["session_id"], []).append(row)
    return turns


# -- agents -------------------------------------------------------------------------------------


@dataclass
class Answer:
    """One model call as the agent saw it."""

    status: int | None = None
    tokens: int = 0  # content tokens received (the fake engine sends one per chunk)
    text: str = ""
    done: bool = False
    error: str | None = None
    retry_after: str | None = None
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0


@dataclass
class Agent:
    """A session, as its orchestrator and its agent hold it."""

    sid: str
    key: dict[str, str]  # the agent's Authorization header
    orchestrator: dict[str, str]
    messages: list[dict[str, str]]
    answers: list[Answer] = field(default_factory=list)

    @property
    def received(self) -> int:
        return sum(a.tokens for a in self.answers)

    def went_on(self, answer: Answer) -> None:
        """The next turn continues the conversation after a whole answer (else it retries)."""
        if answer.error is None:
            self.messages = [
                *self.messages,
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"go on ({len(self.answers)})"},
            ]


async def create_agents(http: aiohttp.ClientSession, proxy_url: str, ids: list[str]) -> list[Agent]:
    async def create(sid: str) -> Agent:
        body = {"run_id": "chaos", "session_id": sid}
        async with http.post(f"{proxy_url}/sessions", json=body) as resp:
            if resp.status not in (200, 201):
                raise RuntimeError(f"POST /sessions: {resp.status} {await resp.text()}")
            created = await resp.json()
        return Agent(
            sid,
            {"Authorization": f"Bearer {created['api_key']}"},
            {"Authorization": f"Bearer {created['orchestrator_key']}"},
            [{"role": "user", "content": f"task {sid}: count to a hundred"}],
        )

    return list(await asyncio.gather(*(create(i) for i in ids)))


async def stream_chat(
    http: aiohttp.ClientSession, proxy_url: str, agent: Agent, max_tokens: int, answer: Answer
) -> Answer:
    """One streamed chat turn of `agent` through the proxy at `proxy_url`, read into `answer`
    as it arrives (so that a scenario can watch its progress), and kept in `agent.answers`."""
    agent.answers.append(answer)
    body = {"model": "tiny", "messages": agent.messages, "max_tokens": max_tokens, "stream": True}
    url = f"{proxy_url}/sessions/{agent.sid}/v1/chat/completions"
    answer.started = time.monotonic()
    try:
        async with http.post(url, json=body, headers=agent.key) as resp:
            answer.status = resp.status
            if resp.status != 200:
                answer.retry_after = resp.headers.get("Retry-After")
                answer.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
                return answer
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    answer.done = True
                    continue
                chunk = orjson.loads(data)
                if "error" in chunk:
                    answer.error = f"error in stream: {str(chunk['error'])[:140]}"
                    continue
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        answer.tokens += 1
                        answer.text += content
        if not answer.done and answer.error is None:
            answer.error = "stream ended before [DONE]"
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:160]
    finally:
        answer.ended = time.monotonic()
    return answer


async def finish(
    http: aiohttp.ClientSession, proxy_url: str, agent: Agent, patience: float = 90.0
) -> tuple[int, int, str]:
    """Finish the session, retrying a 503 after its Retry-After: (status, retries, body)."""
    retries = 0
    deadline = time.monotonic() + patience
    url = f"{proxy_url}/sessions/{agent.sid}/finish"
    while True:
        try:
            async with http.post(
                url, json={"status": "completed"}, headers=agent.orchestrator
            ) as r:
                text = await r.text()
                if r.status == 503 and time.monotonic() < deadline:
                    retries += 1
                    await asyncio.sleep(min(float(r.headers.get("Retry-After") or 1), 5.0))
                    continue
                return r.status, retries, text[:200]
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, retries, f"{type(exc).__name__}: {exc}"


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.01)


# -- results ------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one scenario measured, and the promises it found broken."""

    name: str
    figures: dict[str, object] = field(default_factory=dict)
    broken: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # found, though no promise is broken
    error: str | None = None
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        return "ERROR" if self.error else "BROKEN" if self.broken else "ok"

    def figure(self, name: str, value: object) -> None:
        self.figures[name] = value
        say(f"  {name}: {value}")

    def expect(self, ok: bool, promise: str) -> None:
        if not ok:
            self.broken.append(promise)
            say(f"  BROKEN: {promise}")

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"  note: {text}")


Scenario = Callable[[Chaos, Servers, Result], Awaitable[None]]


def compare_tokens(result: Result, agents: list[Agent], stored: dict[str, int]) -> None:
    """Per session: every token an agent received is stored, and no more."""
    missing = {a.sid: (a.received, stored.get(a.sid, 0)) for a in agents
               if stored.get(a.sid, 0) < a.received}  # fmt: skip
    extra = {a.sid: (a.received, stored.get(a.sid, 0)) for a in agents
             if stored.get(a.sid, 0) > a.received}  # fmt: skip
    result.figure("tokens received by agents", sum(a.received for a in agents))
    result.figure("tokens stored", sum(stored.get(a.sid, 0) for a in agents))
    result.expect(
        not missing,
        f"tokens received by agents and missing from the store (received, stored): {missing}",
    )
    if extra:
        result.note(f"more tokens stored than the agents received (received, stored): {extra}")


# -- 1. PostgreSQL restarted mid-load -----------------------------------------------------------


async def pg_restart(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, turns, max_tokens, delay, outage = chaos.sizes.pg_sessions, 3, 48, 0.025, 1.5
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", token_delay=delay)
    proxy = start_proxy(servers, "proxy", [engine], url)
    async with new_client() as http:
        await wait_ready(servers, http, engine, proxy)
        agents = await create_agents(http, proxy.url, [f"pg-{i}" for i in range(n)])
        span = turns * max_tokens * delay  # one session's turns, back to back
        finished: dict[str, tuple[int, int, str, float]] = {}
        window: list[float] = []

        async def session(i: int, agent: Agent) -> None:
            # Staggered: when PostgreSQL goes, the first sessions are finishing, the rest
            # streaming; the last start while it is down.
            await asyncio.sleep(i * span / n)
            for _ in range(turns):
                agent.went_on(await stream_chat(http, proxy.url, agent, max_tokens, Answer()))
            started = time.monotonic()
            status, retries, text = await finish(http, proxy.url, agent)
            finished[agent.sid] = (status, retries, text, time.monotonic() - started)

        async def restart() -> None:
            await asyncio.sleep(0.8 * span)
            window.append(time.monotonic())
            await asyncio.to_thread(chaos.pg.stop, "immediate")  # as a crash
            await asyncio.sleep(outage)
            await asyncio.to_thread(chaos.pg.start)
            window.append(time.monotonic())
            say(f"  PostgreSQL stopped (immediate) and back after {window[1] - window[0]:.2f} s")

        await asyncio.gather(restart(), *(session(i, a) for i, a in enumerate(agents)))

    down, up = window
    answers = [a for agent in agents for a in agent.answers]
    across = sum(1 for a in answers if a.started < up and a.ended > down)
    errors = Counter(a.error for a in answers if a.error)
    retries = [r for _, r, _, _ in finished.values()]
    result.figure("sessions x turns", f"{n} x {turns} (max_tokens {max_tokens}, {delay}s/token)")
    result.figure("PostgreSQL down (s)", round(up - down, 2))
    result.figure("turns streaming while it was down", across)
    result.figure("agent errors", sum(errors.values()))
    for error, count in errors.items():
        say(f"    {count} x {error}")
    result.figure("finish retries (503 + Retry-After)", f"{sum(retries)} over "
                  f"{sum(1 for r in retries if r)} sessions")  # fmt: skip
    result.figure(
        "finish latency median / max (s)",
        f"{median([s for *_, s in finished.values()]):.2f} / "
        f"{max(s for *_, s in finished.values()):.2f}",
    )
    result.figure("writer retries logged by the proxy",
                  log_count(proxy, "event writer lost PostgreSQL"))  # fmt: skip
    failed = {sid: (s, t) for sid, (s, _, t, _) in finished.items() if s != 200}
    result.expect(not failed, f"every finish succeeds once PostgreSQL is back: {failed}")
    result.expect(not errors, "a PostgreSQL restart is invisible to agents (model calls go on)")
    result.expect(log_count(proxy, "gave up after") == 0, "the writer never gives up")
    compare_tokens(result, agents, await stored_tokens(url))
    turns_of = await turns_by_session(url)
    bad = {a.sid: [t["status"] for t in turns_of.get(a.sid, [])] for a in agents
           if [t["status"] for t in turns_of.get(a.sid, [])] != ["completed"] * turns}  # fmt: skip
    result.expect(not bad, f"every turn is recorded completed: {bad}")


# -- 2. a proxy replica SIGKILLed mid-stream ----------------------------------------------------

FINAL_SAMPLES = "SELECT session_id, n_turns FROM samples WHERE is_final"
#: An idle session finished as `timeout`, and how long after its last event.
TIMED_OUT = """
SELECT t.finish_reason, extract(epoch FROM f.recorded_at - (
    SELECT max(recorded_at) FROM events WHERE session_id = $1 AND position < f.position
))::float8 AS idle_s
FROM trajectories t JOIN events f ON f.session_id = t.session_id
WHERE t.session_id = $1 AND t.status = 'timeout' AND f.event_type = 'session_finished'
"""


async def replica_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, max_tokens, delay, lost_after, idle = chaos.sizes.replica_sessions, 64, 0.03, 2.0, 5.0
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", token_delay=delay)
    reaping = {"session_secret": "chaos-shared-secret", "reap_interval": 0.2,
               "replica_lost_after": lost_after, "session_idle_timeout": idle}  # fmt: skip
    a = start_proxy(servers, "replica-a", [engine], url, **reaping)
    b = start_proxy(servers, "replica-b", [engine], url, **reaping)
    async with new_client() as http:
        await wait_ready(servers, http, engine, a, b)
        agents = await create_agents(http, a.url, [f"replica-{i}" for i in range(n)])
        # One more whose orchestrator dies: one turn through B, then nothing, ever.
        [abandoned] = await create_agents(http, a.url, ["replica-abandoned"])
        first = await asyncio.gather(
            *(stream_chat(http, b.url, x, max_tokens, Answer()) for x in [*agents, abandoned])
        )
        for agent, answer in zip([*agents, abandoned], first, strict=True):
            agent.went_on(answer)
        await asyncio.sleep(0.5)
        cut = [Answer() for _ in agents]
        streams = [
            asyncio.create_task(stream_chat(http, b.url, agent, max_tokens, answer))
            for agent, answer in zip(agents, cut, strict=True)
        ]
        await wait_for(lambda: all(x.tokens >= max_tokens // 3 or x.error for x in cut), 60,
                       "every stream through B to be a third through")  # fmt: skip
        killed_at = time.time()
        b.process.send_signal(signal.SIGKILL)
        await asyncio.gather(*streams)
        say(f"  SIGKILLed replica B with {n} streams a third through or more")

        async def give_up(agent: Agent) -> int:
            # The orchestrator ends the episode on the agent's error, at once.
            status, _, _ = await finish(http, a.url, agent)
            return status

        async def go_on(agent: Agent) -> tuple[Answer, int]:
            # The agent retries its turn on A once the reaper has recorded the lost one.
            deadline = time.monotonic() + lost_after + 20
            while time.monotonic() < deadline:
                if any(r["session_id"] == agent.sid for r in await fetch(url, FAILURES)):
                    break
                await asyncio.sleep(0.2)
            answer = await stream_chat(http, a.url, agent, max_tokens, Answer())
            status, _, _ = await finish(http, a.url, agent)
            return answer, status

        early, late = agents[::2], agents[1::2]
        gave_up, outcomes = await asyncio.gather(
            asyncio.gather(*(give_up(agent) for agent in early)),
            asyncio.gather(*(go_on(agent) for agent in late)),
        )
        await asyncio.sleep(max(0.0, killed_at + lost_after + 2.0 - time.time()))
        deadline = time.monotonic() + idle + 15
        while not (timed_out := await fetch(url, TIMED_OUT, abandoned.sid)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

    turns_of = await turns_by_session(url)
    failures = {r["session_id"]: r for r in await fetch(url, FAILURES)}
    late_ids = {agent.sid for agent in late}
    lost_turns, gaps, latencies, open_turns, wrong = 0, [], [], [], []
    for agent in agents:
        turns = turns_of.get(agent.sid, [])
        whole = [0] if agent.sid not in late_ids else [0, 2]  # the turns that were not cut
        if len(turns) != len(whole) + 1:
            wrong.append(f"{agent.sid}: {len(turns)} turns")
            continue
        for i in whole:
            turn, answer = turns[i], agent.answers[i]
            if turn["status"] != "completed" or turn["completion_tokens"] != answer.tokens:
                wrong.append(f"{agent.sid}: a whole turn {turn['status']}, stored "
                             f"{turn['completion_tokens']} of {answer.tokens}")  # fmt: skip
        killed, received = turns[1], agent.answers[1].tokens
        failure = failures.get(agent.sid)
        if killed["status"] == "in_progress":
            open_turns.append(agent.sid)
        elif killed["failure"] != "replica_lost" or failure is None:
            wrong.append(f"{agent.sid}: {killed['status']} {killed['failure']}")
        else:
            lost_turns += 1
            partial = orjson.loads(failure["payload"])["partial_tokens"]["0"]
            latencies.append(failure["recorded_at"].timestamp() - killed_at)
            gaps.append(received - killed["completion_tokens"])
            if partial != killed["completion_tokens"] or killed["completion_tokens"] > received + 1:
                wrong.append(f"{agent.sid}: partial_tokens {partial}, stored "
                             f"{killed['completion_tokens']}, received {received}")  # fmt: skip
    agent_errors = Counter(x.error for x in cut if x.error)
    result.figure("sessions", f"{n} ({len(early)} finished at once, {len(late)} go on after "
                  "the reaper)")  # fmt: skip
    result.figure("streams cut by the kill (agent errors)", sum(agent_errors.values()))
    result.figure("tokens the cut turns' agents received",
                  sum(agent.answers[1].tokens for agent in agents))  # fmt: skip
    result.figure("turns recorded failed (replica_lost)", lost_turns)
    result.figure(
        "tokens received but not in the log, per lost turn (median / max)",
        f"{median(gaps):.0f} / {max(gaps)}" if gaps else "n/a",
    )
    result.figure(
        "kill -> replica_lost recorded, median / max (s)",
        f"{median(latencies):.2f} / {max(latencies):.2f}" if latencies else "n/a",
    )
    result.figure("retried turns served by A", sum(1 for x, _ in outcomes if x.error is None))
    finishes = [*gave_up, *(s for _, s in outcomes)]
    result.figure("finishes through A", sum(1 for s in finishes if s == 200))
    result.figure("cut turns left in_progress", f"{len(open_turns)} {sorted(open_turns)}")
    result.expect(not wrong, f"turns recorded as promised: {wrong}")
    result.expect(all(x.error is None for x, _ in outcomes), "replica A serves the next turns")
    result.expect(all(s == 200 for s in finishes), "replica A finishes the sessions")
    result.expect(
        not late_ids & set(open_turns),
        "every open turn of an active session is recorded failed (replica_lost) by the reaper",
    )
    async with await EventStore.open(url) as store:
        await Projector(store).run_once()
    final = {r["session_id"]: r["n_turns"] for r in await fetch(url, FINAL_SAMPLES)}
    whole = sum(1 for x in agents if final.get(x.sid) == (2 if x.sid in late_ids else 1))
    result.figure("sessions whose final sample holds their whole turns", f"{whole} of {n}")
    result.expect(whole == n, f"the samples keep the whole turns only: {final}")
    result.figure(
        f"abandoned session finished as timeout (TRAJSTORE_SESSION_IDLE_TIMEOUT={idle:g})",
        f"after {timed_out[0]['idle_s']:.2f} s idle" if timed_out else "no",
    )
    result.expect(
        bool(timed_out) and final.get(abandoned.sid) == 1,
        "a session nobody finishes is finished as timeout, and has its sample",
    )
    early_open = sorted(set(open_turns) - late_ids)
    result.expect(
        not early_open,
        f"the cut turns of sessions finished at once after the kill (before "
        f"TRAJSTORE_REPLICA_LOST_AFTER={lost_after:g} s) are recorded failed too: {early_open}",
    )


# -- 3. an engine SIGKILLed mid-stream ----------------------------------------------------------


async def engine_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, max_tokens, delay = chaos.sizes.engine_sessions, 64, 0.03
    url = await chaos.fresh()
    doomed = start_engine(servers, "engine-1", token_delay=delay)
    spare = start_engine(servers, "engine-2", token_delay=delay)
    proxy = start_proxy(servers, "proxy", [doomed, spare], url)
    # Half the sessions hash to each engine (the proxy's own rendezvous hashing).
    pool = EnginePool([doomed.url, spare.url])
    on: dict[str, list[str]] = {doomed.url: [], spare.url: []}
    for i in range(10 * n):
        sid = f"engine-{i}"
        preferred = on[pool.preferred(sid).url]
        if len(preferred) < n // 2:
            preferred.append(sid)
    async with new_client() as http:
        await wait_ready(servers, http, doomed, spare, proxy)
        agents = await create_agents(http, proxy.url, on[doomed.url] + on[spare.url])
        on_doomed = agents[: n // 2]
        first = await asyncio.gather(
            *(stream_chat(http, proxy.url, x, max_tokens, Answer()) for x in agents)
        )
        for agent, answer in zip(agents, first, strict=True):
            agent.went_on(answer)
        cut = {agent.sid: Answer() for agent in agents}
        streams = [asyncio.create_task(stream_chat(http, proxy.url, x, max_tokens, cut[x.sid]))
                   for x in agents]  # fmt: skip
        await wait_for(lambda: all(cut[x.sid].tokens >= max_tokens // 3 for x in on_doomed), 60,
                       "every stream on engine-1 to be a third through")  # fmt: skip
        killed_at = time.time()
        doomed.process.send_signal(signal.SIGKILL)
        await asyncio.gather(*streams)
        say("  SIGKILLed engine-1 mid-stream")
        for agent in agents:
            agent.went_on(cut[agent.sid])
        refused: Counter[str] = Counter()

        async def turn_with_retries(agent: Agent) -> Answer:
            # As the OpenAI client does: a 502/503 before any token is retried (2 more times).
            for attempt in range(3):
                answer = await stream_chat(http, proxy.url, agent, max_tokens, Answer())
                if answer.status in (502, 503) and attempt < 2:
                    refused[f"HTTP {answer.status}"] += 1
                    await asyncio.sleep(0.5)
                    continue
                break
            agent.went_on(answer)
            return answer

        third = await asyncio.gather(*(turn_with_retries(x) for x in agents))
        fourth = await asyncio.gather(
            *(stream_chat(http, proxy.url, x, max_tokens, Answer()) for x in agents)
        )
        for agent, answer in zip(agents, fourth, strict=True):
            agent.went_on(answer)
        async with http.get(proxy.url + "/admin/engines") as resp:
            engines = {e["url"]: e for e in await resp.json()}
        finishes = [await finish(http, proxy.url, agent) for agent in agents]

    turns_of = await turns_by_session(url)
    after = [t for ts in turns_of.values() for t in ts if t["started_at"].timestamp() > killed_at]
    served_after = Counter(t["engine"] for t in after if t["status"] == "completed")
    reasons = Counter(t["failure"] for ts in turns_of.values() for t in ts if t["failure"])
    cut_errors = [cut[x.sid] for x in agents if cut[x.sid].error]
    result.figure("sessions per engine", f"{len(on[doomed.url])} / {len(on[spare.url])}")
    result.figure("streams cut (agent errors)", len(cut_errors))
    result.figure("turns recorded failed, by reason", dict(reasons))
    result.figure("next turn: first attempts refused", dict(refused) or 0)
    result.figure("next turn: agent errors after retries", sum(1 for x in third if x.error))
    result.figure("turn after: agent errors", sum(1 for x in fourth if x.error))
    result.figure("turns completed after the kill, by engine",
                  {("engine-2" if e == spare.url else e): c
                   for e, c in served_after.items()})  # fmt: skip
    result.figure("engine-1 in /admin/engines",
                  f"healthy={engines[doomed.url]['healthy']} "
                  f"({str(engines[doomed.url]['last_error'])[:60]})")  # fmt: skip
    compare_tokens(result, agents, await stored_tokens(url))
    result.expect(
        len(cut_errors) == len(on_doomed) and all(not cut[x.sid].error for x in agents[n // 2 :]),
        "the kill cuts the streams on engine-1 only",
    )
    result.expect(
        reasons.get("engine_error", 0) >= len(cut_errors),
        "every cut stream is recorded failed (engine_error) with its tokens",
    )
    result.expect(set(served_after) == {spare.url}, "requests after the kill go to engine-2")
    result.expect(
        not any(x.error for x in third + fourth),
        "the sessions of the dead engine go on (after at most two retries)",
    )
    result.expect(not engines[doomed.url]["healthy"], "the dead engine is marked failed")
    result.expect(all(s == 200 for s, *_ in finishes), "every session finishes")
    result.expect(
        not refused,
        "a stream cut mid-way marks its engine failed: the next requests go to engine-2 at once "
        f"(first attempts refused: {dict(refused)})",
    )


# -- 4. the projector SIGKILLed part-way --------------------------------------------------------

SAMPLES = """
SELECT sample_id, session_id, branch, is_final, status, reward, md5(token_ids) AS ids,
       md5(loss_mask) AS mask, md5(logprobs) AS logprobs, prompt_len, response_len, n_turns,
       last_position
FROM samples ORDER BY sample_id
"""


async def projector_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    m, kills = chaos.sizes.projector_sessions, chaos.sizes.projector_kills
    url = await chaos.fresh()
    started = time.monotonic()
    shape = Shape(turns=4, first_prompt=256, completion=64, tool_result=32, sessions=m)
    await record(url, shape)  # benchmarks/projection.py's short sessions, finished, rewarded
    say(f"  recorded {m} finished sessions in {time.monotonic() - started:.1f} s")
    copy = await chaos.clone(url)
    project = [PYTHON, "-m", "trajstore", "project"]

    started = time.monotonic()
    once = servers.start("project-once", [*project, "--once"], env=trajstore_env(copy))
    code = await asyncio.to_thread(once.process.wait, 300)
    if code != 0:
        raise RuntimeError(f"trajstore project --once exited {code}:\n{once.log_tail()}")
    once_s = time.monotonic() - started
    expected = [tuple(r) for r in await fetch(copy, SAMPLES)]

    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:

        async def count() -> int:
            value: int = await conn.fetchval("SELECT count(*) FROM samples")
            return value

        async def in_transaction() -> bool:
            """Whether a backend of the projector is inside a transaction of 10 ms or more."""
            busy: bool = await conn.fetchval(
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = $1 "
                "AND pid <> pg_backend_pid() AND now() - xact_start > interval '10 ms'",
                database_name(url),
            )
            return busy

        at_kill: list[int] = []
        inside: list[bool] = []
        live = [*project, "--poll-interval", "0.2"]
        for k in range(kills):
            # Past a share of the samples: the even kills right after the projector committed a
            # batch, the odd ones in the middle of the next (inside its transaction).
            threshold = (k + 1) * len(expected) // (kills + 1)
            runner = servers.start(f"project-{k}", live, env=trajstore_env(url))
            while True:
                done = await count()
                if done >= threshold or runner.process.poll() is not None:
                    break
                await asyncio.sleep(0.005)
            deadline = time.monotonic() + 10
            while k % 2 and done < len(expected) and time.monotonic() < deadline:
                if await in_transaction():
                    break
                await asyncio.sleep(0.002)
            inside.append(await in_transaction())
            runner.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(runner.process.wait)
            at_kill.append(await count())
            where = "inside a transaction" if inside[-1] else "between batches"
            say(f"  SIGKILLed the projector {where}, {at_kill[-1]} samples committed")
        started = time.monotonic()
        runner = servers.start("project-last", live, env=trajstore_env(url))
        deadline = time.monotonic() + chaos.sizes.limit / 2
        while await count() < len(expected) and time.monotonic() < deadline:
            if runner.process.poll() is not None:
                raise RuntimeError(f"the projector exited:\n{runner.log_tail()}")
            await asyncio.sleep(0.02)
        catch_up = time.monotonic() - started
        await asyncio.sleep(1.0)  # would it write more?
        runner.process.send_signal(signal.SIGTERM)
        rows = [tuple(r) for r in await conn.fetch(SAMPLES)]
        finished = await conn.fetchval(
            "SELECT count(DISTINCT session_id) FROM events WHERE event_type = 'session_finished'"
        )
    finally:
        await conn.close()

    ids = [r[0] for r in rows]
    by_id = {r[0]: r for r in rows}
    want = {r[0]: r for r in expected}
    missing = sorted(set(want) - set(by_id))
    extra = sorted(set(by_id) - set(want))
    differ = sorted(i for i in set(want) & set(by_id) if want[i] != by_id[i])
    per_session = Counter(r[1] for r in rows)
    landed = sum(1 for c in at_kill if 0 < c < len(expected))
    result.figure("finished sessions", finished)
    result.figure("one-shot --once samples (s)", f"{len(expected)} ({once_s:.2f} s)")
    result.figure("kills that landed part-way", f"{landed} of {kills}, samples committed "
                  f"then: {at_kill}, {sum(inside)} inside a transaction")  # fmt: skip
    result.figure("live samples after catching up", f"{len(rows)} ({catch_up:.2f} s)")
    result.figure("duplicates / missing / extra / different",
                  f"{len(ids) - len(set(ids))} / {len(missing)} / {len(extra)} / "
                  f"{len(differ)}")  # fmt: skip
    result.expect(len(ids) == len(set(ids)), "no sample doubled")
    result.expect(not missing, f"no sample lost: {missing[:5]}")
    result.expect(not extra and not differ, f"the same samples as a one-shot projection: "
                  f"{(extra + differ)[:5]}")  # fmt: skip
    result.expect(
        len(per_session) == finished and set(per_session.values()) == {1},
        "every finished session has its sample exactly once",
    )
    if landed < kills:
        result.note("a kill came after the projector had finished: raise the sessions")


# -- 5. many concurrent streams -----------------------------------------------------------------


async def concurrent_soak(chaos: Chaos, servers: Servers, result: Result) -> None:
    n = chaos.sizes.soak_streams
    url = await chaos.fresh()
    engine = servers.start("engine", [PYTHON, "-c", INSTANT_ENGINE_MAIN, str(ROOT), "{port}"])
    proxy = start_proxy(servers, "proxy", [engine], url)
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        async with new_client() as http:
            await wait_ready(servers, http, engine, proxy)
            target = Target("trajstore", [], [proxy.process.pid], proxy)
            db = DbBackends(conn, database_name(url))
            started = time.monotonic()
            ok = await soak(http, [target], db, n)  # benchmarks/proxy_overhead.py
            seconds = time.monotonic() - started
            stored = await db.stored_tokens()
            users = await conn.fetch(
                "SELECT DISTINCT usename FROM pg_stat_activity "
                "WHERE datname = $1 AND application_name LIKE 'trajstore-proxy:%'",
                database_name(url),
            )
    finally:
        await conn.close()
    result.figure("streams", n)
    result.figure("seconds (sessions, streams, finishes)", round(seconds, 2))
    result.figure("tokens received / stored", f"{target.received_tokens} / {stored}")
    result.figure("the proxy's PostgreSQL role", ", ".join(r["usename"] for r in users))
    result.expect(ok, "no error, and every token received is stored (see the soak line above)")


# -- 6. fuzz ------------------------------------------------------------------------------------


@dataclass
class RouteTally:
    """What the fuzz sent one route, and what came back."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    unsendable: int = 0  # generated, but the HTTP client refused to send it (a bad header)
    refusals: Counter[str] = field(default_factory=Counter)  # 400s, by the start of the message
    seconds: float = 0.0


def new_session(client: Any, proxy_url: str) -> dict[str, Any]:
    response = client.post(f"{proxy_url}/sessions", json={"run_id": "chaos-fuzz"})
    response.raise_for_status()
    created: dict[str, Any] = response.json()
    return created


def run_cases(strategy: Any, n: int, seed: int, check: Callable[[Any], None]) -> str | None:
    """Feed `n` values of `strategy` to `check` (no shrinking: `check` records, never raises).
    Returns why generation stopped early, if it did."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=n, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
    )  # fmt: skip
    @hypothesis.given(strategy)
    def cases(value: Any) -> None:
        check(value)

    try:
        cases()
    except Exception as exc:  # an operation schemathesis cannot make cases for, for one
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def fuzz_openapi(proxy_url: str, n: int, seed: int, tallies: dict[str, RouteTally]) -> None:
    """Every operation of the proxy's OpenAPI schema, by schemathesis: positive and negative
    cases, and positive ones on a real session with its orchestrator key."""
    import httpx
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{proxy_url}/openapi.json", timeout=CASE_TIMEOUT)
    with httpx.Client(timeout=CASE_TIMEOUT) as client:
        session = new_session(client, proxy_url)
    known = {"session_id": session["session_id"]}
    orchestrator = {"authorization": f"Bearer {session['orchestrator_key']}"}
    for operation in (result.ok() for result in schema.get_all_operations()):
        route = f"{operation.method.upper()} {operation.path}"
        tally = tallies.setdefault(route, RouteTally())

        def send(case: Any, tally: RouteTally = tally) -> None:
            try:
                response = case.call(base_url=proxy_url, timeout=CASE_TIMEOUT)
            except requests.exceptions.Timeout:
                tally.failures.append(f"no answer in {CASE_TIMEOUT:g} s: {case.as_curl_command()}")
                return
            except requests.exceptions.ConnectionError as exc:
                tally.failures.append(f"connection failed ({exc}): {case.as_curl_command()}")
                return
            except (requests.exceptions.InvalidHeader, ValueError, UnicodeError):
                tally.unsendable += 1
                return
            tally.cases += 1
            tally.statuses[response.status_code] += 1
            if response.status_code >= 500:
                body = response.content[:200].decode(errors="replace")
                tally.failures.append(
                    f"{response.status_code} {body} <- {case.as_curl_command()[:300]}"
                )

        passes = [
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        ]
        if "{session_id}" in operation.path:
            passes.append(
                operation.as_strategy(
                    GenerationMode.POSITIVE, path_parameters=known, headers=orchestrator
                )
            )
        started = time.monotonic()
        for i, strategy in enumerate(passes):
            stopped = run_cases(strategy, n, seed + i, send)
            if stopped and i != 1:  # negative cases of a route without inputs cannot be made
                say(f"    {route}: generation stopped: {stopped}")
        tally.seconds += time.monotonic() - started


def weighted(*choices: tuple[Any, int]) -> Any:
    """One of the strategies, each as often as its weight says."""
    from hypothesis import strategies as st

    return st.sampled_from([s for s, w in choices for _ in range(w)]).flatmap(lambda s: s)


def model_call_bodies(api: str) -> Any:
    """Bodies for one model-call API: mostly its own shape, each field of the right type nine
    times in ten and anything at all the tenth; sometimes any JSON, sometimes bytes that are not
    JSON. A body of the right shape gets through to the engine often enough (a fifth to a third
    of them) to exercise the translation, the recording and the streaming."""
    from hypothesis import strategies as st

    anything = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                    max_size=4),
        max_leaves=10,
    )  # fmt: skip

    def maybe(strategy: Any) -> Any:
        return weighted((strategy, 9), (anything, 1))

    text = st.text(max_size=40)
    tokens = st.integers(min_value=1, max_value=40)
    common = {
        "model": maybe(text),
        "stream": maybe(st.booleans()),
        "temperature": maybe(st.floats(min_value=0, max_value=2)),
        "metadata": anything,
    }
    if api == "chat":
        call = st.fixed_dictionaries({
            "id": text, "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": text, "arguments": maybe(text)}),
        })  # fmt: skip
        part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
        message = st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", "developer"]))},
            optional={
                "content": maybe(st.one_of(st.none(), text, st.lists(part, max_size=3))),
                "tool_calls": maybe(st.lists(call, max_size=2)),
                "tool_call_id": text,
                "name": text,
            },
        )
        tool = st.fixed_dictionaries({
            "type": st.just("function"),
            "function": st.fixed_dictionaries({"name": text}, optional={"parameters": anything}),
        })  # fmt: skip
        body = st.fixed_dictionaries(
            {"messages": maybe(st.lists(message, min_size=1, max_size=4))},
            optional={
                **common,
                "max_tokens": maybe(tokens), "n": maybe(st.integers(1, 3)),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
                "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
                "logprobs": maybe(st.booleans()), "top_logprobs": maybe(st.integers(0, 25)),
                "stop": maybe(st.lists(text, max_size=2)), "seed": maybe(st.integers()),
                "return_token_ids": maybe(st.booleans()), "response_format": anything,
            },
        )  # fmt: skip
    elif api == "messages":
        text_block = st.fixed_dictionaries({"type": st.just("text"), "text": maybe(text)})
        block = weighted(
            (text_block, 6),
            (st.fixed_dictionaries({"type": st.just("tool_use"), "id": text, "name": text,
                                    "input": anything}), 1),
            (st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": text},
                                   optional={"content": maybe(text), "is_error": st.booleans()}),
             1),
            (st.fixed_dictionaries(
                {"type": st.sampled_from(["image", "document", "thinking", "server_tool_use"])},
                optional={"source": anything, "thinking": text}), 1),
            (anything, 1),
        )  # fmt: skip
        message = st.fixed_dictionaries({
            "role": maybe(st.sampled_from(["user", "assistant"])),
            "content": maybe(weighted((text, 2), (st.lists(block, max_size=3), 1))),
        })  # fmt: skip
        tool = st.fixed_dictionaries(
            {"name": text}, optional={"description": text, "input_schema": anything, "type": text}
        )
        body = st.fixed_dictionaries(
            {"messages": maybe(st.lists(message, min_size=1, max_size=4)),
             "max_tokens": maybe(tokens)},
            optional={
                **common,
                "system": maybe(st.one_of(text, st.lists(text_block, max_size=2))),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.fixed_dictionaries(
                    {"type": st.sampled_from(["auto", "any", "tool", "none"])},
                    optional={"name": text})),
                "stop_sequences": maybe(st.lists(text, max_size=2)),
                "thinking": anything, "top_k": maybe(tokens),
            },
        )  # fmt: skip
    else:
        part = st.fixed_dictionaries({
            "type": st.sampled_from(["input_text", "output_text", "input_image"]), "text": text,
        })  # fmt: skip
        message = st.fixed_dictionaries(
            {"role": maybe(st.sampled_from(["user", "assistant", "system", "developer"])),
             "content": maybe(weighted((text, 2), (st.lists(part, max_size=3), 1)))},
            optional={"type": st.just("message")},
        )  # fmt: skip
        item = weighted(
            (message, 6),
            (st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text,
                                    "name": text, "arguments": maybe(text)}), 1),
            (st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                                    "output": maybe(text)}), 1),
            (st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "web_search_call"])},
                                   optional={"summary": anything}), 1),
            (anything, 1),
        )  # fmt: skip
        tool = st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "function", "web_search"]), "name": text},
            optional={"parameters": anything, "strict": st.booleans()},
        )
        body = st.fixed_dictionaries(
            {"input": maybe(weighted((text, 1), (st.lists(item, min_size=1, max_size=4), 2)))},
            optional={
                **common,
                "instructions": maybe(text), "max_output_tokens": maybe(tokens),
                "tools": maybe(st.lists(tool, max_size=2)),
                "tool_choice": maybe(st.sampled_from(["auto", "none", "required"])),
                "previous_response_id": maybe(st.none()), "store": maybe(st.booleans()),
                "text": anything, "reasoning": anything,
            },
        )  # fmt: skip
    return weighted(
        (body.map(lambda b: json.dumps(b).encode()), 8),
        (anything.map(lambda b: json.dumps(b).encode()), 1),
        (st.binary(max_size=40), 1),
    )


MODEL_ROUTES = {"chat": "chat/completions", "messages": "messages", "responses": "responses"}


def fuzz_model_calls(proxy_url: str, n: int, seed: int, tallies: dict[str, RouteTally]) -> None:
    """Random bodies for the three agent APIs, on a session of their own, with the session's
    key (as Bearer or x-api-key), another key, or none; by path or by X-Session-Id."""
    import httpx
    from hypothesis import strategies as st

    with httpx.Client(timeout=CASE_TIMEOUT) as client:
        for api, path in MODEL_ROUTES.items():
            session = new_session(client, proxy_url)
            sid, key = session["session_id"], session["api_key"]
            route = f"POST /sessions/{{id}}/v1/{path}"
            tally = tallies.setdefault(route, RouteTally())
            auths = {
                "bearer": {"Authorization": f"Bearer {key}"},
                "x-api-key": {"x-api-key": key},
                "orchestrator": {"Authorization": f"Bearer {session['orchestrator_key']}"},
                "none": {},
                "wrong": {"Authorization": "Bearer not-a-key"},
            }

            def send(
                case: tuple[bytes, str, str],
                tally: RouteTally = tally,
                sid: str = sid,
                path: str = path,
                auths: dict[str, dict[str, str]] = auths,
            ) -> None:
                body, auth, where = case
                headers = {"Content-Type": "application/json", **auths[auth]}
                url = f"{proxy_url}/sessions/{sid}/v1/{path}"
                if where == "header":
                    url, headers["X-Session-Id"] = f"{proxy_url}/v1/{path}", sid
                elif where == "unknown":
                    url = f"{proxy_url}/sessions/no-such-session/v1/{path}"
                started = time.monotonic()
                try:
                    with client.stream("POST", url, content=body, headers=headers) as response:
                        received = b""
                        for data in response.iter_bytes():
                            received += data
                            if time.monotonic() - started > 2 * CASE_TIMEOUT:
                                raise httpx.ReadTimeout("the answer did not end")
                except httpx.TimeoutException:
                    tally.failures.append(f"hang: {url} {body[:300]!r}")
                    return
                except httpx.TransportError as exc:
                    tally.failures.append(f"{type(exc).__name__}: {exc}: {url} {body[:300]!r}")
                    return
                tally.cases += 1
                tally.statuses[response.status_code] += 1
                if response.status_code >= 500:
                    tally.failures.append(
                        f"{response.status_code} {received[:200]!r} <- {where} {auth} "
                        f"{body[:300]!r}"
                    )
                elif response.status_code == 400:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                        error = orjson.loads(received)["error"]
                        tally.refusals[str(error.get("message"))[:50]] += 1
                elif b"the proxy failed" in received:  # a bug of ours reported mid-stream
                    tally.failures.append(f"error in a 200 stream: {received[-300:]!r} <- "
                                          f"{body[:300]!r}")  # fmt: skip

            cases = st.tuples(
                model_call_bodies(api),
                st.sampled_from(["bearer"] * 6 + ["x-api-key", "orchestrator", "none", "wrong"]),
                st.sampled_from(["path"] * 6 + ["header", "unknown"]),
            )
            started = time.monotonic()
            stopped = run_cases(cases, n, seed, send)
            tally.seconds += time.monotonic() - started
            if stopped:
                say(f"    {route}: generation stopped: {stopped}")


async def api_fuzz(chaos: Chaos, servers: Servers, result: Result) -> None:
    try:
        import schemathesis
    except ImportError:
        result.error = "schemathesis is not installed: pip install 'schemathesis>=4.32,<5'"
        return
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", completion_tokens=8)
    proxy = start_proxy(servers, "proxy", [engine], url)
    async with new_client() as http:
        await wait_ready(servers, http, engine, proxy)
    tallies: dict[str, RouteTally] = {}
    sizes = chaos.sizes
    say(f"  schemathesis {schemathesis.__version__}, seed {chaos.seed}")
    await asyncio.to_thread(fuzz_openapi, proxy.url, sizes.schema_cases, chaos.seed, tallies)
    # The fuzz's valid `POST /admin/switches` began weight switches nobody ends (the chaos proxy
    # has no admin key): end them, as an operator would, so model calls are not held behind them.
    async with new_client() as http:
        async with http.get(proxy.url + "/admin/switches") as resp:
            switches = await resp.json()
        for begun in switches:
            if begun.get("outcome") is None:
                ended = f"{proxy.url}/admin/switches/{begun['switch_id']}/failed"
                async with http.post(ended, json={"reason": "ended after the fuzz"}) as resp:
                    resp.raise_for_status()
        say(f"  switches the fuzz began, ended: {sum(s.get('outcome') is None for s in switches)}")
    await asyncio.to_thread(fuzz_model_calls, proxy.url, sizes.model_cases, chaos.seed, tallies)
    async with new_client() as http, http.get(proxy.url + "/health") as resp:
        healthy = resp.status == 200
    say(f"  {'route':<44} {'cases':>5} {'s':>5}  statuses")
    for route, tally in tallies.items():
        statuses = " ".join(f"{s}:{c}" for s, c in sorted(tally.statuses.items()))
        extra = f" (+{tally.unsendable} unsendable)" if tally.unsendable else ""
        say(f"  {route:<44} {tally.cases:5d} {tally.seconds:5.1f}  {statuses}{extra}")
        for message, count in tally.refusals.most_common(3):
            say(f"  {'':<44} 400 x {count}: {message}")
    failures = [f"{route}: {f}" for route, t in tallies.items() for f in t.failures]
    for failure in failures[:20]:
        say(f"    {failure}")
    proxy_errors = await fetch(url, "SELECT count(*) AS n FROM turns WHERE failure = 'proxy_error'")
    tracebacks = log_count(proxy, "Traceback")
    result.figure("cases", sum(t.cases for t in tallies.values()))
    result.figure("routes", len(tallies))
    result.figure("5xx or hangs", len(failures))
    result.figure("turns recorded failed as proxy_error", proxy_errors[0]["n"])
    result.figure("tracebacks in the proxy's log", tracebacks)
    result.expect(not failures, "no 5xx and no hang, whatever the request")
    result.expect(healthy and proxy.process.poll() is None, "the proxy is healthy after the fuzz")
    if tracebacks:
        result.note(f"the proxy logged {tracebacks} traceback(s); the first:\n"
                    + first_traceback(proxy))  # fmt: skip


def first_traceback(server: Server) -> str:
    text = server.log.read_text(errors="replace")
    start = text.find("Traceback")
    return text[max(0, text.rfind("\n", 0, start - 1)) : start + 2500]


# -- the run ------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "pg-restart": ("PostgreSQL restarted mid-load", pg_restart),
    "replica-kill": ("a proxy replica SIGKILLed mid-stream", replica_kill),
    "engine-kill": ("an engine SIGKILLed mid-stream", engine_kill),
    "projector-kill": ("the projector SIGKILLed part-way", projector_kill),
    "soak": ("concurrent streams, one request each", concurrent_soak),
    "api-fuzz": ("property-based fuzz of the HTTP API", api_fuzz),
}


async def run_scenario(chaos: Chaos, name: str) -> Result:
    title, scenario = SCENARIOS[name]
    say(f"\n== {name}: {title}")
    result = Result(name)
    servers = Servers()
    started = time.monotonic()
    try:
        async with asyncio.timeout(chaos.sizes.limit) as limit:
            await scenario(chaos, servers, result)
    except TimeoutError:
        if limit.expired():
            result.error = f"did not end within {chaos.sizes.limit:.0f} s"
        else:
            result.error = f"TimeoutError: {traceback.format_exc(limit=3)}"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if result.verdict != "ok":
            for server in servers.started:
                with contextlib.suppress(OSError):
                    say(f"  -- last lines of {server.name}'s log:\n{server.log_tail(12)}")
        await asyncio.to_thread(servers.stop)
    result.seconds = time.monotonic() - started
    if result.error:
        say(f"  ERROR: {result.error}")
    say(f"  -> {result.verdict} in {result.seconds:.1f} s")
    return result


def print_table(results: list[Result], total: float) -> None:
    say(f"\n{'scenario':<15} {'verdict':<7} {'s':>6}  figures")
    for r in results:
        figures = "; ".join(f"{k}: {v}" for k, v in list(r.figures.items())[:4])
        say(f"{r.name:<15} {r.verdict:<7} {r.seconds:6.1f}  {figures[:150]}")
        for promise in r.broken:
            say(f"{'':<30}broken: {promise[:200]}")
        for note in r.notes:
            say(f"{'':<30}note: {note.splitlines()[0][:200]}")
    say(f"total {total:.1f} s")


async def main(names: list[str], quick: bool, seed: int) -> int:
    if os.environ.get("TRAJSTORE_DATABASE_URL"):
        say("note: TRAJSTORE_DATABASE_URL is ignored: the suite restarts a PostgreSQL of its own")
    started = time.monotonic()
    chaos = Chaos(Sizes.of(quick), seed)
    results: list[Result] = []
    try:
        await chaos.start()
        say(f"PostgreSQL of the suite: {chaos.pg.data_dir} (port {chaos.pg.port})")
        for name in names:
            results.append(await run_scenario(chaos, name))
    finally:
        await chaos.close()
    print_table(results, time.monotonic() - started)
    return 0 if all(r.verdict == "ok" for r in results) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that SIGTERM cleans up as Ctrl-C does


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: about two minutes")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="these scenarios")
    parser.add_argument("--seed", type=int, default=0, help="the fuzz's seed [0]")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(uvloop.run(main(args.only or list(SCENARIOS), args.quick, args.seed)))
