"""The proxy's side of a relay: the engine behind one dialled-in WebSocket, as a `Transport`.

`accept_relay` serves `/engines/connect`: it checks the token, reads the relay's `hello`, adds
its engine to the pool (`relay://<name>`) and reads frames until the socket drops; then the pool
stops routing to the engine and every request still open on the socket fails
(`proxy.relay_protocol` draws the frames). `RelayChannel.send` is what forwarding calls, exactly
as it calls the HTTP transport. Each request's queue holds at most the channel's window: the
relay sends no more until the agent takes chunks and the channel grants it `credit`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from trajstore.proxy import relay_protocol as rp
from trajstore.proxy.engines import EnginePool
from trajstore.proxy.transport import AnswerBroken, EngineUnreachable, TransportError

log = logging.getLogger(__name__)

_END = object()  # queued after an answer's last chunk


def relay_token_is_valid(
    admin_key: str | None, relay_tokens: Sequence[str], presented: str | None
) -> bool:
    """Whether a relay presenting `presented` may dial in: the admin key or a relay token, or
    anything on an open proxy (no admin key, no relay tokens: a trusted network)."""
    if admin_key is None and not relay_tokens:
        return True
    if presented is None:
        return False
    accepted = [admin_key, *relay_tokens] if admin_key is not None else list(relay_tokens)
    # Every token is compared, so the time taken does not tell which one nearly matched.
    matches = [hmac.compare_digest(presented.encode(), t.encode()) for t in accepted]
    return any(matches)


class RelayAnswer:
    """The answer to one request sent over a relay, fed by the channel's reader."""

    def __init__(self, channel: RelayChannel, request_id: int, timeout: float) -> None:
        self.channel = channel
        self.id = request_id
        self.timeout = timeout
        self.status = 0
        self.headers: Mapping[str, str] = {}
        self.head: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.done = False
        self.buffered = 0  # bytes queued that the agent has not taken
        self.taken = 0  # bytes taken that the relay has not been granted again yet

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as the relay sends it; see `Answer.chunks`."""
        queue = self.queue
        while True:
            if queue.empty():  # a timer only when there is something to wait for
                try:
                    async with asyncio.timeout(self.timeout):
                        item = await queue.get()
                except TimeoutError:
                    self.close()
                    raise
            else:
                item = queue.get_nowait()
            if item is _END:
                return
            if isinstance(item, TransportError):
                raise item
            self.channel.taken(self, len(item))
            yield item

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Stop the request: the relay cancels its engine request."""
        if not self.done:
            self.done = True
            self.channel.cancel(self.id)

    # -- fed by the channel ---------------------------------------------------------------------

    def on_data(self, chunk: bytes) -> None:
        self.buffered += len(chunk)
        self.queue.put_nowait(chunk)

    def on_head(self, status: int, headers: Mapping[str, str]) -> None:
        self.status, self.headers = status, headers
        if not self.head.done():
            self.head.set_result(None)

    def on_end(self) -> None:
        self.done = True
        self.queue.put_nowait(_END)

    def on_error(self, message: str) -> None:
        self.done = True
        if not self.head.done():
            self.head.set_exception(EngineUnreachable(message))
        else:
            self.queue.put_nowait(AnswerBroken(message))


class RelayChannel:
    """One relay's WebSocket, as the transport of its engine: requests multiplexed by id."""

    kind = "relay"
    window = rp.WINDOW  #: bytes a request may have queued; granted to the relay at welcome

    def __init__(self, websocket: WebSocket, name: str, engine: str) -> None:
        self.websocket = websocket
        self.name = name
        self.engine = engine  # the engine's URL as the relay sees it (for the admin API)
        self.url = rp.engine_url(name)
        self.open = True
        self.connected_at = time.time()
        self.error: str | None = None  # the relay's last report of its engine's health
        self.reported_at = self.connected_at
        self._answers: dict[int, RelayAnswer] = {}
        self._ids = itertools.count(1)
        self._sending = asyncio.Lock()  # one frame at a time on the socket
        self._unsent: set[asyncio.Task[None]] = set()  # cancel and credit frames on their way
        self.peak_buffered = 0  # the most bytes one request had queued, since the relay dialled

    # -- Transport ------------------------------------------------------------------------------

    async def send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: float,
        stream: bool = False,
    ) -> RelayAnswer:
        """Send a request over the socket; return once its head is in (see `Transport.send`)."""
        if not self.open:
            raise EngineUnreachable(f"the relay {self.url} disconnected")
        request_id = next(self._ids) & rp.MAX_ID
        answer = RelayAnswer(self, request_id, timeout)
        self._answers[request_id] = answer
        text = None if body is None else body.decode()
        frame = rp.control(rp.OPEN, id=request_id, method=method, path=path,
                           headers=dict(headers), body=text)  # fmt: skip
        try:
            await self._send(frame)
            async with asyncio.timeout(timeout):
                await answer.head
        except BaseException:
            answer.close()
            raise
        return answer

    async def health(self, timeout: float) -> str | None:
        """The socket is open and the relay's last check of its engine succeeded."""
        if not self.open:
            return f"the relay {self.url} disconnected"
        return self.error

    def describe(self) -> dict[str, object]:
        """The relay's socket and what it last reported."""
        return {
            "transport": self.kind,
            "relay": {
                "engine": self.engine,
                "connected": self.open,
                "connected_at": self.connected_at,
                "reported_at": self.reported_at,
                "open_requests": len(self._answers),
                "buffered_bytes": sum(a.buffered for a in self._answers.values()),
                "peak_buffered_bytes": self.peak_buffered,
                "window_bytes": self.window,
            },
        }

    # -- the socket -----------------------------------------------------------------------------

    def cancel(self, request_id: int) -> None:
        """Forget a request and tell the relay to stop it (without waiting for the socket)."""
        if self._answers.pop(request_id, None) is not None:
            self._send_soon(rp.control(rp.CANCEL, id=request_id))

    def taken(self, answer: RelayAnswer, size: int) -> None:
        """The agent took `size` bytes of `answer`: grant them to the relay again, a quarter of
        the window at a time (a frame per chunk would double the frames of a stream)."""
        answer.buffered -= size
        answer.taken += size
        if answer.taken >= self.window // 4 and self._answers.get(answer.id) is answer:
            self._send_soon(rp.control(rp.CREDIT, id=answer.id, bytes=answer.taken))
            answer.taken = 0

    def _send_soon(self, text: str) -> None:
        """Send a frame without waiting for the socket (the reader and the agent must not)."""
        if not self.open:
            return
        task = asyncio.ensure_future(self._send(text))
        self._unsent.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._unsent.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("relay %s: a frame was not sent: %s", self.url, task.exception())

    async def _send(self, text: str) -> None:
        try:
            async with self._sending:
                await self.websocket.send_text(text)
        except (WebSocketDisconnect, RuntimeError, OSError) as exc:
            raise EngineUnreachable(f"the relay {self.url} disconnected: {exc}") from None

    async def serve(self, pool: EnginePool) -> None:
        """Read the relay's frames until its socket drops."""
        try:
            while True:
                message = await self.websocket.receive()
                if message["type"] == "websocket.disconnect":
                    return
                if message.get("bytes") is not None:
                    request_id, chunk = rp.parse_data(message["bytes"])
                    answer = self._answers.get(request_id)
                    if answer is not None:
                        answer.on_data(chunk)
                        self.peak_buffered = max(self.peak_buffered, answer.buffered)
                        if answer.buffered > self.window:
                            raise rp.ProtocolError(f"request {request_id} overran its window")
                elif message.get("text") is not None:
                    self._control(pool, rp.parse_control(message["text"]))
        finally:
            self.lost(f"the relay {self.url} disconnected")

    def _control(self, pool: EnginePool, frame: dict[str, Any]) -> None:
        kind = frame["type"]
        if kind == rp.HEALTH:
            self.error = None if frame.get("healthy") else str(frame.get("error") or "unhealthy")
            self.reported_at = time.time()
            engine = pool.get(self.url)
            if engine.transport is self:
                pool.record_health(engine, self.error)
            return
        answer = self._answers.get(frame.get("id"))  # type: ignore[arg-type]
        if answer is None:
            return  # a request cancelled meanwhile
        if kind == rp.HEAD:
            answer.on_head(int(frame["status"]), frame.get("headers") or {})
        elif kind == rp.END:
            self._answers.pop(answer.id, None)
            answer.on_end()
        elif kind == rp.ERROR:
            self._answers.pop(answer.id, None)
            answer.on_error(f"the relay {self.url}: {frame.get('message')}")
        else:
            raise rp.ProtocolError(f"a relay does not send {kind!r} frames")

    def lost(self, message: str) -> None:
        """The socket is gone: every open request fails."""
        self.open = False
        answers, self._answers = self._answers, {}
        for answer in answers.values():
            answer.on_error(message)


async def accept_relay(
    websocket: WebSocket,
    pool: EnginePool,
    *,
    admin_key: str | None,
    relay_tokens: Sequence[str],
    hello_timeout: float = 10.0,
) -> None:
    """Serve one relay on `/engines/connect` until its socket drops."""
    authorization = websocket.headers.get("authorization") or ""
    presented = authorization[7:].strip() if authorization[:7].lower() == "bearer " else None
    if not relay_token_is_valid(admin_key, relay_tokens, presented):
        # Before accept: the relay's handshake fails with 403, which it reports and stops.
        log.warning("a relay from %s presented a wrong token", websocket.client)
        await websocket.close(code=1008)
        return
    await websocket.accept()
    try:
        async with asyncio.timeout(hello_timeout):
            hello = rp.parse_control(await websocket.receive_text())
        if hello["type"] != rp.HELLO:
            raise rp.ProtocolError(f"the first frame must be hello, not {hello['type']!r}")
        if int(hello.get("protocol", 1)) != rp.VERSION:
            raise rp.ProtocolError(
                f"this proxy speaks relay protocol {rp.VERSION} only (with flow control), not "
                f"{hello.get('protocol', 1)}: run the same trajstore version as the proxy"
            )
        channel = RelayChannel(websocket, str(hello["name"]), str(hello.get("engine")))
    except (rp.ProtocolError, TimeoutError, WebSocketDisconnect, KeyError, ValueError) as exc:
        log.warning("a relay from %s was refused: %s", websocket.client, exc)
        with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
            await websocket.close(code=1002, reason=str(exc)[:120])
        return
    channel.error = None if hello.get("healthy") else str(hello.get("error") or "unhealthy")
    engine = pool.attach(channel.url, channel, channel.error)
    log.info("relay %s connected from %s (engine %s)", channel.url, websocket.client,
             channel.engine)  # fmt: skip
    try:
        await channel._send(rp.control(rp.WELCOME, url=channel.url, window=channel.window))
        await channel.serve(pool)
    except (rp.ProtocolError, TransportError, WebSocketDisconnect) as exc:
        log.warning("relay %s: %s", channel.url, exc)
    finally:
        channel.lost(f"the relay {channel.url} disconnected")
        pool.detach(engine, channel, f"the relay {channel.url} disconnected")
        log.info("relay %s disconnected", channel.url)
        with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):
            await websocket.close()
