"""The chaos suite's world: its own PostgreSQL, the processes it starts, and what a scenario
reports (benchmarks/chaos.py runs the scenarios).

Each scenario gets a fresh migrated database of the suite's PostgreSQL (which it may stop and
start), starts fake engines and `trajstore proxy` processes through `Servers`, reads the log back
with plain SQL, and records its figures and broken promises in a `Result`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import asyncpg
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from proxy_overhead import Server, Servers, free_port

from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import EmbeddedPostgres
from trajstore.store.roles import PROJECTOR_ROLE, RECORDER_ROLE, as_role

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

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
