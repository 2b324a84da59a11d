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
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

import aiohttp
from fastapi import Depends, FastAPI, Header, Path, Query, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field
from starlette.types import Receive, Scope, Send

from trajstore.proxy.admission import Admission, RateLimit
from trajstore.proxy.auth import admin_key_is_valid, require_orchestrator_key, require_session_key
from trajstore.proxy.engines import EnginePool
from trajstore.proxy.errors import (
    Conflict,
    NotFound,
    Overloaded,
    ProxyError,
    Unauthorized,
    from_store_error,
)
from trajstore.proxy.forwarding import Forwarder
from trajstore.proxy.lineages import turn_in_log
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.model_calls import BodyLimit, ModelCalls
from trajstore.proxy.reads import Reader
from trajstore.proxy.reaper import Reaper
from trajstore.proxy.relay_channel import accept_relay
from trajstore.proxy.replicas import connection_name, new_replica_id
from trajstore.proxy.sessions import CreateSession, Discard, Finish, Reward, SessionRegistry
from trajstore.proxy.settings import ProxySettings
from trajstore.proxy.switching import SwitchConflict, UnknownSwitch
from trajstore.proxy.tracing import start_tracing
from trajstore.proxy.transport import TransportError
from trajstore.store import EventStore, StoreError
from trajstore.store.collector import fewer_collections

log = logging.getLogger(__name__)


@dataclass
class ProxyState:
    """Everything a request handler needs, built at startup."""

    settings: ProxySettings
    store: EventStore
    registry: SessionRegistry
    forwarder: Forwarder
    engines: EnginePool
    metrics: ProxyMetrics
    public_url: str
    admission: Admission
    reader: Reader


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


# -- dependencies ------------------------------------------------------------------------------


async def _state(request: Request) -> ProxyState:
    # async on purpose: FastAPI runs a plain `def` dependency in a thread pool, per request.
    state: ProxyState = request.app.state.proxy
    return state


State = Annotated[ProxyState, Depends(_state)]
Authorization = Annotated[str | None, Header()]


def _require_admin(state: ProxyState, authorization: str | None) -> None:
    if not admin_key_is_valid(state.settings.api_key, authorization):
        raise Unauthorized("this call needs the proxy's API key (TRAJSTORE_API_KEY) as Bearer")


def _require_session_key(
    state: ProxyState, session_id: str, authorization: str | None, *, model_call: bool = False
) -> None:
    require_session_key(
        state.registry, state.settings.api_key, session_id, authorization, model_call=model_call
    )


def _require_orchestrator_key(
    state: ProxyState, session_id: str, authorization: str | None
) -> None:
    require_orchestrator_key(state.registry, state.settings.api_key, session_id, authorization)


async def _read(
    state: ProxyState,
    session_id: str,
    authorization: str | None,
    under: str,
    params: dict[str, str] | None = None,
) -> Response:
    """A session read: checked and flushed here, answered by the reader process (`proxy.reads`),
    passed on a chunk at a time; its status and errors as the reader gives them."""
    _require_session_key(state, session_id, authorization)
    await state.registry.get(session_id)
    await state.registry.writer.flush()  # show what this replica recorded so far
    path = f"/sessions/{urllib.parse.quote(session_id, safe='')}{under}"
    answer = await state.reader.get(path, params or {})
    if answer.status != 200:
        try:
            body = await answer.read()
        finally:
            answer.release()
        return Response(body, status_code=answer.status, media_type="application/json")
    return StreamingResponse(state.reader.relay(answer), media_type="application/json")


# -- routes ------------------------------------------------------------------------------------


class SessionCreated(BaseModel):
    """What `POST /sessions` returns: where the agent points its client.

    OpenAI clients take `base_url` (`OPENAI_BASE_URL`), which ends in /v1; the Anthropic SDK and
    Claude-Code-style CLIs take `anthropic_base_url` (`ANTHROPIC_BASE_URL`), to which they add
    /v1/messages themselves. The same `api_key` serves both, and only calls models: the
    caller keeps `orchestrator_key`, which rewards, finishes and discards (`proxy.auth`).
    """

    session_id: str
    base_url: str
    anthropic_base_url: str
    api_key: str
    orchestrator_key: str
    run_id: str


class PolicyVersion(BaseModel):
    """`POST /admin/engines/policy-version`: after a weight sync."""

    version: str = Field(min_length=1)
    engine: str | None = None  # all engines when omitted


class SwitchBegin(BaseModel):
    """`POST /admin/switches`: engines are about to load the weights of policy `version`."""

    version: str = Field(min_length=1)
    engines: list[str] | None = None  #: their URLs; all engines when omitted
    checkpoint: str | None = None  #: where the weights are, for the record


class SwitchFailed(BaseModel):
    """`POST /admin/switches/{id}/failed`: the weights did not load."""

    reason: str = Field(min_length=1)


def _add_switch_routes(app: FastAPI) -> None:
    """Weight switches without a drain (`proxy.switching`): began, live, failed."""

    @app.get("/admin/switches")
    async def list_switches(state: State, authorization: Authorization = None) -> list[Any]:
        _require_admin(state, authorization)
        return state.forwarder.switches.describe()

    @app.post("/admin/switches", status_code=201)
    async def begin_switch(
        body: SwitchBegin, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        try:
            switch = await state.forwarder.switches.begin(
                body.version, body.engines, body.checkpoint, state.settings.switch_cut_timeout
            )
        except KeyError as exc:
            raise NotFound(f"no engine {exc}; see GET /admin/engines") from None
        except SwitchConflict as exc:
            raise Conflict(str(exc)) from None
        return switch.describe()

    @app.post("/admin/switches/{switch_id}/live")
    async def switch_live(
        switch_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        try:
            return (await state.forwarder.switches.live(switch_id)).describe()
        except UnknownSwitch as exc:
            raise NotFound(str(exc)) from None

    @app.post("/admin/switches/{switch_id}/failed")
    async def switch_failed(
        switch_id: str, body: SwitchFailed, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        try:
            return (await state.forwarder.switches.failed(switch_id, body.reason)).describe()
        except UnknownSwitch as exc:
            raise NotFound(str(exc)) from None


def _add_routes(app: FastAPI) -> None:
    _add_switch_routes(app)

    @app.post("/sessions", status_code=201, response_model=SessionCreated)
    async def create_session(
        body: CreateSession, state: State, response: Response, authorization: Authorization = None
    ) -> SessionCreated:
        _require_admin(state, authorization)
        session_id = body.session_id or secrets.token_hex(12)
        session, created = await state.registry.create(body, session_id)
        state.admission.offer(session.run_id, session.rate_limit, session.created_at)
        if not created:
            response.status_code = 200
        return SessionCreated(
            session_id=session.session_id,
            base_url=f"{state.public_url}/sessions/{session.session_id}/v1",
            anthropic_base_url=f"{state.public_url}/sessions/{session.session_id}",
            api_key=state.registry.key_for(session.session_id),
            orchestrator_key=state.registry.orchestrator_key_for(session.session_id),
            run_id=session.run_id,
        )

    @app.get("/sessions/{session_id}")
    async def get_session(
        session_id: str,
        state: State,
        authorization: Authorization = None,
        turn: Annotated[int | None, Query(ge=0, description="A turn to give whole")] = None,
        after: Annotated[int, Query(ge=-1, description="Start after this turn")] = -1,
        limit: Annotated[int | None, Query(ge=1, description="Turns in this page")] = None,
    ) -> Response:
        """The session as recorded, streamed: each turn with what it added to the turn it
        continues (`prompt_added` after `prompt_prefix`, `messages` after `messages_prefix`, as
        the log stores them: the answer grows with the session, not its square) and its
        `lineage` and `branch`; with `after` and `limit`, a page of turns and `next`, the URL of
        the page after it; with `turn`, that turn also whole (`prompt_token_ids`, all its
        `messages`) when the page holds it. See `store.pages`."""
        params = {"after": str(after)}
        if turn is not None:
            params["turn"] = str(turn)
        if limit is not None:
            params["limit"] = str(limit)
        return await _read(state, session_id, authorization, "", params)

    @app.get("/sessions/{session_id}/turns/{n}")
    async def get_turn(
        session_id: str,
        n: Annotated[int, Path(ge=0, description="The turn's index in the session")],
        state: State,
        authorization: Authorization = None,
    ) -> Response:
        """One turn whole: the turn as a page shows it (`index`, `lineage`, `branch`, its tools
        in full) with its whole `prompt_token_ids` and all its `messages`, without the rest of
        the page. The same key as the session's read."""
        return await _read(state, session_id, authorization, f"/turns/{n}")

    @app.post("/sessions/{session_id}/reward")
    async def reward(
        session_id: str, body: Reward, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_orchestrator_key(state, session_id, authorization)
        await state.registry.reward(session_id, body)
        return {"session_id": session_id, "reward": body.value}

    @app.post("/sessions/{session_id}/finish")
    async def finish(
        session_id: str, body: Finish, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_orchestrator_key(state, session_id, authorization)
        session = await state.registry.finish(session_id, body)
        if state.forwarder.tracer is not None:
            state.forwarder.tracer.session_finished(session, session.status)
        return {"session_id": session_id, "status": session.status}

    @app.post("/sessions/{session_id}/discard")
    async def discard(
        session_id: str, body: Discard, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_orchestrator_key(state, session_id, authorization)
        await state.registry.discard(session_id, body)
        return {"session_id": session_id, "discarded": body.reason}

    async def models(state: ProxyState) -> Response:
        engines = state.engines.engines
        engine = next((e for e in engines if e.healthy), engines[0] if engines else None)
        if engine is None:
            raise Overloaded("no engine yet: name one, or connect a relay")
        try:
            answer = await engine.connection().send(
                "GET", "/v1/models", None, {}, timeout=state.settings.request_timeout
            )
            return Response(await answer.read(), status_code=answer.status,
                            media_type="application/json")  # fmt: skip
        except (TransportError, TimeoutError) as exc:
            raise Overloaded(f"the engine at {engine.url} cannot be reached: {exc}") from None

    @app.get("/sessions/{session_id}/v1/models")
    async def session_models(
        session_id: str, state: State, authorization: Authorization = None
    ) -> Response:
        _require_session_key(state, session_id, authorization, model_call=True)
        return await models(state)

    @app.get("/v1/models")
    async def header_models(state: State) -> Response:
        return await models(state)

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

    @app.get("/admin/engines")
    async def list_engines(state: State, authorization: Authorization = None) -> list[Any]:
        _require_admin(state, authorization)
        return state.engines.describe()

    @app.post("/admin/engines/policy-version")
    async def set_policy_version(
        body: PolicyVersion, state: State, authorization: Authorization = None
    ) -> list[Any]:
        _require_admin(state, authorization)
        urls = [body.engine] if body.engine else [e.url for e in state.engines.engines]
        try:
            return [state.engines.set_policy_version(url, body.version).describe() for url in urls]
        except KeyError:
            raise NotFound(f"no engine {body.engine!r}; see GET /admin/engines") from None

    @app.websocket("/engines/connect")
    async def relay_dials_in(websocket: WebSocket) -> None:
        state: ProxyState = websocket.app.state.proxy
        await accept_relay(
            websocket,
            state.engines,
            admin_key=state.settings.api_key,
            relay_tokens=state.settings.relay_tokens,
        )

    # A run's limits live in this replica's memory (`proxy.admission`): with N replicas, call
    # each with its share. The admin's limits hold over those sessions ask for, until DELETE.
    @app.get("/admin/runs/{run_id}/limits")
    async def run_limits(
        run_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        return state.admission.describe(run_id)

    @app.put("/admin/runs/{run_id}/limits")
    async def set_run_limits(
        run_id: str, body: RateLimit, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        state.admission.set_limits(run_id, body)
        return state.admission.describe(run_id)

    @app.delete("/admin/runs/{run_id}/limits")
    async def clear_run_limits(
        run_id: str, state: State, authorization: Authorization = None
    ) -> dict[str, Any]:
        _require_admin(state, authorization)
        state.admission.set_limits(run_id, None)
        return state.admission.describe(run_id)


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
