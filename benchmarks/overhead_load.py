"""The load of benchmarks/proxy_overhead.py: closed-loop workers, what they saw, the CPU time of
every process involved, and trajstore's sessions (created, finished, reconciled with the store).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import asyncpg
import orjson
from overhead_servers import RUN_ID, Server, cpu_seconds, request_body

from trajstore.proxy.wire import engine_body

#: Requests each worker sends before a measurement: connections open, caches warm.
WARMUP_PER_WORKER = 2


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


async def chat_chunks(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The chunks of a streamed chat completion as they arrive, parsed; RequestFailed when the
    stream ends before its `data: [DONE]`."""
    done = False
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            continue
        yield orjson.loads(data)
    if not done:
        raise RequestFailed("stream ended before [DONE]")


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
                async for chunk in chat_chunks(resp):
                    if "error" in chunk:
                        raise RequestFailed("error in stream")
                    if chunk.get("usage"):  # asked for with a real engine: exact counts
                        tokens = chunk["usage"]["completion_tokens"]
                    elif any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - started
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
