"""The other proxy replicas serving the same store, and a session's events made durable on all of
them before it finishes.

`finish` answers only once every event of the session is durable. Each replica records through
its own batched writer, which lingers up to `TRAJSTORE_WRITER_LINGER` over a batch, and an agent
may send its turns to any replica; flushing the finishing replica's writer alone would let a turn
served elsewhere commit after `session_finished`, and the projector would build the session
without it. So the finishing replica asks every live replica to flush, and waits for each:

    finishing replica                        PostgreSQL                       each other replica
    flush its own writer
    who is live? ───────────────────▶ pg_stat_activity: each replica's LISTEN and
                                      writer connections, trajstore-proxy:<id>:<role>
    NOTIFY trajstore_flush {token, session, from} ───────────────▶ flush its writer, if it has
                                                                   served the session
              ◀──────────────────────────────── NOTIFY trajstore_flushed {token, replica, error}
    every live replica answered: append session_finished

Why this shape:
- Membership needs no table and no heartbeats: a replica is live while its LISTEN connection or
  its writer's connection is (the one that would commit what it holds), and PostgreSQL lists
  them in pg_stat_activity. A replica opens both before it serves anything, so one that connects
  after the finish asked cannot hold a turn of the session.
- Notifications can be lost (a listener reconnecting, a connection opened but not yet
  listening), so the request goes out again every `resend` seconds to the replicas that have not
  answered; flushing twice is harmless. A replica whose LISTEN connection dropped is still
  waited for while its writer is connected, and answers once it listens again.
- A replica that leaves pg_stat_activity while we wait (stopped, crashed, cut off) is not waited
  for: what its writer still held is lost with it, or commits once it is back, as with a single
  replica. One that stays and does not answer within `timeout` fails the finish with 503
  (retry it): finishing without its events would build a sample that misses turns. A replica
  whose writer could not store an event of the session answers so, and the finish fails with
  the reason, as it does for the finishing replica's own writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import orjson

from trajstore.proxy.errors import Overloaded
from trajstore.store import EventStore, EventWriter, StoreError, WriteFailed, queries
from trajstore.store.connection import (
    RETRYABLE_ERRORS,
    close_quietly,
    connect,
)

log = logging.getLogger(__name__)

#: A replica's connections are named this, its id, ":" and their role (`connection_name`).
APPLICATION_PREFIX = "trajstore-proxy:"
#: Requests to flush a session: {token, session, from}.
FLUSH_CHANNEL = "trajstore_flush"
#: Answers: {token, replica, error}; error is null when the session's events are durable.
FLUSHED_CHANNEL = "trajstore_flushed"


def new_replica_id() -> str:
    """A fresh id for a proxy process: 48 random bits, as hex."""
    return secrets.token_hex(6)


def connection_name(replica_id: str, role: str) -> str:
    """What one of a replica's connections is called in pg_stat_activity."""
    return f"{APPLICATION_PREFIX}{replica_id}:{role}"


@dataclass
class _Waiting:
    """A finish waiting for answers: replica id -> error (None: flushed)."""

    answers: dict[str, str | None] = field(default_factory=dict)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)


class Replicas:
    """This replica among those serving the same store (see the module docstring).

    `writer` is this replica's, its connection named `connection_name(replica_id, "writer")`.
    `served(session_id)` tells whether this replica may hold events of a session (it has served
    it); the others answer a flush request at once. `timeout`: how long `flush_everywhere` waits
    for the other replicas; `resend`: how often it asks again, and how often a lost LISTEN
    connection is reopened.
    """

    def __init__(
        self,
        store: EventStore,
        writer: EventWriter,
        served: Callable[[str], bool],
        *,
        replica_id: str,
        timeout: float = 30.0,
        resend: float = 1.0,
    ) -> None:
        self.store = store
        self.writer = writer
        self.served = served
        self.id = replica_id
        self.timeout = timeout
        self.resend = resend
        self._waiting: dict[str, _Waiting] = {}
        self._listener: asyncpg.Connection | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._answering: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Join: listen for the other replicas' requests. Call it before serving anything."""
        await self._listen()
        self._keeper = asyncio.create_task(self._keep_listening(), name="replica-listener")

    async def close(self) -> None:
        """Leave: stop listening and answering."""
        tasks = [t for t in (self._keeper, *self._answering) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        listener, self._listener = self._listener, None
        await close_quietly(listener)

    async def flush_everywhere(self, session_id: str) -> None:
        """Return once every live replica, this one included, has the session's events durable.

        Raises `WriteFailed` when a replica could not store one of them, and `Overloaded` (503)
        when a live replica does not answer within `timeout`.
        """
        await self.writer.flush(session_id=session_id)
        peers = await self._live_peers()
        if not peers:
            return
        token = secrets.token_hex(8)
        waiting = self._waiting[token] = _Waiting()
        request = orjson.dumps({"token": token, "session": session_id, "from": self.id}).decode()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        try:
            while True:
                await self._notify(FLUSH_CHANNEL, request)
                ask_again = min(deadline, loop.time() + self.resend)
                while (peers - waiting.answers.keys()) and (left := ask_again - loop.time()) > 0:
                    waiting.arrived.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiting.arrived.wait(), left)
                failed = {r: e for r, e in waiting.answers.items() if e is not None}
                if failed:
                    replica, error = sorted(failed.items())[0]
                    raise WriteFailed(f"replica {replica} could not store them: {error}")
                peers &= (await self._live_peers()) | set(waiting.answers)  # gone: not waited for
                missing = peers - waiting.answers.keys()
                if not missing:
                    return
                if loop.time() >= deadline:
                    raise Overloaded(
                        f"replica(s) {', '.join(sorted(missing))} did not confirm within "
                        f"{self.timeout:g}s that they stored this session's events; the session "
                        "is not finished: retry the finish",
                        retry_after=self.resend,
                    )
                log.info("finish of %s waits for replica(s) %s", session_id, sorted(missing))
        finally:
            del self._waiting[token]

    # -- membership and messages ------------------------------------------------------------------

    async def live(self) -> set[str]:
        """The ids of the replicas connected now, this one included (`proxy.reaper`)."""
        return await self._live_peers() | {self.id}

    async def _live_peers(self) -> set[str]:
        rows = await self.store.fetch(queries.CLIENTS_NAMED, APPLICATION_PREFIX)
        names = (row["application_name"].removeprefix(APPLICATION_PREFIX) for row in rows)
        return {name.partition(":")[0] for name in names} - {self.id}

    async def _notify(self, channel: str, payload: str) -> None:
        await self.store.execute(queries.NOTIFY, channel, payload)

    async def _listen(self) -> None:
        conn = await connect(self.store.url, application_name=connection_name(self.id, "listener"))
        try:
            await conn.add_listener(FLUSH_CHANNEL, self._on_request)
            await conn.add_listener(FLUSHED_CHANNEL, self._on_answer)
        except BaseException:
            await close_quietly(conn)
            raise
        self._listener = conn

    async def _keep_listening(self) -> None:
        """Reopen the LISTEN connection when it is lost (meanwhile a finish elsewhere waits for
        us while our writer is connected, asking again until we answer)."""
        while True:
            await asyncio.sleep(self.resend)
            if self._listener is not None and not self._listener.is_closed():
                continue
            await close_quietly(self._listener)
            self._listener = None
            try:
                await self._listen()
            except RETRYABLE_ERRORS as exc:
                log.warning("replica %s cannot LISTEN (%s); retrying", self.id, exc)

    def _on_request(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        message = _message(payload, ("token", "session", "from"))
        if message is None or message["from"] == self.id:
            return
        task = asyncio.create_task(self._answer(message["session"], message["token"]))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def _answer(self, session_id: str, token: str) -> None:
        error = None
        if self.served(session_id):
            try:
                await self.writer.flush(session_id=session_id)
            except StoreError as exc:
                error = str(exc)
        answer = orjson.dumps({"token": token, "replica": self.id, "error": error}).decode()
        try:
            await self._notify(FLUSHED_CHANNEL, answer)
        except StoreError as exc:  # the finishing replica asks again
            log.warning("replica %s cannot answer a flush request: %s", self.id, exc)

    def _on_answer(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        message = _message(payload, ("token", "replica", "error"))
        waiting = None if message is None else self._waiting.get(message["token"])
        if message is not None and waiting is not None:
            waiting.answers[message["replica"]] = message["error"]
            waiting.arrived.set()


def _message(payload: str, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """A notification's JSON object if it has `keys`; None (and a log line) otherwise."""
    try:
        message = orjson.loads(payload)
    except orjson.JSONDecodeError:
        message = None
    if not isinstance(message, dict) or not all(key in message for key in keys):
        log.warning("ignoring a malformed replica message: %.200r", payload)
        return None
    return message
