"""Live subscriptions: catch up on the log, then follow new events as they commit.

`Subscription` delivers every event. `wake_ups` only says when to look again, for readers that
run their own query (the projector and the proxy replicas, on the session-facts channel).

A subscription owns one connection. It reads in global order (tx_id, position) below the
oldest transaction still in flight, so it never skips a transaction that commits late. NOTIFY is
only a wake-up: notifications can be lost (a dropped connection, a reconnect), so a timed poll is
the source of truth, and every (re)connect starts with a catch-up read from the checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator

import asyncpg

from trajstore.store import queries
from trajstore.store.connection import RETRYABLE_ERRORS, close_quietly, connect
from trajstore.store.errors import StoreUnavailable
from trajstore.store.events import RecordedEvent
from trajstore.store.schema import NOTIFY_CHANNEL

log = logging.getLogger(__name__)

APPLICATION_NAME = "trajstore-subscription"


class Subscription:
    """An async iterator over every event after a position, catching up and then live.

    `poll_interval` bounds how late a live event can be when a notification is lost;
    `batch_size` is how many events one read fetches; after a lost connection it reconnects
    with backoff, up to `reconnect_timeout` seconds before it raises `StoreUnavailable`.
    `position` is the position of the last event delivered: store it as your checkpoint.
    """

    def __init__(
        self,
        url: str,
        *,
        after: int = 0,
        poll_interval: float = 1.0,
        batch_size: int = 1000,
        reconnect_timeout: float = 60.0,
    ) -> None:
        self.url = url
        self.position = after
        self.poll_interval = poll_interval
        self.batch_size = batch_size
        self.reconnect_timeout = reconnect_timeout
        self.reconnects = 0
        self._tx_id: int | None = None  # of the event at self.position, resolved once
        self._wake = asyncio.Event()
        self._conn: asyncpg.Connection | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[RecordedEvent]:
        return self._events()

    async def close(self) -> None:
        """Stop the subscription and close its connection."""
        self._closed = True
        self._wake.set()
        if self._conn is not None and not self._conn.is_closed():
            await self._conn.close()

    async def _events(self) -> AsyncIterator[RecordedEvent]:
        failing_since: float | None = None
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                await self._connect()
                failing_since = None
                async for event in self._follow():
                    yield event
            except RETRYABLE_ERRORS as exc:
                if self._closed:
                    break
                now = loop.time()
                failing_since = failing_since or now
                if now - failing_since > self.reconnect_timeout:
                    raise StoreUnavailable(
                        f"subscription lost PostgreSQL for over {self.reconnect_timeout:.0f}s: "
                        f"{exc}"
                    ) from exc
                self.reconnects += 1
                log.warning("subscription lost its connection (%s); reconnecting", exc)
                await asyncio.sleep(min(2.0, 0.05 * 2 ** min(self.reconnects, 6)))
            finally:
                await self._drop_connection()

    async def _connect(self) -> None:
        self._conn = await connect(self.url, application_name=APPLICATION_NAME)
        # LISTEN before the catch-up read: an append committed in between still wakes us.
        await self._conn.add_listener(NOTIFY_CHANNEL, self._on_notify)
        if self._tx_id is None:
            self._tx_id = await queries.tx_id_of(self._conn, self.position)
        self._wake.set()  # catch up straight away after every (re)connect

    async def _follow(self) -> AsyncIterator[RecordedEvent]:
        conn = self._conn
        assert conn is not None
        while not self._closed:
            # A timeout is the poll: notifications are a hint, the read below is the truth.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.poll_interval)
            self._wake.clear()
            while True:
                rows = await conn.fetch(
                    queries.READ_ALL,
                    self._tx_id,
                    self.position,
                    self.batch_size,
                    record_class=RecordedEvent,
                )
                for event in rows:
                    self._tx_id, self.position = event.tx_id, event.position
                    yield event
                if len(rows) < self.batch_size:
                    break

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        await close_quietly(conn)


async def wake_ups(
    url: str, channel: str, *, poll_interval: float, application_name: str
) -> AsyncGenerator[None, None]:
    """Yield at once, then whenever `channel` is notified or `poll_interval` seconds pass.

    The caller reads what it needs at each step; the timed poll is the truth, a notification
    only makes it sooner. The LISTEN connection is the generator's own: lost, it is opened again
    at the next step (polling goes on meanwhile); it closes with the generator (use
    `contextlib.aclosing`, so that happens at once when the caller is cancelled).
    """
    wake = asyncio.Event()

    def on_notify(*_: object) -> None:
        wake.set()

    listener: asyncpg.Connection | None = None
    try:
        while True:
            if listener is None or listener.is_closed():
                await close_quietly(listener)
                listener = None
                try:
                    listener = await connect(url, application_name=application_name)
                    await listener.add_listener(channel, on_notify)
                except RETRYABLE_ERRORS as exc:
                    log.warning("%s cannot LISTEN (%s); polling", application_name, exc)
                    await close_quietly(listener)
                    listener = None
            wake.clear()  # a notification while the caller reads makes the next step immediate
            yield
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout=poll_interval)
    finally:
        await close_quietly(listener)
