"""The engine pool: sticky routing by key, fallback under failure and load, health checks.

The engines are real local aiohttp servers that answer `GET /health` with a status the test
chooses; routing-only tests need no server at all, since the pool only talks to an engine when
it checks its health.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from tests.support import eventually
from trajstore.proxy.engines import Engine, EnginePool, NoHealthyEngine

KEYS = [f"session-{i}" for i in range(1000)]
URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]


class FakeEngine:
    """A local HTTP server with only vLLM's `/health`, whose answer the test sets."""

    def __init__(self) -> None:
        self.status = 200
        self.delay = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _health(self, request: web.Request) -> web.Response:
        if self.delay:
            await asyncio.sleep(self.delay)
        return web.Response(status=self.status)


@pytest.fixture
async def servers() -> AsyncIterator[list[FakeEngine]]:
    fakes = [FakeEngine() for _ in range(3)]
    for fake in fakes:
        await fake.start()
    yield fakes
    for fake in fakes:
        await fake.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@contextlib.asynccontextmanager
async def started_pool(
    servers: list[FakeEngine],
    session: aiohttp.ClientSession,
    *,
    health_interval: float = 5.0,
    health_timeout: float = 2.0,
) -> AsyncIterator[EnginePool]:
    """A pool over `servers`, started (first health checks done) and closed after the block."""
    pool = EnginePool(
        [fake.url for fake in servers],
        health_interval=health_interval,
        health_timeout=health_timeout,
    )
    await pool.start(session)
    try:
        yield pool
    finally:
        await pool.close()


def others(pool: EnginePool, engine: Engine) -> list[Engine]:
    return [e for e in pool.engines if e is not engine]


# Routing: no I/O.


def test_same_key_goes_to_same_engine_across_pools() -> None:
    first, second = EnginePool(URLS), EnginePool(list(URLS))
    for key in KEYS:
        assert first.preferred(key).url == second.preferred(key).url
        assert first.preferred(key) is first.preferred(key)


def test_keys_spread_over_engines() -> None:
    pool = EnginePool(URLS)
    counts = Counter(pool.preferred(key).url for key in KEYS)
    assert set(counts) == set(URLS)
    for url in URLS:
        assert 200 <= counts[url] <= 500, counts


def test_removing_an_engine_moves_only_its_keys() -> None:
    full = EnginePool(URLS)
    removed = URLS[1]
    reduced = EnginePool([URLS[0], URLS[2]])
    moved_to: Counter[str] = Counter()
    for key in KEYS:
        before, after = full.preferred(key).url, reduced.preferred(key).url
        if before == removed:
            moved_to[after] += 1
        else:
            assert after == before, key
    # The removed engine's sessions spread over the survivors rather than piling onto one.
    assert set(moved_to) == {URLS[0], URLS[2]}


def test_urls_are_normalised_and_duplicates_refused() -> None:
    pool = EnginePool(["http://h:1/", "http://h:2/v1", "http://h:3/v1/", "http://h:4"])
    assert [e.url for e in pool.engines] == ["http://h:1", "http://h:2", "http://h:3", "http://h:4"]
    assert pool.get("http://h:2/v1/") is pool.engines[1]
    with pytest.raises(KeyError):
        pool.get("http://h:5")
    with pytest.raises(ValueError, match="twice"):
        EnginePool(["http://h:1", "http://h:1/v1/"])
    # No engine named is allowed (relays dial in later), and routes nothing until one does.
    with pytest.raises(NoHealthyEngine, match="no engine yet"):
        EnginePool([]).choose("session-1")


def test_saturated_preferred_engine_falls_back_to_least_loaded() -> None:
    pool = EnginePool(URLS, max_in_flight=1)
    key = KEYS[0]
    preferred = pool.preferred(key)
    first = others(pool, preferred)[0]
    with pool.lease(preferred):
        assert preferred.saturated
        # Equal load: the first engine in order wins the tie.
        assert pool.choose(key) is first
    assert preferred.in_flight == 0
    assert pool.choose(key) is preferred


def test_when_every_engine_is_saturated_the_least_loaded_still_serves() -> None:
    pool = EnginePool(URLS, max_in_flight=1)
    busiest, *rest = pool.engines
    with contextlib.ExitStack() as leases:
        for engine in pool.engines:
            leases.enter_context(pool.lease(engine))
        leases.enter_context(pool.lease(busiest))  # now at 2
        assert all(e.saturated for e in pool.engines)
        chosen = pool.choose(KEYS[0])
        assert chosen is not busiest and chosen in rest  # queued at an engine, not refused


def test_lease_is_released_when_the_request_fails() -> None:
    pool = EnginePool(URLS)
    engine = pool.engines[0]

    def failing_request() -> None:
        with pool.lease(engine):
            assert engine.in_flight == 1
            raise RuntimeError("request failed")

    with pytest.raises(RuntimeError):
        failing_request()
    assert engine.in_flight == 0


def test_set_policy_version_and_describe() -> None:
    pool = EnginePool(URLS, policy_version="7", max_in_flight=4)
    assert {e.policy_version for e in pool.engines} == {"7"}
    engine = pool.set_policy_version(URLS[1] + "/v1", "8")
    assert engine is pool.engines[1]
    assert engine.policy_version == "8"
    with pytest.raises(KeyError):
        pool.set_policy_version("http://elsewhere:1", "8")

    with pool.lease(engine):
        described = pool.describe()
    json.dumps(described)
    assert [d["url"] for d in described] == URLS
    assert described[1] == {
        "url": URLS[1],
        "policy_version": "8",
        "healthy": True,
        "in_flight": 1,
        "max_in_flight": 4,
        "saturated": False,
        "last_error": None,
        "last_checked": None,
        "token_prompts": True,
        "transport": "http",
    }


# Health: real local servers.


async def test_start_checks_every_engine(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    servers[2].status = 503
    async with started_pool(servers, session) as pool:
        assert [e.healthy for e in pool.engines] == [True, True, False]
        assert all(e.last_checked is not None for e in pool.engines)
        assert pool.engines[2].last_error is not None and "503" in pool.engines[2].last_error


async def test_unhealthy_preferred_engine_falls_back_to_least_loaded(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    async with started_pool(servers, session) as pool:
        key = KEYS[0]
        preferred = pool.preferred(key)
        assert pool.choose(key) is preferred
        busy, idle = others(pool, preferred)
        servers[pool.engines.index(preferred)].status = 503
        assert await pool.check(preferred) is False

        with pool.lease(busy):
            assert pool.choose(key) is idle
        assert pool.choose(key) is busy  # equal load again: first in order
        assert pool.preferred(key) is preferred  # the hash does not care about health


async def test_no_healthy_engine_when_all_are_down(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    async with started_pool(servers, session, health_timeout=0.2) as pool:
        servers[0].status = 500
        servers[1].delay = 0.5  # slower than the health timeout
        await servers[2].stop()  # connection refused
        assert [await pool.check(e) for e in pool.engines] == [False, False, False]
        errors = [e.last_error or "" for e in pool.engines]
        assert "500" in errors[0]
        assert "timed out" in errors[1]
        assert "failed" in errors[2]
        with pytest.raises(NoHealthyEngine, match="No engine is healthy"):
            pool.choose(KEYS[0])


async def test_engine_recovers_through_background_checks(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    servers[0].status = 503
    async with started_pool(servers, session, health_interval=0.05) as pool:
        engine = pool.engines[0]
        assert not engine.healthy
        servers[0].status = 200
        await eventually(lambda: engine.healthy, timeout=2.0)
        assert engine.last_error is None


async def test_close_stops_background_checks(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    async with started_pool(servers, session, health_interval=0.05) as pool:
        await pool.close()
    servers[0].status = 503
    await asyncio.sleep(0.2)
    assert pool.engines[0].healthy
    assert not session.closed


async def test_mark_failed_holds_until_next_successful_check(
    servers: list[FakeEngine], session: aiohttp.ClientSession
) -> None:
    async with started_pool(servers, session) as pool:
        key = KEYS[0]
        preferred = pool.preferred(key)
        pool.mark_failed(preferred, "connection refused")
        assert not preferred.healthy
        assert preferred.last_error == "connection refused"
        assert pool.choose(key) is not preferred
        assert await pool.check(preferred) is True
        assert pool.choose(key) is preferred


async def test_health_changes_are_logged_once(
    servers: list[FakeEngine], session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    async with started_pool(servers, session) as pool:
        engine = pool.engines[0]
        caplog.set_level(logging.INFO, logger="trajstore.proxy.engines")
        servers[0].status = 503
        for _ in range(3):
            await pool.check(engine)
        servers[0].status = 200
        for _ in range(3):
            await pool.check(engine)
        messages = [r.getMessage() for r in caplog.records if r.name == "trajstore.proxy.engines"]
        assert len(messages) == 2, messages
        assert "unhealthy" in messages[0] and "healthy again" in messages[1]


def test_an_acquired_engine_is_released_once_however_often_release_is_called() -> None:
    pool = EnginePool(URLS)
    engine = pool.engines[0]
    release = pool.acquire(engine)
    assert engine.in_flight == 1
    release()
    release()  # the relay's own cleanup and the response's both release
    assert engine.in_flight == 0
