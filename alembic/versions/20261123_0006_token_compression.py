"""Token arrays compressed with lz4 where the server has it, else stored uncompressed.

PostgreSQL compresses a row's large values with pglz by default. For packed token ids and
logprobs pglz is slow and gains little (int32 ids of text barely compress): measured on 1,000
projected four-turn sessions, COPYing their samples cost PostgreSQL 40 ms of CPU with pglz, 20 ms
with lz4 or with no compression at all, and lz4 still halves the logprobs (float32 values share
their exponent bytes). The projector's COPY and every proxied prompt's append pay it.

lz4 needs a server built with it (Debian's and the official images are; the embedded pgserver
build is not): there the arrays are stored out of line uncompressed (STORAGE EXTERNAL) instead,
and the loss mask, whose runs of 0 and 1 pglz shrinks many times over, keeps pglz.
Both forms change only how new values are stored; values already written stay as they are. The
change is to the catalog alone, but it takes an ACCESS EXCLUSIVE lock on `events`: run beside a
busy proxy, the migration gives up after 2 s (and can simply be run again) rather than hold every
append queued behind its lock request while it waits for a long reader to finish.

Revision ID: 0006_token_compression
Revises: 0005_facts_index
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0006_token_compression"
down_revision: str | None = "0005_facts_index"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_UPGRADE = """
DO $$
BEGIN
    ALTER TABLE events ALTER COLUMN token_ids SET COMPRESSION lz4,
        ALTER COLUMN logprobs SET COMPRESSION lz4;
    ALTER TABLE samples ALTER COLUMN token_ids SET COMPRESSION lz4,
        ALTER COLUMN loss_mask SET COMPRESSION lz4,
        ALTER COLUMN logprobs SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN  -- a server built without lz4
    ALTER TABLE events ALTER COLUMN token_ids SET STORAGE EXTERNAL,
        ALTER COLUMN logprobs SET STORAGE EXTERNAL;
    ALTER TABLE samples ALTER COLUMN token_ids SET STORAGE EXTERNAL,
        ALTER COLUMN logprobs SET STORAGE EXTERNAL;
END
$$"""

_DOWNGRADE = [
    f"ALTER TABLE {table} ALTER COLUMN {column} SET COMPRESSION default, "
    f"ALTER COLUMN {column} SET STORAGE EXTENDED"
    for table, columns in (
        ("events", ("token_ids", "logprobs")),
        ("samples", ("token_ids", "loss_mask", "logprobs")),
    )
    for column in columns
]


_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '2s'"


def upgrade() -> None:
    op.execute(_LOCK_TIMEOUT)
    op.execute(_UPGRADE)


def downgrade() -> None:
    op.execute(_LOCK_TIMEOUT)
    for statement in _DOWNGRADE:
        op.execute(statement)
