"""The reader: a process of its own that answers the proxy's session reads (`proxy.reads`).

    python -m trajstore.proxy.reader --socket PATH [--idle 120]
        env: TRAJSTORE_DATABASE_URL (the proxy's), TRAJSTORE_READER_PUBLIC_URL (for `next`)

    GET /sessions/{id}[?turn=N][&after=K&limit=L]   a page of the session (`store.pages`)
    GET /sessions/{id}/turns/{n}                    one turn whole, as a page shows it
    GET /health

Reading a session means holding it: its events, then its rebuilt record and lineages, while the
answer is written (hundreds of MB for a session of thousands of agent turns), and CPython keeps
that high-water mark. Served inside the recording proxy, every read of a long session grew the
process that every agent depends on, and nothing gave the memory back (issue 43). Here it grows
this process instead, which the proxy recycles past a bound and which exits when idle: the
memory goes back to the operating system with it.

Pages in linear time: the last sessions rebuilt are kept with their lineages and the turn ->
(lineage, branch) map, stamped with how many events the session had. A page first counts the
session's events (an index-only count, milliseconds); when nothing was added it is served from
what is kept and costs its own turns, so a walk through every page of a session costs one
rebuild plus its pages, not a rebuild per page. A session still being recorded is rebuilt when a
page finds new events.

Authorization is the proxy's: it checks the session's key before it hands a read over, and this
process listens on a unix socket only the proxy's user can reach.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from trajstore.proxy.errors import BadRequest, NotFound, ProxyError
from trajstore.store import EventStore
from trajstore.store.collector import collections_paused, fewer_collections
from trajstore.store.lineages import Forest
from trajstore.store.pages import (
    Page,
    branches_of,
    rebuild_with_lineages,
    session_pieces,
    turn_view,
)
from trajstore.store.records import SessionRecord

#: Sessions kept rebuilt: a client walking one session's pages, and another's.
KEPT_SESSIONS = 2


@dataclass
class Rebuilt:
    """A session rebuilt for pages, and how many events it had then."""

    n_events: int
    record: SessionRecord
    forest: Forest
    placed: dict[int, tuple[int, int]]


class Sessions:
    """The last sessions rebuilt, reused while the log holds no new event of theirs."""

    def __init__(self, store: EventStore) -> None:
        self.store = store
        self._kept: OrderedDict[str, Rebuilt] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}

    async def get(self, session_id: str) -> Rebuilt:
        """The session as the log holds it now (rebuilt only when it has new events)."""
        lock = self._locks.setdefault(session_id, asyncio.Lock())
        try:
            async with lock:  # two pages of one session at once: one rebuild
                return await self._get(session_id)
        finally:
            if len(self._locks) > 64:  # one per session being read, not one per session ever
                self._locks = {k: v for k, v in self._locks.items() if v.locked()}

    async def _get(self, session_id: str) -> Rebuilt:
        n_events = await self.store.count_session_events(session_id)
        kept = self._kept.get(session_id)
        if kept is not None and kept.n_events == n_events:
            self._kept.move_to_end(session_id)
            return kept
        self._kept.pop(session_id, None)  # let the old one go before building the new
        del kept
        events = await self.store.read_session(session_id)
        if not events:
            raise NotFound(f"no session {session_id!r} in the log")
        # Off the event loop: other reads (a small session's page) go on meanwhile.
        rebuilt = await asyncio.to_thread(_rebuild, session_id, events)
        del events
        self._kept[session_id] = rebuilt
        while len(self._kept) > KEPT_SESSIONS:
            self._kept.popitem(last=False)
        return rebuilt


def _rebuild(session_id: str, events: list) -> Rebuilt:  # type: ignore[type-arg]
    # No collection while the session's objects are made, all of them alive until it ends: the
    # collector would walk them again and again (and the kept sessions' with them) for nothing.
    with collections_paused():
        record, forest = rebuild_with_lineages(session_id, events)
        return Rebuilt(len(events), record, forest, branches_of(forest))


def _error(exc: ProxyError) -> Response:
    return Response(orjson.dumps(exc.body()), exc.status, media_type="application/json")


def _int(request: Request, name: str, default: int | None, least: int) -> int | None:
    value = request.query_params.get(name)
    if value is None:
        return default
    number = int(value)
    if number < least:
        raise ValueError(name)
    return number


def create_app(database_url: str, public_url: str, idle_timeout: float) -> Starlette:
    """The reader's application: session pages and turns from the log, read-only."""
    state: dict[str, object] = {}
    activity = {"last": time.monotonic(), "in_flight": 0}

    async def session(request: Request) -> Response:
        sessions: Sessions = state["sessions"]  # type: ignore[assignment]
        session_id = request.path_params["session_id"]
        try:
            turn = _int(request, "turn", None, 0)
            after = _int(request, "after", -1, -1)
            limit = _int(request, "limit", None, 1)
        except ValueError as exc:
            return _error(BadRequest(f"query parameter {exc} out of range", param=str(exc)))
        try:
            rebuilt = await sessions.get(session_id)
        except ProxyError as exc:
            return _error(exc)
        n_turns = len(rebuilt.record.turns)
        if turn is not None and turn >= n_turns:
            return _error(NotFound(f"session {session_id!r} has {n_turns} turns"))
        assert after is not None
        page = Page(first=after + 1, limit=limit, whole=turn)
        next_url = None
        if limit is not None:
            last = page.end(n_turns) - 1
            next_url = f"{public_url}/sessions/{session_id}?after={last}&limit={limit}"
        pieces = session_pieces(rebuilt.record, page, next_url, rebuilt.forest, rebuilt.placed)
        # A sync iterator: Starlette writes it from a thread, a piece at a time.
        return StreamingResponse(pieces, media_type="application/json")

    async def one_turn(request: Request) -> Response:
        sessions: Sessions = state["sessions"]  # type: ignore[assignment]
        session_id = request.path_params["session_id"]
        index = int(request.path_params["n"])
        try:
            rebuilt = await sessions.get(session_id)
        except ProxyError as exc:
            return _error(exc)
        n_turns = len(rebuilt.record.turns)
        if index >= n_turns:
            return _error(NotFound(f"session {session_id!r} has {n_turns} turns"))
        view = await asyncio.to_thread(turn_view, rebuilt.record, index, rebuilt.placed, whole=True)
        return Response(orjson.dumps(view), media_type="application/json")

    async def health(request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    def counted(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            activity["in_flight"] += 1
            try:
                return await handler(request)
            finally:
                activity["in_flight"] -= 1
                activity["last"] = time.monotonic()

        return run

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with await EventStore.open(database_url) as store:
            state["sessions"] = Sessions(store)
            watch = asyncio.create_task(_exit_when_idle(activity, idle_timeout))
            try:
                # As the proxy does: young collections rarer, start-up objects frozen.
                with fewer_collections(freeze=True):
                    yield
            finally:
                watch.cancel()

    routes = [
        Route("/sessions/{session_id}", counted(session)),
        Route("/sessions/{session_id}/turns/{n:int}", counted(one_turn)),
        Route("/health", health),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _exit_when_idle(activity: dict[str, float], idle_timeout: float) -> None:
    """Exit (memory back to the system) when idle, or when the proxy that started us is gone."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(min(1.0, idle_timeout / 4))
        idle = not activity["in_flight"] and time.monotonic() - activity["last"] > idle_timeout
        if idle or os.getppid() != parent:
            os._exit(0)  # nothing of ours to flush: the reader only reads


def main() -> None:
    """Serve the reader on a unix socket until idle (`--idle` seconds) or told to stop."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--socket", required=True, help="unix socket to listen on")
    parser.add_argument("--idle", type=float, default=120.0, help="seconds idle before exiting")
    args = parser.parse_args()
    import uvicorn

    app = create_app(
        os.environ["TRAJSTORE_DATABASE_URL"],
        os.environ.get("TRAJSTORE_READER_PUBLIC_URL", ""),
        args.idle,
    )
    uvicorn.run(app, uds=args.socket, log_level="warning", lifespan="on", loop="uvloop")


if __name__ == "__main__":
    main()
