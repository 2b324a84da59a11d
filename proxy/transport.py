"""How a request reaches an engine: over HTTP, or over the WebSocket of a relay that dialled in.

Forwarding has one code path for both. An engine's `Transport` sends a request and gives back an
`Answer`: its status, headers and body chunks as they come, and a way to cancel it. The HTTP
transport (here) is aiohttp, as the proxy always used; the relay channel is in `proxy.relay`.

    TransportError
    ├── EngineUnreachable   no answer head came back: nothing reached the agent, another
    │                       engine may take the request
    └── AnswerBroken        the answer broke off after its head

A timeout is Python's `TimeoutError`, from either transport.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

import aiohttp


class TransportError(Exception):
    """The engine could not be reached, or its answer broke off."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class EngineUnreachable(TransportError):
    """The engine gave no answer: the request may be sent to another engine."""


class AnswerBroken(TransportError):
    """The engine's answer broke off after its head."""


class Answer(Protocol):
    """An engine's answer to one request: its head at once, its body as it comes."""

    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, in the pieces it arrives in; raises `AnswerBroken` or `TimeoutError`."""
        ...

    async def read(self) -> bytes:
        """The whole body."""
        ...

    def close(self) -> None:
        """Stop the answer where it is: the engine stops generating. Safe to call twice."""
        ...


class Transport(Protocol):
    """How requests reach one engine."""

    kind: str  #: "http" or "relay", shown by /admin/engines

    async def send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: float,
        stream: bool = False,
    ) -> Answer:
        """Send a request; return once the answer's head is in. `timeout`: for the whole answer,
        or, when `stream`, for each chunk. Raises `EngineUnreachable` or `TimeoutError`."""
        ...

    async def health(self, timeout: float) -> str | None:
        """None when the engine is healthy, else why not."""
        ...

    def describe(self) -> dict[str, object]:
        """What the admin API shows of the transport."""
        ...


class HttpAnswer:
    """An aiohttp response as an `Answer`."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self.response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as aiohttp reads it, each read whole."""
        try:
            async for data in self.response.content.iter_any():
                yield data
        except TimeoutError:
            raise  # aiohttp's read timeouts are ClientErrors too
        except aiohttp.ClientError as exc:
            raise AnswerBroken(f"{type(exc).__name__}: {exc}") from exc

    async def read(self) -> bytes:
        """The whole body; the connection goes back to the pool."""
        try:
            return await self.response.read()
        except TimeoutError:
            raise
        except aiohttp.ClientError as exc:
            raise AnswerBroken(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.response.release()

    def close(self) -> None:
        """Close the connection: vLLM aborts a generation whose client left."""
        self.response.close()


class HttpTransport:
    """An engine the proxy reaches at its URL."""

    kind = "http"

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url

    async def send(
        self,
        method: str,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str],
        *,
        timeout: float,
        stream: bool = False,
    ) -> HttpAnswer:
        """Send the request with aiohttp; see `Transport.send`."""
        if stream:
            limit = aiohttp.ClientTimeout(sock_read=timeout)
        else:
            limit = aiohttp.ClientTimeout(total=timeout)
        try:
            response = await self.http.request(
                method, self.url + path, data=body, headers=headers, timeout=limit
            )
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError) as exc:
            raise EngineUnreachable(f"{type(exc).__name__}: {exc}") from exc
        return HttpAnswer(response)

    async def health(self, timeout: float) -> str | None:
        """Ask the engine's `/health`."""
        try:
            async with self.http.get(
                f"{self.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)
            ) as response:
                if response.status != 200:
                    return f"GET /health answered {response.status}"
        except TimeoutError:
            return f"GET /health timed out after {timeout}s"
        except (aiohttp.ClientError, OSError) as exc:
            return f"GET /health failed: {type(exc).__name__}: {exc}"
        return None

    def describe(self) -> dict[str, object]:
        """Nothing beyond the engine's URL."""
        return {"transport": self.kind}
