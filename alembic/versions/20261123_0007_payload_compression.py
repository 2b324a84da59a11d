"""Event payloads compressed with lz4 where the server has it (else pglz, as before).

A request_received payload holds the agent's whole request, the conversation so far: tens of
kilobytes per model call for an agent deep into an episode, compressed by PostgreSQL on insert.
With pglz that compression is most of what storing the call costs: measured with agent-sized
sessions (16 turns, a context growing from 4 k to 23 k tokens, its text in each body), writing 50
sessions' events took 1.96 s with pglz and 0.88 s with lz4, for 15% more room (68 -> 78 MB);
reading them back took the same time. Where the server lacks lz4, payloads keep pglz: JSON
text stored uncompressed would take several times the room.

Like 0006, the change is to the catalog alone, affects only new values, and gives up after 2 s
rather than hold appends queued behind its lock request.

Revision ID: 0007_payload_compression
Revises: 0006_token_compression
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0007_payload_compression"
down_revision: str | None = "0006_token_compression"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s'"

# Written out, not imported: a revision keeps the statements it was written with.
_UPGRADE = """
DO $$
BEGIN
    ALTER TABLE events ALTER COLUMN payload SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN  -- a server built without lz4 keeps pglz
    NULL;
END
$$"""


def upgrade() -> None:
    op.execute(_LOCK_TIMEOUT)
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_LOCK_TIMEOUT)
    op.execute("ALTER TABLE events ALTER COLUMN payload SET COMPRESSION default")
