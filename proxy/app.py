"""The proxy's HTTP API: sessions, OpenAI-compatible model calls, health, metrics, admin.

    POST /sessions                                  create (idempotent per client-chosen id)
    GET  /sessions/{id}                             the session as recorded (a page, `?turn=N`)
    GET  /sessions/{id}/turns/{n}                   one turn whole
    POST /sessions/{id}/reward | finish | discard
    POST /sessions/{id}/v1/chat/completions         OpenAI-compatible, per session base URL
    POST /sessions/{id}/v1/completions              (these and the X-Session-Id variants under
    POST /sessions/{id}/v1/messages[/count_tokens]   /v1 are served by `proxy.model_calls`)
    POST /sessions/{id}/v1/responses
    POST /v1/chat/completions, /v1/completions, /v1/messages, /v1/responses
    GET  /sessions/{id}/v1/models
    GET  /health, /metrics
    GET  /admin/engines, POST /admin/engines/policy-version
    GET | POST /admin/switches, POST /admin/switches/{id}/live | failed
                                                    weight switches without a drain
    GET | PUT | DELETE /admin/runs/{run_id}/limits  a run's limits on this replica (admission)
    WS   /engines/connect                           an engine's relay dials in (`proxy.relay`)

The model-call routes bypass FastAPI (see `proxy.model_calls`): they are the hot path.
The session routes are `proxy.session_routes`, the admin routes `proxy.admin_routes`; what
they share (the running proxy, who may call) is `proxy.state`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import Receive, Scope, Send

from trajstore.proxy.admin_routes import add_admin_routes
from trajstore.proxy.admission import Admission
from trajstore.proxy.engines import EnginePool
from trajstore.proxy.errors import ProxyError, from_store_error
from trajstore.proxy.forwarding import Forwarder
from trajstore.proxy.lineages import turn_in_log
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.model_calls import BodyLimit, ModelCalls
from trajstore.proxy.reads import Reader
from trajstore.proxy.reaper import Reaper
from trajstore.proxy.relay_channel import accept_relay
from trajstore.proxy.replicas import connection_name, new_replica_id
from trajstore.proxy.session_routes import add_session_routes
from trajstore.proxy.sessions import SessionRegistry
from trajstore.proxy.settings import ProxySettings
from trajstore.proxy.state import ProxyState, State
from trajstore.proxy.tracing import start_tracing
from trajstore.store import EventStore, StoreError
from trajstore.store.collector import fewer_collections

log = logging.getLogger(__name__)


class ProxyApp(FastAPI):
    """FastAPI, with the model calls answered in front of its whole stack (`proxy.model_calls`).

    FastAPI and Starlette wrap every request, and every write of a response, in their own
    middleware (error pages, telemetry, body limits): per-request work the hot path does not need.
    Everything but the model calls goes through FastAPI as usual, lifespan included.
    """

    def __init__(self, max_body_bytes: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model_calls = ModelCalls(super().__call__, max_body_bytes, lambda: self.state.proxy)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.model_calls(scope, receive, send)


def create_app(settings: ProxySettings, database_url: str) -> FastAPI:
    """The proxy application; it connects to the store and engines when it starts."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        replica_id = new_replica_id()  # names its connections: how replicas find each other
        tracer = start_tracing(settings, replica_id)  # first: a misconfiguration stops us here
        store = await EventStore.open(database_url)
        writer = store.writer(
            max_pending=settings.writer_max_pending,
            flush_interval=settings.writer_linger,
            application_name=connection_name(replica_id, "writer"),
        )
        await writer.start()
        http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        engines = EnginePool(
            settings.engines,
            policy_version=settings.policy_version,
            max_in_flight=settings.max_in_flight,
        )
        await engines.start(http)
        secret = (settings.session_secret or settings.api_key or secrets.token_hex(32)).encode()
        public_url = (settings.public_url or f"http://{settings.host}:{settings.port}").rstrip("/")
        registry = SessionRegistry(
            store, writer, secret, replica_id=replica_id, finish_timeout=settings.finish_timeout
        )
        metrics = ProxyMetrics()
        metrics.watch(
            pending=lambda: writer.pending,
            lag=lambda: writer.lag,
            failed=lambda: writer.stats.events_failed,
            healthy=lambda: sum(e.healthy for e in engines.engines),
            sessions=lambda: registry.cached,
        )
        admission = Admission(
            max_in_flight=settings.admission_max_in_flight,
            max_queued=settings.admission_max_queued,
        )
        metrics.watch_admission(admission)
        await registry.replicas.start()  # before serving: a finish elsewhere must reach us
        forwarder = Forwarder(
            http,
            engines,
            writer,
            settings,
            metrics,
            turn_in_log=functools.partial(turn_in_log, store, registry.replicas),
            replica_id=replica_id,
            tracer=tracer,
        )
        registry.on_closed.append(forwarder.contexts.forget)
        if tracer is not None:
            registry.on_finished.append(tracer.session_finished)
        metrics.contexts_held.set_function(lambda: forwarder.contexts.held)
        app.state.proxy = ProxyState(
            settings=settings,
            store=store,
            registry=registry,
            forwarder=forwarder,
            engines=engines,
            metrics=metrics,
            public_url=public_url,
            admission=admission,
            reader=Reader(
                database_url,
                public_url,
                max_bytes=settings.reader_max_bytes,
                idle_timeout=settings.reader_idle_timeout,
            ),
        )
        watchdog = asyncio.create_task(_watch_event_loop(metrics), name="loop-watchdog")
        follower = asyncio.create_task(registry.follow(), name="session-facts-follower")
        reaper = Reaper(
            store,
            registry,
            interval=settings.reap_interval,
            lost_after=settings.replica_lost_after,
            idle_timeout=settings.session_idle_timeout or None,
        )
        reaping = asyncio.create_task(reaper.run(), name="reaper")
        _dump_tasks_on_sigusr1()
        try:
            # Start-up objects frozen, young collections rarer: the collector's pauses were
            # the proxy's p99 (store.collector).
            with fewer_collections(freeze=True):
                yield
        finally:
            watchdog.cancel()
            follower.cancel()
            reaping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            with contextlib.suppress(asyncio.CancelledError):
                await reaping
            await engines.close()
            await app.state.proxy.reader.close()
            try:
                await writer.close()  # everything recorded is made durable before we exit
            finally:
                await registry.replicas.close()  # listened until now: a finish may need us
                await http.close()
                await store.close()
                if tracer is not None:
                    await tracer.close()

    app = ProxyApp(settings.max_body_bytes, title="trajstore proxy", lifespan=lifespan)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    _install_error_handlers(app)
    _add_routes(app)
    return app


def _add_routes(app: FastAPI) -> None:
    add_session_routes(app)
    add_admin_routes(app)

    @app.get("/health")
    async def health(state: State) -> JSONResponse:
        healthy = [e.url for e in state.engines.engines if e.healthy]
        writer = state.registry.writer
        ok = bool(healthy) and not writer.saturated
        body = {
            "status": "ok" if ok else "degraded",
            "engines_healthy": len(healthy),
            "engines": len(state.engines.engines),
            "writer_pending": writer.pending,
            "writer_lag_s": writer.lag,
        }
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(state: State) -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.websocket("/engines/connect")
    async def relay_dials_in(websocket: WebSocket) -> None:
        state: ProxyState = websocket.app.state.proxy
        await accept_relay(
            websocket,
            state.engines,
            admin_key=state.settings.api_key,
            relay_tokens=state.settings.relay_tokens,
        )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ProxyError)
    async def proxy_error(request: Request, exc: ProxyError) -> Response:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(StoreError)
    async def store_error(request: Request, exc: StoreError) -> Response:
        return await proxy_error(request, from_store_error(exc))


async def _watch_event_loop(metrics: ProxyMetrics, interval: float = 0.25) -> None:
    """Measure how late the loop wakes us; a stall means something blocks it."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await asyncio.sleep(interval)
        lag = loop.time() - started - interval
        metrics.loop_lag.set(lag)
        if lag > 0.5:
            log.warning("the event loop stalled for %.2fs (something blocked it)", lag)


def _dump_tasks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` logs the stack of every asyncio task, to see where things hang."""

    def dump() -> None:
        tasks = asyncio.all_tasks()
        log.warning("SIGUSR1: %d asyncio tasks (pid %d)", len(tasks), os.getpid())
        for task in tasks:
            task.print_stack(file=sys.stderr)

    with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
