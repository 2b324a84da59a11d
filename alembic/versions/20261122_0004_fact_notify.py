"""Session facts get a NOTIFY channel of their own, so their listeners sleep through tokens.

The projector and the proxy replicas act on finishes, discards and rewards only; woken by the
notification every insert sends, they read the log after every batch of chunk events the
proxy's writer commits (measured: at one stream at a time, that tripled PostgreSQL's CPU per
request). A row-level trigger with a WHEN clause notifies `trajstore_facts` when a fact is
inserted, and costs nothing for other rows.

Revision ID: 0004_fact_notify
Revises: 0003_views
Create Date: 2026-11-22
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0004_fact_notify"
down_revision: str | None = "0003_views"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(
        """
CREATE FUNCTION trajstore_notify_fact() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('trajstore_facts', '');
    RETURN NULL;
END
$$"""
    )
    op.execute(
        "CREATE TRIGGER events_notify_facts AFTER INSERT ON events FOR EACH ROW "
        "WHEN (NEW.event_type IN ('session_finished', 'session_discarded', 'reward_assigned')) "
        "EXECUTE FUNCTION trajstore_notify_fact()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER events_notify_facts ON events")
    op.execute("DROP FUNCTION trajstore_notify_fact()")
