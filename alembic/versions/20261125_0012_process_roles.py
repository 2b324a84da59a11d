"""The roles the proxy and the projector connect as: `trajstore_recorder` may read and append
events, `trajstore_projector` may read events and write the samples (`store.roles`). Neither owns
a table, so neither can disable the immutability triggers; migrations keep running as the owner.

Roles belong to the whole cluster: created if missing, never dropped (a downgrade takes their
grants away), as 0003 does for `trajstore_reader`.

Revision ID: 0012_process_roles
Revises: 0011_session_lifecycle
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0012_process_roles"
down_revision: str | None = "0011_session_lifecycle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Written out, not imported: a revision keeps the statements it was written with.
def _create_role(role: str) -> str:
    return f"""DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN
        CREATE ROLE {role} LOGIN;
    END IF;
END
$$"""


_TABLES = "samples, projection_serving, projection_checkpoints"

_UPGRADE = [
    _create_role("trajstore_recorder"),
    _create_role("trajstore_projector"),
    "GRANT USAGE ON SCHEMA public TO trajstore_recorder, trajstore_projector",
    "GRANT SELECT, INSERT ON events TO trajstore_recorder",
    "GRANT SELECT ON events TO trajstore_projector",
    f"GRANT SELECT, INSERT, UPDATE, DELETE ON {_TABLES} TO trajstore_projector",
]

_DOWNGRADE = [
    f"REVOKE SELECT, INSERT, UPDATE, DELETE ON {_TABLES} FROM trajstore_projector",
    "REVOKE SELECT ON events FROM trajstore_projector",
    "REVOKE SELECT, INSERT ON events FROM trajstore_recorder",
    "REVOKE USAGE ON SCHEMA public FROM trajstore_recorder, trajstore_projector",
]


def upgrade() -> None:
    for statement in _UPGRADE:
        op.execute(statement)


def downgrade() -> None:
    for statement in _DOWNGRADE:
        op.execute(statement)
