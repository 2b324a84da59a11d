"""Training samples (a rebuildable projection of the log) and projection checkpoints.

Revision ID: 0002_samples
Revises: 0001_events
Create Date: 2026-11-22
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op

revision: str = "0002_samples"
down_revision: str | None = "0001_events"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


class _XID8(sa.types.UserDefinedType[int]):
    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


def upgrade() -> None:
    op.create_table(
        "samples",
        sa.Column("sample_id", postgresql.UUID(as_uuid=True), nullable=False),
        sa.Column("projection_version", sa.Integer, nullable=False),
        sa.Column("session_id", sa.Text, nullable=False),
        sa.Column("run_id", sa.Text),
        sa.Column("task_id", sa.Text),
        sa.Column("group_id", sa.Text),
        sa.Column("branch", sa.Integer, nullable=False),
        sa.Column("alternative_of", sa.Integer),
        sa.Column("is_final", sa.Boolean, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("finish_reason", sa.Text),
        sa.Column("reward", sa.Double),
        sa.Column("token_ids", sa.LargeBinary, nullable=False),
        sa.Column("loss_mask", sa.LargeBinary, nullable=False),
        sa.Column("logprobs", sa.LargeBinary, nullable=False),
        sa.Column("prompt_len", sa.Integer, nullable=False),
        sa.Column("response_len", sa.Integer, nullable=False),
        sa.Column("n_turns", sa.Integer, nullable=False),
        sa.Column("tool_turns", sa.Integer, nullable=False),
        sa.Column("policy_versions", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("engines", postgresql.ARRAY(sa.Text), nullable=False),
        sa.Column("divergence", postgresql.JSONB),
        sa.Column("last_position", sa.BigInteger, nullable=False),
        sa.Column(
            "projected_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.PrimaryKeyConstraint("sample_id", name="pk_samples"),
    )
    op.create_index(
        "ix_samples_projection_version_run_id", "samples", ["projection_version", "run_id"]
    )
    op.create_index("ix_samples_session_id", "samples", ["session_id"])
    op.create_table(
        "projection_checkpoints",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("tx_id", _XID8(), nullable=False),
        sa.Column("position", sa.BigInteger, nullable=False),
        sa.Column(
            "updated_at",
            postgresql.TIMESTAMP(timezone=True),
            nullable=False,
            server_default=sa.text("now()"),
        ),
        sa.PrimaryKeyConstraint("name", "version", name="pk_projection_checkpoints"),
    )


def downgrade() -> None:
    op.drop_table("projection_checkpoints")
    op.drop_table("samples")
