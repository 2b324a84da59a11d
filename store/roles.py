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
(`url_for`): its own when configured (`TRAJSTORE_RECORDER_DATABASE_URL`,
`TRAJSTORE_PROJECTOR_DATABASE_URL`); else, on the embedded server, whose Unix socket trusts local
users, the owner's URL with the role as the user; else the one configured URL, as before (the
operator then gives the roles passwords, for example with `trajstore migrate`, which sets them
from `TRAJSTORE_RECORDER_DB_PASSWORD` and `TRAJSTORE_PROJECTOR_DB_PASSWORD`, and hands each
process its URL). Roles belong to the whole cluster: created once if missing, never dropped by a
downgrade, which only takes their grants away.
"""

from __future__ import annotations

import logging
from typing import Literal

from sqlalchemy.engine import make_url

log = logging.getLogger(__name__)

Role = Literal["trajstore_recorder", "trajstore_projector"]
RECORDER_ROLE: Role = "trajstore_recorder"
PROJECTOR_ROLE: Role = "trajstore_projector"

#: The projector's tables (store.schema): the samples and its own bookkeeping.
PROJECTOR_TABLES = "samples, projection_serving, projection_checkpoints"


def _create_role(role: str) -> str:
    return f"""
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} LOGIN;
    END IF;
END
$$"""


#: What `upgrade` runs, in order, after the tables exist.
CREATE = [
    _create_role(RECORDER_ROLE),
    _create_role(PROJECTOR_ROLE),
    f"GRANT USAGE ON SCHEMA public TO {RECORDER_ROLE}, {PROJECTOR_ROLE}",
    f"GRANT SELECT, INSERT ON events TO {RECORDER_ROLE}",
    f"GRANT SELECT ON events TO {PROJECTOR_ROLE}",
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {PROJECTOR_TABLES} TO {PROJECTOR_ROLE}",
]

#: What `downgrade` runs, in order, before the tables go (the roles stay: see above).
DROP = [
    f"REVOKE SELECT, INSERT, UPDATE, DELETE ON {PROJECTOR_TABLES} FROM {PROJECTOR_ROLE}",
    f"REVOKE SELECT ON events FROM {PROJECTOR_ROLE}",
    f"REVOKE SELECT, INSERT ON events FROM {RECORDER_ROLE}",
    f"REVOKE USAGE ON SCHEMA public FROM {RECORDER_ROLE}, {PROJECTOR_ROLE}",
]


async def set_password(owner_url: str, role: Role, password: str) -> None:
    """Give `role` a password (as the owner), so that it can log in over TCP."""
    from store.connection import connect

    conn = await connect(owner_url)
    try:
        quoted = await conn.fetchval("SELECT quote_literal($1)", password)
        await conn.execute(f"ALTER ROLE {role} PASSWORD {quoted}")
    finally:
        await conn.close()


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
