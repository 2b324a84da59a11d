"""A partial index on the session lifecycle: which sessions were created and which finished.

The proxy's reaper (`proxy.reaper`) looks, every few seconds, for the sessions still active (a
`session_created` and no `session_finished`), to fail the turns of replicas that died and to
finish the sessions nobody finished. Without an index that is a scan of the whole log; with this
one, an index-only scan of two small events per session.

Built CONCURRENTLY, as 0005 is, for the same reasons: a plain CREATE INDEX would hold back every
append while it scans a long log; a rerun after a build cut off half-way drops it first.

Revision ID: 0011_session_lifecycle
Revises: 0010_prompt_source
Create Date: 2026-11-25
"""

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0011_session_lifecycle"
down_revision: str | None = "0010_prompt_source"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the predicate it was written with.
_LIFECYCLE = "event_type IN ('session_created', 'session_finished')"


def upgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_events_session_lifecycle",
            table_name="events",
            postgresql_concurrently=True,
            if_exists=True,
        )
        op.create_index(
            "ix_events_session_lifecycle",
            "events",
            ["session_id", "event_type"],
            postgresql_where=sa.text(_LIFECYCLE),
            postgresql_concurrently=True,
        )


def downgrade() -> None:
    with op.get_context().autocommit_block():
        op.drop_index(
            "ix_events_session_lifecycle", table_name="events", postgresql_concurrently=True
        )
