"""The append-only events table, its immutability triggers and its NOTIFY wake-up.

Revision ID: 0001_events
Revises:
Create Date: 2026-11-22
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0001_events"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


class _XID8(sa.types.UserDefinedType[int]):
    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


def upgrade() -> None:
    op.create_table(
        "events",
        sa.Column("position", sa.BigInteger, sa.Identity(always=True), nullable=False),
        sa.Column("tx_id", _XID8(), nullable=False, server_default=sa.text("pg_current_xact_id()")),
        sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("stream_id", sa.Text, nullable=False),
        sa.Column("stream_version", sa.BigInteger, nullable=False),
        sa.Column("session_id", sa.Text),
        sa.Column("run_id", sa.Text),
        sa.Column("event_type", sa.Text, nullable=False),
        sa.Column(
            "recorded_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.Column(
            "payload", postgresql.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")
        ),
        sa.Column("token_ids", sa.LargeBinary),
        sa.Column("logprobs", sa.LargeBinary),
        sa.PrimaryKeyConstraint("position", name="pk_events"),
        sa.UniqueConstraint("event_id", name="uq_events_event_id"),
        sa.UniqueConstraint(
            "stream_id", "stream_version", name="uq_events_stream_id_stream_version"
        ),
    )
    op.create_index("ix_events_tx_id_position", "events", ["tx_id", "position"])
    op.create_index(
        "ix_events_session_id_tx_id_position", "events", ["session_id", "tx_id", "position"]
    )
    op.create_index("ix_events_run_id", "events", ["run_id"])
    op.execute(
        """
CREATE FUNCTION trajstore_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'trajstore events are immutable: % on % is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'Append a new event (a correction, a discard) instead of changing one.';
END
$$"""
    )
    for operation, level in (("UPDATE", "ROW"), ("DELETE", "ROW"), ("TRUNCATE", "STATEMENT")):
        op.execute(
            f"CREATE TRIGGER events_no_{operation.lower()} BEFORE {operation} ON events "
            f"FOR EACH {level} EXECUTE FUNCTION trajstore_refuse_change()"
        )
    op.execute(
        """
CREATE FUNCTION trajstore_notify_append() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('trajstore_events', '');
    RETURN NULL;
END
$$"""
    )
    op.execute(
        "CREATE TRIGGER events_notify AFTER INSERT ON events "
        "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_notify_append()"
    )


def downgrade() -> None:
    op.drop_table("events")  # its triggers go with it
    op.execute("DROP FUNCTION trajstore_notify_append()")
    op.execute("DROP FUNCTION trajstore_refuse_change()")
