"""The roles trajstore's processes connect as: least privilege in PostgreSQL.

    role                 who                  may
    (the owner)          migrations only      everything, the immutability triggers included
    trajstore_recorder   the proxy            read events and append to them; nothing else
    trajstore_projector  the projector        read events; write samples, projection_serving
                                              and projection_checkpoints
    trajstore_reader     people (store.views) read the views and samples

Neither process role owns a table, so neither can ALTER TABLE events DISABLE TRIGGER, and the
triggers refuse UPDATE, DELETE and TRUNCATE of events to everyone: a process that goes wrong, or
is taken over, can add to the log but never rewrite it.

The process roles are LOGIN roles without a password. Which URL a process connects with
(`store.embedded.role_database_url`):
1. its own when configured (`TRAJSTORE_RECORDER_DATABASE_URL`, `TRAJSTORE_PROJECTOR_DATABASE_URL`);
2. else the one in its URL file (`TRAJSTORE_RECORDER_DATABASE_URL_FILE`, `..._PROJECTOR_...`),
   which `trajstore migrate` writes, as the owner, with a password it generates and sets (compose
   hands each process a volume with its own file and no owner URL at all);
3. else, on the embedded server, whose Unix socket trusts local users, the owner's URL with the
   role as the user;
4. else the one configured URL, as before, and the process logs that it runs as that user.
`trajstore migrate` also sets passwords given as `TRAJSTORE_RECORDER_DB_PASSWORD` and
`TRAJSTORE_PROJECTOR_DB_PASSWORD`, for operators who hand out URLs themselves.

Roles belong to the whole cluster: created once if missing, never dropped by a downgrade, which
only takes their grants away.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path
from typing import Literal

from sqlalchemy.engine import make_url

from trajstore.store.errors import StoreError

log = logging.getLogger(__name__)

Role = Literal["trajstore_recorder", "trajstore_projector"]
RECORDER_ROLE: Role = "trajstore_recorder"
PROJECTOR_ROLE: Role = "trajstore_projector"

#: The projector's tables (store.schema): the samples and its own bookkeeping.
PROJECTOR_TABLES = "samples, projection_serving, projection_checkpoints"


def create_role(role: str, *, login: bool = True) -> str:
    """The statement that creates `role` unless the cluster has it (roles outlive databases)."""
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} {"LOGIN" if login else "NOLOGIN"};
    END IF;
END
$$"""


#: What `upgrade` runs, in order, after the tables exist.
CREATE = [
    create_role(RECORDER_ROLE),
    create_role(PROJECTOR_ROLE),
    f"GRANT USAGE ON SCHEMA public TO {RECORDER_ROLE}, {PROJECTOR_ROLE}",
    f"GRANT SELECT, INSERT ON events TO {RECORDER_ROLE}",
    f"GRANT SELECT ON events TO {PROJECTOR_ROLE}",
    # Appends look up sealed days' stream versions there; only the store's functions write it.
    f"GRANT SELECT ON event_keys TO {RECORDER_ROLE}",
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {PROJECTOR_TABLES} TO {PROJECTOR_ROLE}",
]

#: What `downgrade` runs, in order, before the tables go (the roles stay: see above).
DROP = [
    f"REVOKE SELECT, INSERT, UPDATE, DELETE ON {PROJECTOR_TABLES} FROM {PROJECTOR_ROLE}",
    f"REVOKE SELECT ON event_keys FROM {RECORDER_ROLE}",
    f"REVOKE SELECT ON events FROM {PROJECTOR_ROLE}",
    f"REVOKE SELECT, INSERT ON events FROM {RECORDER_ROLE}",
    f"REVOKE USAGE ON SCHEMA public FROM {RECORDER_ROLE}, {PROJECTOR_ROLE}",
]


async def set_password(owner_url: str, role: Role, password: str) -> None:
    """Give `role` a password (as the owner), so that it can log in over TCP."""
    from trajstore.store.connection import connect

    conn = await connect(owner_url)
    try:
        quoted = await conn.fetchval("SELECT quote_literal($1)", password)
        await conn.execute(f"ALTER ROLE {role} PASSWORD {quoted}")
    finally:
        await conn.close()


def write_url_file(owner_url: str, role: Role, path: Path) -> None:
    """Give `role` a password and write its URL to `path` (0600): the owner's URL with the role
    and that password. A file already there keeps its password (set again: idempotent).
    Synchronous: for the command line."""
    if path.exists():
        password = make_url(read_url_file(path)).password or ""
    else:
        password = secrets.token_urlsafe(24)
    asyncio.run(set_password(owner_url, role, password))
    url = make_url(owner_url).set(username=role, password=password)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".tmp")
    temporary.write_text(url.render_as_string(hide_password=False) + "\n")
    temporary.chmod(0o600)
    temporary.replace(path)


def read_url_file(path: Path) -> str:
    """The URL in a role's URL file."""
    try:
        return path.read_text().strip()
    except OSError as exc:
        raise StoreError(
            f"cannot read the database URL file {path} ({exc}); `trajstore migrate` writes it "
            "when given the same TRAJSTORE_*_DATABASE_URL_FILE setting"
        ) from exc


def as_role(url: str, role: Role) -> str:
    """`url` with `role` as its user and no password (for a server that trusts local users)."""
    return make_url(url).set(username=role, password=None).render_as_string(hide_password=False)


def url_for(role: Role, owner_url: str, configured: str | None, *, embedded: bool) -> str:
    """The URL a process of `role` connects with (see the module docstring)."""
    if configured:
        return configured
    if embedded:
        return as_role(owner_url, role)
    log.warning(
        "the %s connects as the database URL's user, which may own the tables; set "
        "TRAJSTORE_%s_DATABASE_URL to a %s login for least privilege (docs/stack.md)",
        role.removeprefix("trajstore_"), role.removeprefix("trajstore_").upper(), role,
    )  # fmt: skip
    return owner_url
