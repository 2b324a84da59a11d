"""Session reads handed over to the reader process (`proxy.reader`), so they never grow the proxy.

The proxy records every agent's calls; its memory must stay what recording needs (the sessions'
remembered turns, `TRAJSTORE_CONTEXT_BYTES`, plus a constant) however often and however long the
sessions someone reads. A read of a long session holds that session whole while its answer is
written, and CPython keeps such a high-water mark for good (measured: 93 MiB before, 481 MiB
after the reads of two 5,000-call sessions, neither `gc` nor `malloc_trim` gave it back). So the
proxy checks the caller's key and flushes its writer, as before, then hands the read to a child
process over a unix socket and passes its answer on a chunk at a time: the proxy holds one chunk
of a read, never the session.

The reader starts on the first read, exits after `reader_idle_timeout` seconds without one (its
memory goes back to the system), and is replaced when its resident set passes
`reader_max_bytes` (the old one finishes the reads it has, then exits): its memory is bounded
too, by that setting plus one read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp

from trajstore.proxy.errors import Overloaded

log = logging.getLogger(__name__)

#: Bytes passed on at a time: the most of a read the proxy holds.
CHUNK_BYTES = 64 << 10
#: How long a reader may take to start (imports, its pool) before a read gives up.
START_TIMEOUT_S = 60.0


def resident_bytes(pid: int) -> int | None:
    """A process's resident set in bytes (Linux /proc), or None where it cannot be read."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


class _Process:
    """One reader process and the client session that talks to it."""

    def __init__(self, socket: Path, process: subprocess.Popen[bytes]) -> None:
        self.socket = socket
        self.process = process
        self.http = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(socket)), auto_decompress=False
        )

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        """Ask it to exit: SIGTERM lets the reads it is serving finish (uvicorn's graceful exit);
        its client stays open until then."""
        if self.alive:
            self.process.terminate()

    async def close(self) -> None:
        """Stop it, wait for it to exit (killed after 10 s), and close its client."""
        self.stop()
        try:
            await asyncio.to_thread(self.process.wait, 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        await self.http.close()
        with contextlib.suppress(OSError):
            self.socket.unlink()


class Reader:
    """The proxy's side of the reader process: start it, recycle it, forward a read to it."""

    def __init__(
        self, database_url: str, public_url: str, *, max_bytes: int, idle_timeout: float
    ) -> None:
        self.database_url = database_url
        self.public_url = public_url
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self._current: _Process | None = None
        self._retired: list[_Process] = []
        self._starting = asyncio.Lock()
        self._dir = tempfile.mkdtemp(prefix="trajstore-reader-")
        self._generation = 0

    @property
    def pid(self) -> int | None:
        """The current reader's process id (None before the first read or after it exited)."""
        current = self._current
        return current.process.pid if current is not None and current.alive else None

    async def get(self, path: str, params: dict[str, str]) -> aiohttp.ClientResponse:
        """The reader's answer to GET `path` (the caller reads it, then releases it)."""
        for attempt in range(2):
            process = await self._ready()
            try:
                return await process.http.get(f"http://reader{path}", params=params)
            except aiohttp.ClientConnectionError:
                # It exited between our look and the request (idle, or recycled): once more.
                if attempt:
                    raise Overloaded("the proxy's session reader is not answering") from None
                await self._retire(process)
        raise AssertionError("unreachable")

    async def relay(self, answer: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        """The reader's answer passed on a chunk at a time, released at the end."""
        try:
            async for chunk in answer.content.iter_chunked(CHUNK_BYTES):
                yield chunk
        finally:
            answer.release()

    async def close(self) -> None:
        """Stop every reader this proxy started."""
        for process in [*self._retired, *([self._current] if self._current else [])]:
            await process.close()
        self._current, self._retired = None, []
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    async def _ready(self) -> _Process:
        async with self._starting:
            await self._reap()
            current = self._current
            if current is not None and current.alive:
                used = resident_bytes(current.process.pid)
                if used is None or used <= self.max_bytes:
                    return current
                log.info("session reader at %d MiB, past its bound: replaced", used >> 20)
                await self._retire(current)
            self._current = await self._start()
            return self._current

    async def _retire(self, process: _Process) -> None:
        if process is self._current:
            self._current = None
        process.stop()
        self._retired.append(process)

    async def _reap(self) -> None:
        """Close what is left of the readers that exited (their clients, their sockets)."""
        gone = [p for p in self._retired if not p.alive]
        self._retired = [p for p in self._retired if p.alive]
        current = self._current
        if current is not None and not current.alive:  # exited when idle
            gone.append(current)
            self._current = None
        for process in gone:
            await process.close()

    async def _start(self) -> _Process:
        self._generation += 1
        socket = Path(self._dir) / f"reader-{self._generation}.sock"
        env = {
            **os.environ,
            "TRAJSTORE_DATABASE_URL": self.database_url,
            "TRAJSTORE_READER_PUBLIC_URL": self.public_url,
        }
        argv = [sys.executable, "-m", "trajstore.proxy.reader", "--socket", str(socket),
                "--idle", str(self.idle_timeout)]  # fmt: skip
        popen = await asyncio.to_thread(subprocess.Popen, argv, env=env, stdin=subprocess.DEVNULL)
        process = _Process(socket, popen)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while loop.time() < deadline:
            if not process.alive:
                break
            if socket.exists():
                with contextlib.suppress(aiohttp.ClientError):
                    async with process.http.get("http://reader/health") as answer:
                        if answer.status == 200:
                            return process
            await asyncio.sleep(0.05)
        await process.close()
        raise Overloaded("the proxy's session reader did not start; see the proxy's log")
