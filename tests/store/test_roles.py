"""Least privilege in PostgreSQL (`store.roles`): the proxy's role can read and append events and
nothing else, the projector's can read events and write samples; neither can rewrite the log or
switch its guards off. Each is also shown doing its real job under its role."""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import serve_proxy
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventStore, EventType, NewEvent, SchemaNotReady
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import role_database_url
from trajstore.store.projection import Projector
from trajstore.store.roles import PROJECTOR_ROLE, RECORDER_ROLE, as_role
from trajstore.store.settings import StoreSettings

#: PostgreSQL's "permission denied" / "must be owner" (SQLSTATE 42501), before any trigger runs.
REFUSED = asyncpg.InsufficientPrivilegeError


async def connect(url: str) -> asyncpg.Connection:
    return await asyncpg.connect(asyncpg_dsn(url))


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET payload = '{}'",
        "DELETE FROM events",
        "TRUNCATE events",
        "ALTER TABLE events DISABLE TRIGGER USER",
        "DROP TABLE events",
        "INSERT INTO samples OVERRIDING SYSTEM VALUE SELECT * FROM samples WHERE false",
        "DELETE FROM samples",
    ],
)
async def test_the_recorder_cannot_rewrite_the_log_or_touch_samples(
    database_url: str, statement: str
) -> None:
    conn = await connect(as_role(database_url, RECORDER_ROLE))
    try:
        with pytest.raises(REFUSED):
            await conn.execute(statement)
        assert await conn.fetchval("SELECT current_user") == RECORDER_ROLE
    finally:
        await conn.close()


@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO events OVERRIDING SYSTEM VALUE SELECT * FROM events WHERE false",
        "UPDATE events SET payload = '{}'",
        "ALTER TABLE events DISABLE TRIGGER USER",
        "ALTER TABLE samples OWNER TO trajstore_projector",
    ],
)
async def test_the_projector_cannot_write_the_log(database_url: str, statement: str) -> None:
    conn = await connect(as_role(database_url, PROJECTOR_ROLE))
    try:
        with pytest.raises(REFUSED):
            await conn.execute(statement)
    finally:
        await conn.close()


async def test_each_role_does_its_job(database_url: str) -> None:
    recorder = await EventStore.open(as_role(database_url, RECORDER_ROLE))
    try:
        created = NewEvent(EventType.SESSION_CREATED, session_id="s1", run_id="r1",
                           payload={"session_id": "s1", "run_id": "r1"})  # fmt: skip
        finished = NewEvent(EventType.SESSION_FINISHED, session_id="s1", run_id="r1",
                            payload={"status": "completed"})  # fmt: skip
        await recorder.append("session-s1", [created, finished])
        writer = recorder.writer()
        await writer.start()
        await writer.close()
        assert [e.type for e in await recorder.read_session("s1")] == [
            EventType.SESSION_CREATED, EventType.SESSION_FINISHED
        ]  # fmt: skip
    finally:
        await recorder.close()
    projector_store = await EventStore.open(as_role(database_url, PROJECTOR_ROLE))
    try:
        await Projector(projector_store).run_once()  # reads events, writes its checkpoint
    finally:
        await projector_store.close()


async def test_the_proxy_serves_records_and_finishes_as_the_recorder(database_url: str) -> None:
    settings = ProxySettings(port=free_port(), reap_interval=0.2)
    async with FakeEngine() as engine:
        settings.engines = [engine.url]
        async with serve_proxy(settings, as_role(database_url, RECORDER_ROLE)) as proxy:
            session = await proxy.new_session()
            await proxy.agent(session).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            control = {"Authorization": f"Bearer {session['orchestrator_key']}"}
            sid = session["session_id"]
            finished = await proxy.http.post(
                f"{proxy.url}/sessions/{sid}/finish", json={"status": "completed"},
                headers=control,
            )  # fmt: skip
            assert finished.status_code == 200, finished.text
            record: dict[str, Any] = (await proxy.http.get(f"{proxy.url}/sessions/{sid}")).json()
            assert record["status"] == "completed" and record["turns"][0]["status"] == "completed"
            conn = await connect(database_url)
            try:
                named = await conn.fetch(
                    "SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = "
                    "current_database() AND application_name LIKE 'trajstore-%'"
                )
            finally:
                await conn.close()
            # The writer, the listener and the session follower; and the pool of its store.
            assert [row["usename"] for row in named] == [RECORDER_ROLE]
            state = proxy.app.state.proxy
            assert await state.store.pool.fetchval("SELECT current_user") == RECORDER_ROLE


async def migrate(database_url: str, **env: str) -> str:
    """Run `trajstore migrate` in a subprocess, as compose's migrate service does; its output."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "migrate",
        env={**os.environ, "TRAJSTORE_DATABASE_URL": database_url, **env},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await child.communicate()
    assert child.returncode == 0, err.decode()
    return out.decode()


async def test_migrate_gives_the_roles_their_passwords(database_url: str) -> None:
    out = await migrate(database_url, TRAJSTORE_RECORDER_DB_PASSWORD="rec-secret")
    assert "set the password of trajstore_recorder" in out
    conn = await connect(database_url)
    try:  # SCRAM verifiers, never the password itself
        verifier = await conn.fetchval(
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'trajstore_recorder'"
        )
    finally:
        await conn.close()
    assert verifier.startswith("SCRAM-SHA-256$") and "rec-secret" not in verifier


async def test_migrate_writes_each_roles_url_file_as_compose_hands_them_out(
    database_url: str, tmp_path: Any
) -> None:
    files = {RECORDER_ROLE: tmp_path / "recorder" / "url", PROJECTOR_ROLE: tmp_path / "p" / "url"}
    env = {"TRAJSTORE_RECORDER_DATABASE_URL_FILE": str(files[RECORDER_ROLE]),
           "TRAJSTORE_PROJECTOR_DATABASE_URL_FILE": str(files[PROJECTOR_ROLE])}  # fmt: skip

    async def urls_after_migrate() -> dict[str, str]:
        await migrate(database_url, **env)
        return {role: path.read_text().strip() for role, path in files.items()}

    first = await urls_after_migrate()
    for role, url in first.items():
        parsed = make_url(url)
        assert parsed.username == role and parsed.password  # a generated password
        assert files[role].stat().st_mode & 0o077 == 0  # readable by its process alone
        conn = await connect(url)
        try:
            assert await conn.fetchval("SELECT current_user") == role
        finally:
            await conn.close()
    assert await urls_after_migrate() == first  # migrating again keeps the URLs the processes hold
    # The proxy's side reads its file, and nothing of the owner's.
    settings = StoreSettings(recorder_database_url_file=files[RECORDER_ROLE])
    assert role_database_url(RECORDER_ROLE, settings) == first[RECORDER_ROLE]


async def test_a_role_that_does_not_exist_yet_says_to_migrate(database_url: str) -> None:
    missing = make_url(database_url).set(username="trajstore_not_made_yet")
    with pytest.raises(SchemaNotReady, match="trajstore migrate"):
        await EventStore.open(missing.render_as_string(hide_password=False))
