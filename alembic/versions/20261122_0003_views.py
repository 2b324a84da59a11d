"""SQL for people: `turns` and `trajectories` views, the `trajstore_reader` role; samples gain
what the trainer selects and tails by (tags, times, integer policy versions, commit order) and
a served projection version, so a rebuild can be written beside the version in use.

Revision ID: 0003_views
Revises: 0002_samples
Create Date: 2026-11-22
"""

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from store import views

revision: str = "0003_views"
down_revision: str | None = "0002_samples"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


class _XID8(sa.types.UserDefinedType[int]):
    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


_TIMESTAMP = postgresql.TIMESTAMP(timezone=True)


def upgrade() -> None:
    op.add_column(
        "samples",
        sa.Column(
            "tags",
            postgresql.ARRAY(sa.Text),
            nullable=False,
            server_default=sa.text("'{}'::text[]"),
        ),
    )
    op.add_column(
        "samples",
        sa.Column(
            "request_ids",
            postgresql.ARRAY(sa.Text),
            nullable=False,
            server_default=sa.text("'{}'::text[]"),
        ),
    )
    op.add_column("samples", sa.Column("created_at", _TIMESTAMP))
    op.add_column("samples", sa.Column("finished_at", _TIMESTAMP))
    op.add_column("samples", sa.Column("policy_version_min", sa.BigInteger))
    op.add_column("samples", sa.Column("policy_version_max", sa.BigInteger))
    op.add_column(
        "samples",
        sa.Column(
            "projected_tx", _XID8(), nullable=False, server_default=sa.text("pg_current_xact_id()")
        ),
    )
    op.add_column(
        "samples",
        sa.Column("projected_seq", sa.BigInteger, sa.Identity(always=True), nullable=False),
    )
    op.drop_constraint("pk_samples", "samples")
    op.create_primary_key("pk_samples", "samples", ["projection_version", "sample_id"])
    op.create_index(
        "ix_samples_projected_tx_projected_seq", "samples", ["projected_tx", "projected_seq"]
    )
    op.create_table(
        "projection_serving",
        sa.Column("name", sa.Text, nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
        sa.Column("switched_at", _TIMESTAMP, nullable=False, server_default=sa.text("now()")),
        sa.PrimaryKeyConstraint("name", name="pk_projection_serving"),
    )
    for statement in views.CREATE:
        op.execute(statement)


def downgrade() -> None:
    for statement in views.DROP:
        op.execute(statement)
    op.drop_table("projection_serving")
    op.drop_index("ix_samples_projected_tx_projected_seq", "samples")
    op.drop_constraint("pk_samples", "samples")
    op.create_primary_key("pk_samples", "samples", ["sample_id"])
    for column in (
        "projected_seq", "projected_tx", "policy_version_max", "policy_version_min",
        "finished_at", "created_at", "request_ids", "tags",
    ):  # fmt: skip
        op.drop_column("samples", column)
