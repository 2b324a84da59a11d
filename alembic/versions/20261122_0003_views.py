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

revision: str = "0003_views"
down_revision: str | None = "0002_samples"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


class _XID8(sa.types.UserDefinedType[int]):
    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


_TIMESTAMP = postgresql.TIMESTAMP(timezone=True)


# Written out, not imported from store.views: a revision keeps the statements it was written
# with (later revisions replace the views; importing today's definitions here would create
# columns that those revisions, replaying the history, cannot take away again).
_TURNS = """CREATE VIEW turns AS
SELECT
    r.session_id,
    r.run_id,
    r.payload ->> 'request_id' AS request_id,
    r.position,
    r.recorded_at AS started_at,
    r.payload ->> 'api' AS api,
    r.payload ->> 'engine' AS engine,
    r.payload ->> 'policy_version' AS policy_version,
    (r.payload ->> 'stream')::boolean AS stream,
    r.payload -> 'body' -> 'messages' AS messages,
    r.payload -> 'body' -> 'tools' AS tools,
    r.payload -> 'sampling' AS sampling,
    CASE e.event_type
        WHEN 'completion_finished' THEN 'completed'
        WHEN 'request_failed' THEN 'failed'
        ELSE 'in_progress'
    END AS status,
    e.payload -> 'choices' -> 0 ->> 'finish_reason' AS finish_reason,
    c.completion_text,
    CASE WHEN jsonb_typeof(e.payload -> 'choices' -> 0 -> 'message' -> 'tool_calls') = 'array'
        THEN e.payload -> 'choices' -> 0 -> 'message' -> 'tool_calls'
    END AS tool_calls,
    CASE WHEN jsonb_typeof(e.payload -> 'choices' -> 0 -> 'message' -> 'tool_calls') = 'array'
        THEN jsonb_array_length(e.payload -> 'choices' -> 0 -> 'message' -> 'tool_calls')
        ELSE 0
    END AS n_tool_calls,
    coalesce(p.prompt_tokens, 0) AS prompt_tokens,
    coalesce(c.completion_tokens, 0) AS completion_tokens,
    (e.payload ->> 'latency_s')::float8 AS latency_s,
    (e.payload ->> 'ttft_s')::float8 AS ttft_s,
    CASE WHEN e.event_type = 'request_failed' THEN e.payload ->> 'reason' END AS failure
FROM events r
LEFT JOIN LATERAL (
    SELECT octet_length(token_ids) / 4 AS prompt_tokens FROM events
    WHERE stream_id = r.stream_id AND event_type = 'prompt_tokens'
    LIMIT 1
) p ON true
LEFT JOIN LATERAL (
    SELECT
        string_agg(payload ->> 'text', '' ORDER BY stream_version)
            FILTER (WHERE coalesce((payload ->> 'choice')::int, 0) = 0) AS completion_text,
        sum(octet_length(token_ids) / 4)::int AS completion_tokens
    FROM events
    WHERE stream_id = r.stream_id AND event_type = 'completion_chunk'
) c ON true
LEFT JOIN LATERAL (
    SELECT event_type, payload FROM events
    WHERE stream_id = r.stream_id AND event_type IN ('completion_finished', 'request_failed')
    ORDER BY stream_version DESC
    LIMIT 1
) e ON true
WHERE r.event_type = 'request_received'
"""

_TRAJECTORIES = """CREATE VIEW trajectories AS
SELECT
    s.session_id,
    s.run_id,
    s.payload ->> 'task_id' AS task_id,
    s.payload ->> 'group_id' AS group_id,
    s.payload -> 'metadata' AS metadata,
    s.recorded_at AS created_at,
    f.recorded_at AS finished_at,
    coalesce(f.payload ->> 'status', 'active') AS status,
    f.payload ->> 'reason' AS finish_reason,
    d.session_id IS NOT NULL AS discarded,
    d.payload ->> 'reason' AS discard_reason,
    (w.payload ->> 'value')::float8 AS reward,
    coalesce(t.turns, 0) AS turns,
    coalesce(t.tool_turns, 0) AS tool_turns,
    coalesce(t.failed_turns, 0) AS failed_turns,
    coalesce(t.prompt_tokens, 0) AS prompt_tokens,
    coalesce(t.completion_tokens, 0) AS completion_tokens,
    extract(epoch FROM f.recorded_at - s.recorded_at)::float8 AS duration_s,
    coalesce(t.engines, '{}') AS engines,
    coalesce(t.policy_versions, '{}') AS policy_versions,
    coalesce(v.divergences, 0) AS divergences,
    coalesce(v.divergence_reasons, '{}') AS divergence_reasons
FROM events s
LEFT JOIN LATERAL (
    SELECT payload, recorded_at FROM events
    WHERE session_id = s.session_id AND event_type = 'session_finished'
    ORDER BY tx_id DESC, position DESC
    LIMIT 1
) f ON true
LEFT JOIN LATERAL (
    SELECT session_id, payload FROM events
    WHERE session_id = s.session_id AND event_type = 'session_discarded'
    ORDER BY tx_id DESC, position DESC
    LIMIT 1
) d ON true
LEFT JOIN LATERAL (
    SELECT payload FROM events
    WHERE session_id = s.session_id AND event_type = 'reward_assigned'
    ORDER BY tx_id DESC, position DESC
    LIMIT 1
) w ON true
LEFT JOIN LATERAL (
    SELECT
        count(*)::int AS turns,
        (count(*) FILTER (WHERE n_tool_calls > 0))::int AS tool_turns,
        (count(*) FILTER (WHERE status = 'failed'))::int AS failed_turns,
        sum(prompt_tokens)::int AS prompt_tokens,
        sum(completion_tokens)::int AS completion_tokens,
        array_agg(DISTINCT engine) FILTER (WHERE engine IS NOT NULL) AS engines,
        array_agg(DISTINCT policy_version)
            FILTER (WHERE policy_version IS NOT NULL) AS policy_versions
    FROM turns WHERE session_id = s.session_id
) t ON true
LEFT JOIN LATERAL (
    SELECT
        (count(*) FILTER (WHERE divergence IS NOT NULL))::int AS divergences,
        array_agg(divergence ->> 'reason' ORDER BY branch)
            FILTER (WHERE divergence IS NOT NULL) AS divergence_reasons
    FROM samples
    WHERE session_id = s.session_id
      AND alternative_of IS NULL
      AND projection_version = (
          SELECT version FROM projection_serving WHERE name = 'samples'
      )
) v ON true
WHERE s.event_type = 'session_created'
"""

_CREATE_READER_ROLE = """DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'trajstore_reader') THEN
        CREATE ROLE trajstore_reader NOLOGIN;
    END IF;
END
$$"""

_CREATE = [
    _TURNS,
    _TRAJECTORIES,
    _CREATE_READER_ROLE,
    "GRANT USAGE ON SCHEMA public TO trajstore_reader",
    "GRANT SELECT ON turns, trajectories, samples TO trajstore_reader",
]

_DROP = [
    "REVOKE SELECT ON turns, trajectories, samples FROM trajstore_reader",
    "REVOKE USAGE ON SCHEMA public FROM trajstore_reader",
    "DROP VIEW trajectories",
    "DROP VIEW turns",
]


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
    for statement in _CREATE:
        op.execute(statement)


def downgrade() -> None:
    for statement in _DROP:
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
