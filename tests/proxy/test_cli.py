"""`trajstore proxy` as a user runs it: in its own process, with clear words when it cannot."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine


async def start_cli(*args: str, database_url: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "proxy", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def healthy(url: str, timeout: float = 20.0) -> bool:
    async with httpx.AsyncClient() as http:
        for _ in range(int(timeout / 0.1)):
            try:
                if (await http.get(f"{url}/health")).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
    return False


@pytest.fixture
async def busy_port() -> AsyncIterator[int]:
    """A port some other program listens on."""
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen()
        yield port


async def test_a_port_in_use_is_named_with_what_to_do(
    busy_port: int, engine: FakeEngine, database_url: str
) -> None:
    child = await start_cli("--engine", engine.url, "--port", str(busy_port),
                            database_url=database_url)  # fmt: skip
    _, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 1
    assert f"port {busy_port} on 127.0.0.1 is in use" in err.decode()
    assert "--next-free-port" in err.decode()


async def test_next_free_port_serves_and_sigusr1_dumps_the_tasks(
    busy_port: int, engine: FakeEngine, database_url: str
) -> None:
    child = await start_cli("--port", str(busy_port), "--next-free-port",
                            database_url=database_url)  # fmt: skip
    child.kill()  # no engine given: it must refuse, not start
    await child.wait()
    os.environ["TRAJSTORE_ENGINES"] = engine.url  # the engines may come from the environment
    try:
        child = await start_cli("--port", str(busy_port), "--next-free-port",
                                database_url=database_url)  # fmt: skip
    finally:
        del os.environ["TRAJSTORE_ENGINES"]
    try:
        assert child.stdout is not None and child.stderr is not None
        banner = (await asyncio.wait_for(child.stdout.readline(), 30)).decode()
        url = banner.split(" on ")[1].split(" ")[0]
        assert url != f"http://127.0.0.1:{busy_port}"
        assert await healthy(url)
        child.send_signal(signal.SIGUSR1)
        dump = b""
        while b"asyncio tasks" not in dump:
            dump += await asyncio.wait_for(child.stderr.readline(), 10)
    finally:
        child.terminate()
        _, rest = await asyncio.wait_for(child.communicate(), 20)
    # A clean shutdown on SIGTERM (uvicorn re-raises the signal once it has shut down).
    assert child.returncode in (0, -signal.SIGTERM)
    assert b"Traceback" not in rest


async def test_no_engine_is_a_usage_error(database_url: str) -> None:
    child = await start_cli(database_url=database_url)
    _, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 2
    assert "name at least one engine" in err.decode()
