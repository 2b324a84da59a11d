"""Fixtures for the viewer: the app on a test database, an HTTP client, recorded data."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import free_port
from tests.store.views_data import record_all
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.viewer import ViewerSettings, create_app, open_read_only
from trajstore.viewer.serving import served


@pytest.fixture
async def recorded(store: EventStore) -> EventStore:
    """The hand-checkable sessions of tests/store/views_data.py, projected."""
    await record_all(store)
    await Projector(store).run_once()
    return store


@pytest.fixture
async def client(database_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """An HTTP client talking to the viewer app (started, so connected read-only)."""
    app = create_app(database_url, ViewerSettings(poll_interval=0.1))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://viewer") as http:
            yield http


@pytest.fixture
async def viewer_store(database_url: str) -> AsyncIterator[EventStore]:
    """A store opened as the viewer opens it: read-only connections."""
    store = await open_read_only(database_url)
    try:
        yield store
    finally:
        await store.close()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The generated tiny model (its tokenizer gives the strips text), built once."""
    from trajstore.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("viewer") / "tiny-model")


@pytest.fixture
async def serve_viewer(database_url: str) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Serve the viewer on a real port (what a browser or an event stream needs); its URL."""
    stack = contextlib.AsyncExitStack()

    async def start(**settings: Any) -> str:
        chosen = ViewerSettings(port=free_port(), **{"poll_interval": 0.2, **settings})
        return await stack.enter_async_context(served(database_url, chosen))

    async with stack:
        yield start
