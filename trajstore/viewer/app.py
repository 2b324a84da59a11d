"""The viewer's FastAPI app: read-only pages over the event log, one router per resource.

    runs.py       GET /, /runs/{run_id}
    sessions.py   GET /sessions/{id}, its turns, its live stream

Read-only twice over: only GET routes exist (anything else is 405), and every connection is
opened with `default_transaction_read_only`, so even a query that tried to write would be refused
by PostgreSQL. The viewer connects as the store's URL's user (the `trajstore_reader` role cannot
read the events table, which sessions are rebuilt from).

Errors become pages, never a traceback: no such run or session 404, a filter that cannot be read
400, a wrong method 405, PostgreSQL out of reach 503.
"""

from __future__ import annotations

import contextlib
import html
import logging
from collections.abc import AsyncIterator, Mapping

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from starlette.exceptions import HTTPException

from trajstore.store import queries as store_queries
from trajstore.store.connection import CONNECTION_ERRORS, asyncpg_dsn, init_connection
from trajstore.store.errors import SchemaNotReady, SessionNotFound, StoreUnavailable
from trajstore.store.eventstore import EventStore
from trajstore.viewer import filters, runs, sessions
from trajstore.viewer.cache import SessionCache
from trajstore.viewer.errors import ViewerError
from trajstore.viewer.settings import ViewerSettings
from trajstore.viewer.state import HERE, Viewer
from trajstore.viewer.tokens import TokenTexts

log = logging.getLogger(__name__)

#: Every connection of the viewer: nothing it runs can write.
READ_ONLY = {"default_transaction_read_only": "on", "application_name": "trajstore-viewer"}


async def open_read_only(url: str, *, max_size: int = 4) -> EventStore:
    """An `EventStore` whose connections refuse to write; `SchemaNotReady` when unmigrated."""
    try:
        pool = await asyncpg.create_pool(
            asyncpg_dsn(url), min_size=1, max_size=max_size, init=init_connection,
            server_settings=READ_ONLY,
        )  # fmt: skip
    except CONNECTION_ERRORS as exc:
        raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
    assert pool is not None
    if not await pool.fetchval(store_queries.SCHEMA_PRESENT):
        await pool.close()
        raise SchemaNotReady()
    return EventStore(pool, url)


def _root(request: Request) -> dict[str, str]:
    """Links start at the app's root, so the pages work mounted under a prefix too."""
    return {"root": str(request.scope.get("root_path", "")).rstrip("/")}


def templates() -> Jinja2Templates:
    """The pages' templates, with the filters they format numbers and times with."""
    found = Jinja2Templates(directory=str(HERE / "templates"), context_processors=[_root])
    found.env.filters.update(filters.ALL)
    return found


def create_app(database_url: str, settings: ViewerSettings | None = None) -> FastAPI:
    """The viewer on the store at `database_url`; it connects when it starts serving."""
    settings = settings or ViewerSettings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = await open_read_only(database_url)
        texts = TokenTexts(settings.tokenizer)
        app.state.viewer = Viewer(store, texts, templates(), SessionCache(), settings)
        try:
            yield
        finally:
            await texts.close()
            await store.close()

    app = FastAPI(title="trajstore viewer", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # fmt: skip
    app.mount("/static", StaticFiles(directory=str(HERE / "static")), name="static")
    app.include_router(runs.router)
    app.include_router(sessions.router)
    _error_pages(app)
    return app


def _error_page(request: Request, status: int, message: str,
                headers: Mapping[str, str] | None = None) -> Response:  # fmt: skip
    titles = {400: "Bad request", 404: "Not found", 405: "Method not allowed",
              503: "The store cannot be reached"}  # fmt: skip
    title = titles.get(status, "Error")
    context = {"request": request, "status": status, "title": title, "message": message}
    viewer: Viewer | None = getattr(request.app.state, "viewer", None)
    if viewer is None:  # before the app started: no templates to hand
        page = f"<h1>{status} {title}</h1><p>{html.escape(message)}</p>"
        return HTMLResponse(page, status, dict(headers or {}))
    return viewer.templates.TemplateResponse(request, "error.html", context, status_code=status,
                                             headers=dict(headers or {}))  # fmt: skip


def _error_pages(app: FastAPI) -> None:
    @app.exception_handler(ViewerError)
    async def viewer_error(request: Request, exc: ViewerError) -> Response:
        return _error_page(request, exc.status, str(exc))

    @app.exception_handler(SessionNotFound)
    async def not_found(request: Request, exc: SessionNotFound) -> Response:
        return _error_page(request, 404, str(exc))

    @app.exception_handler(StoreUnavailable)
    async def unavailable(request: Request, exc: StoreUnavailable) -> Response:
        log.warning("%s", exc)
        return _error_page(request, 503, str(exc), {"Retry-After": "5"})

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error_page(request, 400, problems)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        message = {404: f"there is no page at {request.url.path}",
                   405: "the viewer only reads: this page answers GET"}.get(
            exc.status_code, str(exc.detail))  # fmt: skip
        return _error_page(request, exc.status_code, message, exc.headers)
