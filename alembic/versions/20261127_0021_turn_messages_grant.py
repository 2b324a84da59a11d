"""`trajstore_turn_messages` executable by the reader role only, not by every role (PUBLIC).

The function reads `events` with its owner's rights (SECURITY DEFINER: the `turns` view calls it
for `trajstore_reader`, which may not read `events`). PostgreSQL lets PUBLIC execute a new
function, and every role of the cluster is in PUBLIC: any role that could connect to the
database could have read any session's messages through it. Now only the reader role (and the
owner) may call it.

Revision ID: 0021_turn_messages_grant
Revises: 0020_turns_without_recursion
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0021_turn_messages_grant"
down_revision: str | None = "0020_turns_without_recursion"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_FUNCTION = "trajstore_turn_messages(text, jsonb)"


def upgrade() -> None:
    op.execute(f"REVOKE EXECUTE ON FUNCTION {_FUNCTION} FROM PUBLIC")
    op.execute(f"GRANT EXECUTE ON FUNCTION {_FUNCTION} TO trajstore_reader")


def downgrade() -> None:
    op.execute(f"REVOKE EXECUTE ON FUNCTION {_FUNCTION} FROM trajstore_reader")
    op.execute(f"GRANT EXECUTE ON FUNCTION {_FUNCTION} TO PUBLIC")
