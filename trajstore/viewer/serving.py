"""The viewer served by uvicorn: as a command of its own (`trajstore ui`), or inside the
event loop of `trajstore up` and `trajstore demo --ui`, which handle the signals themselves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

import uvicorn

from trajstore.viewer.app import create_app
from trajstore.viewer.settings import ViewerSettings


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the caller owns the signals (see trajstore.stack)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def url_of(settings: ViewerSettings) -> str:
    """Where people open the viewer."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


@contextlib.asynccontextmanager
async def served(database_url: str, settings: ViewerSettings) -> AsyncIterator[str]:
    """Serve the viewer in this event loop until the block ends; yields its URL."""
    config = uvicorn.Config(create_app(database_url, settings), host=settings.host,
                            port=settings.port, log_level="warning", access_log=False,
                            lifespan="on")  # fmt: skip
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    # uvicorn offers a `started` flag, no event to await.
    while not server.started and not task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    if not server.started:
        await task  # raises what stopped it
        raise RuntimeError("the viewer did not start; see the errors above")
    try:
        yield url_of(settings)
    finally:
        server.should_exit = True
        await task
