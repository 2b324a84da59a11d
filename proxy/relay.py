"""`trajstore relay`: run beside an engine the proxy cannot reach, and dial in to the proxy.

GPU nodes behind NAT or a firewall can reach the proxy but not be reached by it. The relay holds
one WebSocket to the proxy's `/engines/connect` and serves, over it, every request the proxy
routes to its engine (`proxy.relay_protocol` draws the frames): each `open` becomes a request to
the local engine with aiohttp, its answer goes back as it streams (no faster than the proxy's
`credit` for it allows), and a `cancel` closes that request, which makes vLLM stop generating.
Every few seconds the relay asks its engine's `/health` and reports the answer. When the socket
drops, the relay stops its requests (the proxy has failed them already) and dials again, with
backoff; a refused token, or a protocol the proxy does not speak, ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from typing import Any

import aiohttp

from trajstore.proxy import relay_protocol as rp

log = logging.getLogger(__name__)

WebSocket = aiohttp.ClientWebSocketResponse

# Hop-by-hop headers, and those aiohttp sets itself, are not passed between the two sides.
_DROPPED = frozenset({"connection", "content-length", "transfer-encoding", "keep-alive", "host"})


class RelayRefused(Exception):
    """The proxy refused this relay (a wrong token, or a protocol it does not speak)."""


class Credit:
    """How many more bytes of one request's answer the proxy takes now (see `relay_protocol`)."""

    def __init__(self, window: int) -> None:
        self.bytes = window
        self._granted = asyncio.Event()

    def grant(self, size: int) -> None:
        """The agent took `size` bytes: that many more may be sent."""
        self.bytes += size
        self._granted.set()

    async def take(self, most: int) -> int:
        """Wait until some bytes may be sent; spend and return up to `most` of them."""
        while self.bytes <= 0:
            self._granted.clear()
            await self._granted.wait()
        size = min(most, self.bytes)
        self.bytes -= size
        return size


def default_name(engine_url: str) -> str:
    """`<host name>-<engine port>`: unique per engine on a node, stable across restarts."""
    port = engine_url.rstrip("/").rsplit(":", 1)[-1].split("/")[0]
    host = socket.gethostname().split(".")[0] or "engine"
    name = f"{host}-{port}" if port.isdigit() else host
    return "".join(c if c.isalnum() or c in "._:-" else "-" for c in name)[:100]


class Relay:
    """One engine's relay: dials in to the proxy and serves the requests sent over the socket."""

    def __init__(
        self,
        proxy_url: str,
        engine_url: str,
        token: str | None,
        name: str | None = None,
        *,
        health_interval: float = 5.0,
        max_backoff: float = 10.0,
    ) -> None:
        self.proxy_url = proxy_url
        self.engine_url = engine_url.rstrip("/").removesuffix("/v1").rstrip("/")
        self.token = token
        self.name = name or default_name(self.engine_url)
        rp.engine_url(self.name)  # refuse a bad name before dialling
        self.health_interval = health_interval
        self.max_backoff = max_backoff
        self.connected = asyncio.Event()  # set while a socket is open (for tests and logs)
        self._requests: dict[int, asyncio.Task[None]] = {}
        self._credits: dict[int, Credit] = {}
        self._window = rp.WINDOW  # the proxy's, from its welcome

    async def run(self) -> None:
        """Dial in and serve until cancelled; dial again, with backoff, whenever the socket drops.
        Raise `RelayRefused` if the proxy refuses the token."""
        backoff = 0.25
        async with aiohttp.ClientSession(auto_decompress=False) as http:
            while True:
                served = await self._connect_and_serve(http)
                if served:
                    backoff = 0.25  # it was up: the next drop starts the backoff again
                # Jitter, so relays cut off together do not all dial at the same instant.
                delay = backoff * (0.5 + random.random())
                log.info("relay %s: dialling %s again in %.1fs", self.name, self.proxy_url, delay)
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, self.max_backoff)

    async def _connect_and_serve(self, http: aiohttp.ClientSession) -> bool:
        """One socket's life; whether it got as far as serving."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            ws = await http.ws_connect(
                rp.websocket_url(self.proxy_url), headers=headers, heartbeat=20.0,
                max_msg_size=0, autoping=True,
            )  # fmt: skip
        except aiohttp.WSServerHandshakeError as exc:
            if exc.status in (401, 403):
                raise RelayRefused(
                    f"the proxy at {self.proxy_url} refused the relay token (HTTP {exc.status})"
                ) from None
            log.warning("relay %s: the proxy refused the socket: %s", self.name, exc)
            return False
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.warning("relay %s: cannot reach the proxy at %s: %s", self.name, self.proxy_url,
                        exc)  # fmt: skip
            return False
        try:
            return await self._serve(http, ws)
        finally:
            self.connected.clear()
            for task in list(self._requests.values()):
                task.cancel()
            await asyncio.gather(*self._requests.values(), return_exceptions=True)
            self._requests.clear()
            self._credits.clear()
            await ws.close()

    async def _serve(self, http: aiohttp.ClientSession, ws: WebSocket) -> bool:
        error = await self._engine_health(http)
        hello = rp.control(rp.HELLO, name=self.name, engine=self.engine_url,
                           healthy=error is None, error=error, protocol=rp.VERSION)  # fmt: skip
        await ws.send_str(hello)
        welcome = await ws.receive()
        if welcome.type != aiohttp.WSMsgType.TEXT:
            if ws.close_code == 1002:  # a protocol error: dialling again would not help
                raise RelayRefused(f"the proxy at {self.proxy_url} refused the relay: "
                                   f"{welcome.extra}")  # fmt: skip
            reason = ws.close_code, welcome.extra
            log.warning("relay %s: the proxy closed the socket at hello: %s", self.name, reason)
            return False
        accepted = rp.parse_control(welcome.data)
        self._window = int(accepted["window"])
        log.info("relay %s: serving %s as %s", self.name, self.engine_url,
                 accepted.get("url"))  # fmt: skip
        self.connected.set()
        sending = asyncio.Lock()
        reporter = asyncio.create_task(self._report_health(http, ws, sending))
        try:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._control(http, ws, sending, rp.parse_control(message.data))
                elif message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.ERROR):
                    break
        except rp.ProtocolError as exc:
            log.error("relay %s: %s", self.name, exc)
        finally:
            reporter.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reporter
        log.warning("relay %s: the socket to %s dropped", self.name, self.proxy_url)
        return True

    def _control(
        self,
        http: aiohttp.ClientSession,
        ws: WebSocket,
        sending: asyncio.Lock,
        frame: dict[str, Any],
    ) -> None:
        kind, request_id = frame["type"], frame.get("id")
        if kind == rp.OPEN and isinstance(request_id, int):
            credit = self._credits[request_id] = Credit(self._window)
            task = asyncio.create_task(self._forward(http, ws, sending, credit, request_id, frame))
            self._requests[request_id] = task
            task.add_done_callback(lambda _: self._forget(request_id, task))
        elif kind == rp.CREDIT:
            granted = self._credits.get(request_id)  # type: ignore[arg-type]
            if granted is not None:  # else the request ended meanwhile
                granted.grant(int(frame["bytes"]))
        elif kind == rp.CANCEL:
            self._credits.pop(request_id, None)  # type: ignore[arg-type]
            task = self._requests.pop(request_id, None)  # type: ignore[arg-type]
            if task is not None:
                task.cancel()  # closes the engine request: vLLM aborts the generation
        else:
            raise rp.ProtocolError(f"a proxy does not send {kind!r} frames")

    def _forget(self, request_id: int, task: asyncio.Task[None]) -> None:
        if self._requests.get(request_id) is task:  # not an id the proxy has reused since
            del self._requests[request_id]
            self._credits.pop(request_id, None)

    async def _forward(
        self,
        http: aiohttp.ClientSession,
        ws: WebSocket,
        sending: asyncio.Lock,
        credit: Credit,
        request_id: int,
        frame: dict[str, Any],
    ) -> None:
        """One request: to the engine, and its answer back as it comes and credit allows."""

        async def send(data: str | bytes) -> None:
            async with sending:
                if isinstance(data, str):
                    await ws.send_str(data)
                else:
                    await ws.send_bytes(data)

        body = frame.get("body")
        headers = {k: v for k, v in (frame.get("headers") or {}).items()
                   if k.lower() not in _DROPPED}  # fmt: skip
        try:
            async with http.request(
                str(frame.get("method") or "POST"), self.engine_url + str(frame.get("path")),
                data=None if body is None else body.encode(), headers=headers,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            ) as response:  # fmt: skip
                head = {str(k): v for k, v in response.headers.items()
                        if k.lower() not in _DROPPED}  # fmt: skip
                await send(rp.control(rp.HEAD, id=request_id, status=response.status,
                                      headers=head))  # fmt: skip
                # Not reading while the credit is spent leaves the rest in the engine's socket.
                async for chunk in response.content.iter_any():
                    while chunk:
                        size = await credit.take(len(chunk))
                        await send(rp.data(request_id, chunk[:size]))
                        chunk = chunk[size:]
            await send(rp.control(rp.END, id=request_id))
        except asyncio.CancelledError:
            raise  # the proxy cancelled it, or the socket dropped: nobody to answer
        except Exception as exc:
            if ws.closed:
                return
            if not isinstance(exc, aiohttp.ClientError | OSError | TimeoutError):
                log.exception("relay %s: forwarding a request failed", self.name)
            # Always answered: the proxy must not wait out its timeout for a request we dropped.
            message = f"the engine at {self.engine_url}: {type(exc).__name__}: {exc}"
            with contextlib.suppress(aiohttp.ClientError, OSError):
                await send(rp.control(rp.ERROR, id=request_id, message=message))

    async def _report_health(
        self, http: aiohttp.ClientSession, ws: WebSocket, sending: asyncio.Lock
    ) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            error = await self._engine_health(http)
            try:
                async with sending:
                    await ws.send_str(rp.control(rp.HEALTH, healthy=error is None, error=error))
            except (aiohttp.ClientError, OSError):
                return  # the socket dropped: the reader notices and dials again

    async def _engine_health(self, http: aiohttp.ClientSession) -> str | None:
        try:
            async with http.get(
                self.engine_url + "/health", timeout=aiohttp.ClientTimeout(total=5)
            ) as response:
                return None if response.status == 200 else f"GET /health answered {response.status}"
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return f"GET /health failed: {type(exc).__name__}: {exc}"
