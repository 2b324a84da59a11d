"""`trajstore up` as a user runs it: a real subprocess, a real PostgreSQL, stopped by Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import pytest
from openai import AsyncOpenAI

from tests.conftest import free_port, world_readable_tempdir
from tests.proxy.fake_engine import FakeEngine
from trajstore.stack import cached_tiny_model
from trajstore.store import EventStore, EventType
from trajstore.store.embedded import EmbeddedPostgres
from trajstore.tiny_model import build_tiny_model


@dataclass
class Up:
    """A running `trajstore up` and what its banner said."""

    process: asyncio.subprocess.Process
    banner: dict[str, str]  # "proxy", "engines", "sql" -> value
    example: list[str]  # the five-line agent example

    @property
    def proxy_url(self) -> str:
        return self.banner["proxy"]

    async def interrupt(self) -> tuple[str, str]:
        """Ctrl-C, then wait for the exit; return (rest of stdout, all of stderr)."""
        self.process.send_signal(signal.SIGINT)
        out, err = await asyncio.wait_for(self.process.communicate(), 60)
        return out.decode(), err.decode()


async def start_up(*args: str, data_dir: Path, startup_timeout: float = 60, **env_vars: str) -> Up:
    """Start `trajstore up` and read its banner, up to the last line of the agent example."""
    env = {**os.environ, "TRAJSTORE_DATA_DIR": str(data_dir), **env_vars}
    env.pop("TRAJSTORE_DATABASE_URL", None)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", *args,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stdout is not None
    banner: dict[str, str] = {}
    example: list[str] = []
    try:
        async with asyncio.timeout(startup_timeout):
            while len(example) < 5:
                line = (await process.stdout.readline()).decode()
                if not line:
                    _, err = await process.communicate()
                    raise AssertionError(f"`up` exited early:\n{err.decode()}")
                if line.startswith("    "):
                    example.append(line.strip())
                elif ":" in line:
                    key, _, value = line.partition(":")
                    banner[key] = value.strip()
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return Up(process, banner, example)


@pytest.fixture
async def stack(
    engine: FakeEngine, database_url: str, tmp_path: Path
) -> AsyncIterator[tuple[Up, str]]:
    """`trajstore up` in front of a fake engine, on a fresh test database."""
    up = await start_up("--database-url", database_url, "up", "--engine", engine.url,
                        "--port", str(free_port()), "--poll-interval", "0.2",
                        data_dir=tmp_path)  # fmt: skip
    try:
        yield up, database_url
    finally:
        if up.process.returncode is None:
            up.process.kill()
            await up.process.wait()


def listening(port: int) -> bool:
    """Whether anything accepts connections on 127.0.0.1:`port` (a socket in TIME_WAIT does not
    count, unlike `port_in_use`, which tries to bind)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return False
    return True


async def wait_for_count(database_url: str, sql: str, *args: object, expected: int) -> int:
    """Poll `sql` (a count) until it gives `expected` or 10 s pass; return the last count."""
    conn = await asyncpg.connect(database_url)
    try:
        for _ in range(100):
            count = int(await conn.fetchval(sql, *args))
            if count == expected:
                break
            await asyncio.sleep(0.1)
        return count
    finally:
        await conn.close()


async def new_session(proxy_url: str, run_id: str) -> dict[str, str]:
    async with httpx.AsyncClient() as http:
        response = await http.post(f"{proxy_url}/sessions", json={"run_id": run_id})
    assert response.status_code == 201, response.text
    created: dict[str, str] = response.json()
    return created


async def test_up_serves_records_projects_and_stops_cleanly_on_ctrl_c(
    stack: tuple[Up, str],
) -> None:
    up, database_url = stack
    assert up.banner["sql"] == database_url
    assert up.banner["engines"].startswith("http://127.0.0.1:")

    # The printed agent example, run as a user would paste it: a session, a chat call through
    # the proxy, finished; the live projector turns it into a sample.
    example = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "\n".join(up.example),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(example.communicate(), 60)
    assert example.returncode == 0, err.decode()
    assert "ChatCompletion(" in out.decode()
    samples = "SELECT count(*) FROM samples WHERE run_id = $1"
    assert await wait_for_count(database_url, samples, "hello", expected=1) == 1

    # A second session, never finished: its events sit in the proxy's writer when Ctrl-C comes.
    created = await new_session(up.proxy_url, "open")
    agent = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"], max_retries=0)
    await agent.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )

    rest, err = await up.interrupt()
    assert up.process.returncode == 0, err
    assert "Traceback" not in err
    assert "stopped: proxy, projector" in rest
    port = int(up.proxy_url.rsplit(":", 1)[1])
    assert not listening(port)
    # The unfinished session's turn is in the log after the exit (the writer is closed, which
    # flushes it, before the process ends).
    store = await EventStore.open(database_url)
    try:
        events = await store.read_session(created["session_id"])
    finally:
        await store.close()
    assert EventType.COMPLETION_FINISHED in {e.type for e in events}
    # Nothing `up` opened is left connected to the database: only the polling connection.
    backends = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
    assert await wait_for_count(database_url, backends, expected=1) == 1


async def test_sigterm_stops_it_cleanly_too(stack: tuple[Up, str]) -> None:
    up, _ = stack
    up.process.send_signal(signal.SIGTERM)
    out, err = await asyncio.wait_for(up.process.communicate(), 60)
    assert up.process.returncode == 0, err.decode()
    assert "stopped" in out.decode()
    assert not listening(int(up.proxy_url.rsplit(":", 1)[1]))


async def test_a_taken_port_is_named_with_what_to_do(
    engine: FakeEngine, database_url: str, tmp_path: Path
) -> None:
    port = int(engine.url.rsplit(":", 1)[1])  # the fake engine listens there
    env = {**os.environ, "TRAJSTORE_DATA_DIR": str(tmp_path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "--database-url", database_url, "up",
        "--engine", engine.url, "--port", str(port),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(child.communicate(), 30)
    assert child.returncode == 1
    assert f"port {port} on 127.0.0.1 is in use" in err.decode()


def test_the_tiny_model_is_built_once_and_reused(tmp_path: Path) -> None:
    first = cached_tiny_model(tmp_path)
    weights = first / "model.safetensors"
    built_at = weights.stat().st_mtime_ns
    assert cached_tiny_model(tmp_path) == first
    assert weights.stat().st_mtime_ns == built_at  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-model"]  # no scratch left behind


@pytest.mark.embedded
@pytest.mark.slow
async def test_with_no_database_url_up_runs_the_embedded_server_and_stops_it_if_it_started_it(
    engine: FakeEngine,
) -> None:
    data_dir, pg_port = world_readable_tempdir("trajstore-up-"), free_port()
    embedded = EmbeddedPostgres(data_dir, pg_port)

    async def up_and_interrupt(*, check_tcp: bool) -> None:
        up = await start_up("up", "--engine", engine.url, "--port", str(free_port()),
                            data_dir=data_dir, TRAJSTORE_EMBEDDED_PORT=str(pg_port))  # fmt: skip
        try:
            # The printed SQL string is the TCP one, and the database behind it is migrated.
            assert up.banner["sql"].startswith("postgresql://trajstore:")
            assert f"@127.0.0.1:{pg_port}/" in up.banner["sql"]
            # Over TCP only when the server stops next: the backend closes first, and its
            # TIME_WAIT would make store.embedded's bind check refuse the port for a minute.
            conn = await asyncpg.connect(up.banner["sql"] if check_tcp else embedded.url())
            try:
                assert await conn.fetchval("SELECT count(*) FROM samples") == 0
            finally:
                await conn.close()
        finally:
            _, err = await up.interrupt()
        assert up.process.returncode == 0, err

    try:
        embedded.start()
        await up_and_interrupt(check_tcp=False)
        assert embedded.status().running  # it was running before `up`: it stays
        embedded.stop()
        await up_and_interrupt(check_tcp=True)
        assert not embedded.status().running  # `up` started it, so `up` stopped it
    finally:
        embedded.stop()
        shutil.rmtree(data_dir, ignore_errors=True)


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text.encode() in (proc / "cmdline").read_bytes():
                    found.append(int(proc.name))
            except OSError:
                continue
    return found


@pytest.mark.vllm
@pytest.mark.slow
async def test_up_without_an_engine_serves_a_local_vllm(database_url: str, tmp_path: Path) -> None:
    up = await start_up("--database-url", database_url, "up", "--port", str(free_port()),
                        data_dir=tmp_path, startup_timeout=300)  # fmt: skip
    try:
        assert up.banner["engines"].endswith("(local vLLM)")
        model_dir = tmp_path / "tiny-model"
        assert _processes_mentioning(str(model_dir))  # vLLM serves the cached model
        created = await new_session(up.proxy_url, "local")
        agent = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"])
        answer = await agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "What is 2 plus 3?"}], max_tokens=8
        )
        assert answer.choices[0].finish_reason in ("length", "stop")
        assert answer.usage is not None and answer.usage.completion_tokens > 0
    finally:
        rest, err = await up.interrupt()
    assert up.process.returncode == 0, err
    assert "stopped: proxy, projector, vLLM" in rest
    vllm_port = int(up.banner["engines"].split()[0].rsplit(":", 1)[1])
    assert not listening(vllm_port)
    assert _processes_mentioning(str(model_dir)) == []  # every vLLM process is gone


def test_a_tiny_model_cached_before_agents_contexts_is_rebuilt_with_the_same_weights(
    tmp_path: Path,
) -> None:
    old = build_tiny_model(tmp_path / "tiny-model", max_positions=4096)  # as `up` cached it
    weights = (old / "model.safetensors").read_bytes()
    model = cached_tiny_model(tmp_path)
    assert model == old
    # Real agent CLIs' 18-49 k-token prompts fit now, and rotary positions have no weights.
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] >= 100_000
    assert (model / "model.safetensors").read_bytes() == weights
