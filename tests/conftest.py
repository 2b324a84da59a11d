"""Shared fixtures: a real PostgreSQL, a migrated template database, a fresh clone per test.

The server is the one named by TRAJSTORE_TEST_DATABASE_URL (CI: the machine's PostgreSQL on
127.0.0.1:5432); when unset, the tests start trajstore's own embedded server in a temporary
directory, exactly as a user's machine would. Each test gets a database cloned from a template
that Alembic migrated once per session (pytest-postgresql's janitor does the cloning).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pytest_postgresql.janitor import DatabaseJanitor
from sqlalchemy.engine import make_url

from trajstore.store import EventStore, migrations
from trajstore.store.embedded import EmbeddedPostgres

# The proxy's fixtures (fake engine, a served proxy) are used beyond tests/proxy (the README).
pytest_plugins = ["tests.proxy.fixtures"]

_db_numbers = itertools.count()


@dataclass(frozen=True)
class Server:
    """Where the test PostgreSQL listens, in the pieces the janitor wants."""

    user: str
    host: str
    port: int
    password: str | None

    def url(self, dbname: str) -> str:
        auth = self.user + (f":{self.password}" if self.password else "")
        if self.host.startswith("/"):
            return f"postgresql://{auth}@/{dbname}?host={self.host}&port={self.port}"
        return f"postgresql://{auth}@{self.host}:{self.port}/{dbname}"

    def janitor(self, dbname: str, **kwargs: object) -> DatabaseJanitor:
        return DatabaseJanitor(
            user=self.user,
            host=self.host,
            port=self.port,
            dbname=dbname,
            password=self.password,
            **kwargs,
        )


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def world_readable_tempdir(prefix: str) -> Path:
    """A temporary directory the unprivileged server user can enter (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """The PostgreSQL server all integration tests use."""
    url = os.environ.get("TRAJSTORE_TEST_DATABASE_URL")
    if url:
        parsed = make_url(url)
        host = parsed.query.get("host") or parsed.host or "127.0.0.1"
        yield Server(
            user=parsed.username or "postgres",
            host=str(host),
            port=int(parsed.query.get("port") or parsed.port or 5432),  # type: ignore[arg-type]
            password=parsed.password,
        )
        return
    embedded = EmbeddedPostgres(world_readable_tempdir("trajstore-tests-"), free_port())
    embedded.start()
    try:
        yield Server(
            user="trajstore", host=str(embedded.socket_dir), port=embedded.port, password=None
        )
    finally:
        embedded.stop()


@pytest.fixture(scope="session")
def template_db(server: Server) -> Iterator[str]:
    """A database migrated to head once per test session, used as the template of each test's."""
    name = f"trajstore_template_{os.getpid()}"
    janitor = server.janitor(name, as_template=True)
    janitor.init()
    try:
        migrations.upgrade(server.url(name))
        yield name
    finally:
        janitor.drop()


@contextlib.contextmanager
def fresh_database(server: Server, template: str | None = None) -> Iterator[str]:
    """A new database (a clone of `template` when given), dropped afterwards; yields its URL."""
    name = f"trajstore_test_{os.getpid()}_{next(_db_numbers)}"
    janitor = server.janitor(name, template_dbname=template)
    janitor.init()
    try:
        yield server.url(name)
    finally:
        janitor.drop()


@pytest.fixture
def database_url(server: Server, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for one test."""
    with fresh_database(server, template_db) as url:
        yield url


@pytest.fixture
def empty_database_url(server: Server) -> Iterator[str]:
    """A fresh database with no schema at all."""
    with fresh_database(server) as url:
        yield url


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[EventStore]:
    """An open event store on a fresh database."""
    event_store = await EventStore.open(database_url)
    try:
        yield event_store
    finally:
        await event_store.close()
