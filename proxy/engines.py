"""The inference engines behind the proxy: which one serves a request, and which are alive.

Each engine is a vLLM OpenAI-compatible server, reached at its URL or, when it dialled in, over
its relay's WebSocket (`proxy.transport`, `proxy.relay`): the pool does not care which. A request
is routed by a key (its session id):
rendezvous (highest-random-weight) hashing gives every key one preferred engine, so a session's
turns land where its prefix is already cached, and when an engine disappears only the sessions
it held move elsewhere. An engine that is down or saturated is skipped in favour of the least
loaded healthy one.

    EngineError
    └── NoHealthyEngine     every engine is down (HTTP: 503)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from trajstore.proxy.transport import HttpTransport, Transport

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """An inference engine cannot serve the request."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class NoHealthyEngine(EngineError):
    """No engine is healthy."""


@dataclass
class Engine:
    """One inference engine, with what the proxy knows of its health and load."""

    url: str
    policy_version: str = "0"
    max_in_flight: int = 256
    healthy: bool = True
    in_flight: int = 0
    last_error: str | None = None
    last_checked: float | None = None
    #: Whether it takes pre-tokenised chat prompts (`proxy.continuation`); False once it
    #: rendered the messages instead of using the ids it was sent.
    token_prompts: bool = True
    #: How requests reach it; the pool sets it (HTTP at start, a relay's channel on dial-in).
    transport: Transport | None = field(default=None, repr=False)

    @property
    def saturated(self) -> bool:
        """Whether the engine already has as many requests in flight as it may take."""
        return self.in_flight >= self.max_in_flight

    def describe(self) -> dict[str, object]:
        """Return the engine's state as a JSON-able dict, for the admin API."""
        return {
            "url": self.url,
            "policy_version": self.policy_version,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "saturated": self.saturated,
            "last_error": self.last_error,
            "last_checked": self.last_checked,
            "token_prompts": self.token_prompts,
            **(self.transport.describe() if self.transport else {"transport": "http"}),
        }

    def connection(self) -> Transport:
        """How requests reach the engine; raise if the pool has not started."""
        if self.transport is None:
            raise RuntimeError(f"engine {self.url} has no transport: start() the pool first")
        return self.transport


def _normalise_url(url: str) -> str:
    """Return the engine's base URL: no trailing slash and no trailing `/v1`."""
    url = url.rstrip("/")
    url = url.removesuffix("/v1")
    return url.rstrip("/")


def _weight(url: str, key: str) -> int:
    """Return the rendezvous weight of `key` on the engine at `url`."""
    # blake2b, not hash(): Python salts str hashes per process, and every proxy replica must
    # send a session to the same engine.
    digest = hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class EnginePool:
    """The engines behind the proxy: routing by key, in-flight counts and health checks."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        policy_version: str = "0",
        max_in_flight: int = 256,
        health_interval: float = 5.0,
        health_timeout: float = 2.0,
    ) -> None:
        if isinstance(urls, str):
            raise TypeError("urls must be a sequence of URLs, not one string")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, not {max_in_flight}")
        if health_interval <= 0 or health_timeout <= 0:
            raise ValueError("health_interval and health_timeout must be positive")
        self.engines: list[Engine] = []
        self._by_url: dict[str, Engine] = {}
        for raw in urls:
            url = _normalise_url(raw)
            if url in self._by_url:
                raise ValueError(f"engine {url} is listed twice")
            engine = Engine(url=url, policy_version=policy_version, max_in_flight=max_in_flight)
            self.engines.append(engine)
            self._by_url[url] = engine
        self._policy_version = policy_version
        self._max_in_flight = max_in_flight
        self._health_interval = health_interval
        self._health_timeout = health_timeout
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._checks: set[asyncio.Task[bool]] = set()  # checks of suspects, kept until done

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Check every engine once, then keep re-checking them in the background."""
        if self._task is not None:
            raise RuntimeError("the engine pool is already started")
        self._session = session
        for engine in self.engines:
            if engine.transport is None:
                engine.transport = HttpTransport(session, engine.url)
        await self._check_all()
        self._task = asyncio.create_task(self._health_loop(), name="engine-health")

    async def close(self) -> None:
        """Stop the background health checks; the session stays open (the caller owns it)."""
        for check in list(self._checks):
            check.cancel()
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    def preferred(self, key: str) -> Engine:
        """Return the engine `key` hashes to, whatever its health."""
        if not self.engines:
            raise NoHealthyEngine("no engine yet: name one, or connect a relay")
        # Ties (astronomically unlikely) go to the first engine in order: max() keeps the first.
        return max(self.engines, key=lambda engine: _weight(engine.url, key))

    def choose(self, key: str, exclude: Collection[Engine] = ()) -> Engine:
        """Return the engine to send `key`'s request to: its preferred one when that can serve.
        `exclude`: engines already tried for this request."""
        preferred = self.preferred(key)
        if preferred.healthy and not preferred.saturated and preferred not in exclude:
            return preferred
        healthy = [e for e in self.engines if e.healthy and e not in exclude]
        if not healthy:
            raise NoHealthyEngine()
        # When every healthy engine is saturated, the least loaded still takes the request:
        # engines queue requests themselves, and an agent is better served late than refused.
        # (Back-pressure comes from the recorder, whose limit protects what must not be lost.)
        return min(healthy, key=lambda e: (e.saturated, e.in_flight))

    @contextlib.contextmanager
    def lease(self, engine: Engine) -> Iterator[Engine]:
        """Count a request as in flight on `engine` while the block runs."""
        engine.in_flight += 1
        try:
            yield engine
        finally:
            engine.in_flight -= 1

    def acquire(self, engine: Engine) -> Callable[[], None]:
        """Count a request as in flight until the returned release is called (once is enough;
        later calls do nothing): for a streamed answer, whose end is not the caller's block."""
        engine.in_flight += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                engine.in_flight -= 1

        return release

    def attach(self, url: str, transport: Transport, error: str | None) -> Engine:
        """Serve from the engine at `url` through `transport` (a relay that dialled in), healthy
        unless `error`. An engine seen before keeps its entry (policy version, hash position):
        a reconnecting relay gets its sessions back."""
        engine = self._by_url.get(url)
        if engine is None:
            engine = Engine(url=url, policy_version=self._policy_version,
                            max_in_flight=self._max_in_flight)  # fmt: skip
            self.engines.append(engine)
            self._by_url[url] = engine
            logger.info("engine %s dialled in", url)
        engine.transport = transport
        engine.last_checked = time.time()
        self._set_health(engine, healthy=error is None, error=error)
        return engine

    def detach(self, engine: Engine, transport: Transport, error: str) -> None:
        """Stop routing to `engine` because `transport` is gone, unless it was replaced already
        (the relay reconnected first). The engine stays listed, unhealthy, until it returns."""
        if engine.transport is transport:
            self._set_health(engine, healthy=False, error=error)

    def get(self, url: str) -> Engine:
        """Return the engine at `url` (normalised); raise KeyError if there is none."""
        return self._by_url[_normalise_url(url)]

    def set_policy_version(self, url: str, version: str) -> Engine:
        """Record that the engine at `url` now serves the weights of policy `version`."""
        engine = self.get(url)
        if engine.policy_version != version:
            logger.info(
                "engine %s: policy version %s -> %s", engine.url, engine.policy_version, version
            )
        engine.policy_version = version
        return engine

    def suspect(self, engine: Engine, error: str) -> None:
        """Take `engine` out of rotation after a stream from it broke off, and check it now:
        a dead engine stays out, one that still answers its health check is back at once (a
        connection can break while the engine lives)."""
        self.mark_failed(engine, error)
        if self._session is not None:
            check = asyncio.create_task(self.check(engine), name=f"check {engine.url}")
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    def mark_failed(self, engine: Engine, error: str) -> None:
        """Take `engine` out of rotation after a request failed to reach it."""
        # Only a successful health check brings it back: one failed connection is enough
        # evidence to stop sending it new sessions until the engine answers again.
        self._set_health(engine, healthy=False, error=error)

    async def check(self, engine: Engine) -> bool:
        """Ask the engine whether it is up (its `/health`, or its relay's last report); record
        and return the answer."""
        if self._session is None:
            raise RuntimeError("start() the engine pool before checking engines")
        transport = engine.connection()
        error = await transport.health(self._health_timeout)
        if engine.transport is not transport:
            return engine.healthy  # a relay reconnected meanwhile: its own report stands
        engine.last_checked = time.time()
        self._set_health(engine, healthy=error is None, error=error)
        return engine.healthy

    def record_health(self, engine: Engine, error: str | None) -> None:
        """Record a health report that came to the proxy (a relay's check of its engine)."""
        engine.last_checked = time.time()
        self._set_health(engine, healthy=error is None, error=error)

    def describe(self) -> list[dict[str, object]]:
        """Return every engine's state, in order, as JSON-able dicts."""
        return [engine.describe() for engine in self.engines]

    def _set_health(self, engine: Engine, *, healthy: bool, error: str | None) -> None:
        """Record the engine's health, logging only when it changes."""
        if healthy and not engine.healthy:
            logger.info("engine %s is healthy again", engine.url)
        elif not healthy and engine.healthy:
            logger.warning("engine %s is unhealthy: %s", engine.url, error)
        engine.healthy = healthy
        engine.last_error = error

    async def _check_all(self) -> None:
        """Check every engine concurrently, so one slow engine does not delay the others."""
        await asyncio.gather(*(self.check(engine) for engine in self.engines))

    async def _health_loop(self) -> None:
        """Re-check every engine each `health_interval` seconds until cancelled."""
        while True:
            await asyncio.sleep(self._health_interval)
            try:
                await self._check_all()
            except Exception:
                # check() already turns network failures into an unhealthy engine; anything
                # else is a bug, logged loudly but not allowed to stop future checks.
                logger.exception("engine health check failed unexpectedly")
