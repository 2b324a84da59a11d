"""The proxy's HTTP server: uvicorn's httptools protocol on uvloop, each connection's writes of
one event-loop turn sent together.

uvicorn writes a response's status line and headers as soon as the app starts the response,
then each body message, then (for a chunked answer) the terminating chunk: each its own
`send()` system call, and on loopback each also wakes the reader. A whole answer took two writes
where an aiohttp server takes one, a streamed one four for the pass-through's two or three.
Writes made in the same loop turn now go out as one, when the turn ends (`CoalescedWrites`): the
same bytes, in the same order, a loop turn later (microseconds). What that saves is measured in
docs/performance.md ("Proxy overhead"); uvicorn with its h11 protocol, and granian, were measured
there too.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescedWrites:
    """A transport whose writes within one loop turn reach the socket as one write.

    Everything but writing, closing and aborting is the wrapped transport's own; closing (and
    `write_eof`) sends what is held first, aborting drops it.
    """

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold `data` until the loop turn ends."""
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data))

    def writelines(self, lines: Any) -> None:
        """Hold each piece, as `write` does."""
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held and not self._transport.is_closing():
            self._transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        """Send what is held, then close."""
        self._flush()
        self._transport.close()

    def write_eof(self) -> None:
        """Send what is held, then the end of the stream."""
        self._flush()
        self._transport.write_eof()

    def abort(self) -> None:
        """Drop what is held and close at once."""
        self._held = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        """The bytes held here and in the transport's own buffer."""
        return sum(map(len, self._held)) + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing through `CoalescedWrites`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        """Serve the connection; its writes are coalesced per loop turn."""
        super().connection_made(CoalescedWrites(transport, self.loop))  # type: ignore[arg-type]


#: The options every proxy server takes (`uvicorn.run(app, **SERVER_OPTIONS)`, `uvicorn.Config`).
SERVER_OPTIONS: dict[str, Any] = {"http": HttpProtocol, "loop": "uvloop"}
