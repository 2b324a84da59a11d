"""The embedded default, driven through the `trajstore` CLI as a user (and CI, as root) runs it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port, world_readable_tempdir
from tests.support import chunk_event
from trajstore.store import EventStore, EventType, NewEvent, migrations
from trajstore.store.embedded import EmbeddedPostgres
from trajstore.store.postgres_host import pgserver_binaries

pytestmark = [pytest.mark.embedded, pytest.mark.slow]

TRAJSTORE = [sys.executable, "-m", "trajstore"]


class Cli:
    """Runs `trajstore` in a subprocess against one data directory."""

    def __init__(self, data_dir: Path, port: int, bin_dir: Path | None = None) -> None:
        self.env = {
            **os.environ,
            "TRAJSTORE_DATA_DIR": str(data_dir),
            "TRAJSTORE_EMBEDDED_PORT": str(port),
        }
        self.env.pop("TRAJSTORE_DATABASE_URL", None)
        if bin_dir is not None:
            self.env["TRAJSTORE_PG_BIN_DIR"] = str(bin_dir)
        self.server = EmbeddedPostgres(data_dir, port, bin_dir)

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [*TRAJSTORE, *args], env=self.env, capture_output=True, text=True, timeout=120
        )
        if check and done.returncode != 0:
            raise AssertionError(f"trajstore {' '.join(args)} failed:\n{done.stderr}")
        return done


@pytest.fixture(params=["machine", "pgserver"])
def cli(request: pytest.FixtureRequest) -> Iterator[Cli]:
    """A CLI on a fresh data directory, with the machine's binaries or the pgserver wheel's."""
    bin_dir = None
    if request.param == "pgserver":
        bin_dir = pgserver_binaries()
        assert bin_dir is not None, "pgserver is a dependency of trajstore and must be installed"
    runner = Cli(world_readable_tempdir("trajstore-embedded-"), free_port(), bin_dir)
    try:
        yield runner
    finally:
        runner.server.stop()


async def count_events(url: str) -> int:
    async with await EventStore.open(url) as store:
        return len(await store.read_all(limit=10_000))


async def append_one(url: str) -> None:
    async with await EventStore.open(url) as store:
        await store.append("session-x", [NewEvent(EventType.SESSION_CREATED, session_id="x")])


def test_start_migrate_reuse_stop_and_keep_data(cli: Cli) -> None:
    url = cli("db", "start").stdout.strip().splitlines()[-1]
    assert url.startswith("postgresql://trajstore@/trajstore?host=")
    pid = cli.server.running_pid()
    assert pid is not None
    if os.geteuid() == 0:  # PostgreSQL refuses root: it must run as someone else
        assert Path(f"/proc/{pid}").stat().st_uid != 0

    assert "migrated to head" in cli("migrate").stdout
    asyncio.run(append_one(url))

    # Starting again reuses the running server.
    again = cli("db", "start").stdout
    assert "already running" in again
    assert again.strip().splitlines()[-1] == url
    assert cli.server.running_pid() == pid
    status = cli("db", "status")
    assert f"running (pid {pid})" in status.stdout
    assert cli("db", "url").stdout.strip() == url

    assert cli("db", "stop").stdout.strip() == "stopped"
    stopped = cli("db", "status", check=False)
    assert stopped.returncode == 3 and "stopped" in stopped.stdout
    assert cli("db", "stop").stdout.strip() == "not running"

    # The port chosen at creation is kept even when it is not asked for again.
    del cli.env["TRAJSTORE_EMBEDDED_PORT"]
    assert "started" in cli("db", "start").stdout
    cli("migrate")  # idempotent
    assert cli("db", "url").stdout.strip() == url
    assert asyncio.run(count_events(url)) == 1


def test_the_tcp_url_needs_and_has_the_password(cli: Cli) -> None:
    cli("db", "start")
    tcp_url = cli("db", "url", "--tcp").stdout.strip()
    assert tcp_url.startswith("postgresql://trajstore:") and "@127.0.0.1:" in tcp_url
    cli("migrate")
    assert asyncio.run(count_events(tcp_url)) == 0
    no_password = tcp_url.split("://")[0] + "://trajstore@" + tcp_url.split("@")[1]
    with pytest.raises(Exception, match="password"):
        asyncio.run(count_events(no_password))


def test_a_killed_server_starts_again_with_its_data(cli: Cli) -> None:
    url = cli("db", "start").stdout.strip().splitlines()[-1]
    cli("migrate")
    asyncio.run(append_one(url))
    pid = cli.server.running_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    for _ in range(100):
        if cli.server.running_pid() is None:
            break
        time.sleep(0.05)
    assert (cli.server.pgdata / "postmaster.pid").exists()  # left behind by the kill
    assert cli("db", "status", check=False).returncode == 3
    cli("db", "start")
    assert asyncio.run(count_events(url)) == 1


def test_a_stale_pid_file_naming_another_live_process_is_cleared(cli: Cli) -> None:
    cli("db", "start")
    cli("db", "stop")
    # A pid file left by a crash whose pid now belongs to some other program (this test).
    (cli.server.pgdata / "postmaster.pid").write_text(f"{os.getpid()}\n{cli.server.pgdata}\n")
    assert cli("db", "status", check=False).returncode == 3
    done = cli("--verbose", "db", "start")
    assert "stale" in done.stderr
    assert cli.server.running_pid() not in (None, os.getpid())


def test_a_port_in_use_is_reported_with_what_to_change(cli: Cli) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", int(cli.env["TRAJSTORE_EMBEDDED_PORT"])))
        sock.listen()
        done = cli("db", "start", check=False)
    assert done.returncode == 1
    assert "is in use by another program" in done.stderr
    assert "TRAJSTORE_EMBEDDED_PORT" in done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="only root's server runs as another user")
def test_as_root_a_data_dir_the_server_user_cannot_reach_is_refused_clearly(
    tmp_path: Path,
) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    tmp_path.chmod(0o700)
    done = Cli(hidden / "data", free_port())("db", "start", check=False)
    assert done.returncode == 1
    assert "cannot enter" in done.stderr and "TRAJSTORE_DATA_DIR" in done.stderr


async def test_writer_survives_a_server_crash_and_restart_exactly_once() -> None:
    server = EmbeddedPostgres(world_readable_tempdir("trajstore-restart-"), free_port())
    url = server.start()
    try:
        await asyncio.to_thread(migrations.upgrade, url)
        async with await EventStore.open(url) as store:
            writer = store.writer(batch_size=100, flush_interval=0.001, retry_timeout=60)
            await writer.start()
            expected = []
            for r in range(30):
                events = [chunk_event("s", seed=r * 100 + i) for i in range(50)]
                expected.extend(e.event_id for e in events)
                writer.append_many(f"request-{r}", 1, events)
                if r == 10:
                    # An immediate stop is a crash: no checkpoint, in-flight work is lost.
                    assert await asyncio.to_thread(server.stop, mode="immediate")
                if r == 20:
                    await asyncio.to_thread(server.start)
                await asyncio.sleep(0.01)
            await writer.close()
            assert writer.stats.retries >= 1
        async with await EventStore.open(url) as store:
            rows = await store.pool.fetch("SELECT event_id FROM events")
        assert sorted(r[0] for r in rows) == sorted(expected)
    finally:
        server.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root's server runs as another user")
def test_as_root_binaries_the_server_user_cannot_reach_are_copied_next_to_the_data(
    tmp_path: Path,
) -> None:
    # pgserver inside a virtual environment under a private directory (root's home, a 0700
    # checkout): the layout of site-packages, unreachable for the server user.
    wheel_bin = pgserver_binaries()
    assert wheel_bin is not None
    site_packages = tmp_path / "venv" / "site-packages"
    shutil.copytree(wheel_bin.parent, site_packages / "pgserver" / "pginstall", symlinks=True)
    shutil.copytree(wheel_bin.parents[2] / "pgserver.libs", site_packages / "pgserver.libs")
    tmp_path.chmod(0o700)
    private_bin = site_packages / "pgserver" / "pginstall" / "bin"

    cli = Cli(world_readable_tempdir("trajstore-copied-"), free_port(), private_bin)
    try:
        url = cli("db", "start").stdout.strip().splitlines()[-1]
        cli("migrate")
        assert asyncio.run(count_events(url)) == 0
        recorded = Path(json.loads(cli.server.config_file.read_text())["bin_dir"])
        assert recorded.is_relative_to(cli.server.data_dir)
        cli("db", "stop")
        cli("db", "start")  # the copy is what the cluster uses from now on
        assert cli.server.running_pid() is not None
    finally:
        cli.server.stop()
