"""Policy versions per token: `samples.version_spans`, and the views `policy_switches`,
`turn_versions` and `sample_versions`.

From this version on the proxy switches weights without a drain (`proxy.switching`): a turn in
flight at a switch continues on the new version, and each turn records which version generated
which of its tokens (`version_spans` in completion_finished and request_failed). Every switch is
in the log (`policy_switch_began`, then `policy_switch_live` or `policy_switch_failed`). The
projection carries the spans into samples, in sample coordinates; rows projected before have
NULL (a rebuild fills them; older turns have one version each, their request's).

Revision ID: 0018_version_spans
Revises: 0017_partition_keys
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0018_version_spans"
down_revision: str | None = "0017_partition_keys"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_POLICY_SWITCHES = """
CREATE VIEW policy_switches AS
SELECT
    b.payload ->> 'switch_id' AS switch_id,
    b.payload ->> 'version' AS version,
    b.payload -> 'engines' AS engines,
    b.payload ->> 'checkpoint' AS checkpoint,
    to_timestamp((b.payload ->> 'began_at')::float8) AS began_at,
    CASE e.event_type
        WHEN 'policy_switch_live' THEN 'live'
        WHEN 'policy_switch_failed' THEN 'failed'
        ELSE 'switching'
    END AS outcome,
    to_timestamp(coalesce(e.payload ->> 'live_at', e.payload ->> 'failed_at')::float8)
        AS ended_at,
    coalesce(e.payload ->> 'live_at', e.payload ->> 'failed_at')::float8
        - (b.payload ->> 'began_at')::float8 AS seconds,
    coalesce((b.payload ->> 'interrupted')::int, 0) AS interrupted,
    e.payload ->> 'reason' AS reason
FROM events b
LEFT JOIN events e
  ON e.stream_id = b.stream_id AND e.stream_version = 2
 AND e.event_type IN ('policy_switch_live', 'policy_switch_failed')
WHERE b.event_type = 'policy_switch_began'
"""

_TURN_VERSIONS = """
CREATE VIEW turn_versions AS
SELECT
    e.session_id,
    e.run_id,
    substr(e.stream_id, 9) AS request_id,
    e.event_type = 'completion_finished' AS completed,
    e.recorded_at AS ended_at,
    s.spans AS version_spans,
    jsonb_array_length(s.spans) AS n_versions,
    jsonb_array_length(s.spans) > 1 AS straddled,
    s.spans -> 0 ->> 'version' AS first_version,
    s.spans -> -1 ->> 'version' AS last_version,
    CASE WHEN s.spans -> 0 ->> 'version' ~ '^-?[0-9]{1,18}$'
          AND s.spans -> -1 ->> 'version' ~ '^-?[0-9]{1,18}$'
         THEN (s.spans -> -1 ->> 'version')::bigint - (s.spans -> 0 ->> 'version')::bigint
    END AS version_lag
FROM events e
CROSS JOIN LATERAL (
    SELECT CASE e.event_type
        WHEN 'completion_finished' THEN e.payload -> 'choices' -> 0 -> 'version_spans'
        ELSE e.payload -> 'version_spans' -> '0'
    END AS spans
) s
WHERE e.event_type IN ('completion_finished', 'request_failed')
  AND jsonb_typeof(s.spans) = 'array'
  AND jsonb_array_length(s.spans) > 0
"""

_SAMPLE_VERSIONS = """
CREATE VIEW sample_versions AS
SELECT
    sample_id,
    projection_version,
    session_id,
    run_id,
    version_spans,
    policy_version_min,
    policy_version_max,
    policy_version_max - policy_version_min AS version_lag
FROM samples
"""

_VIEWS = "policy_switches, turn_versions, sample_versions"


def upgrade() -> None:
    op.execute("ALTER TABLE samples ADD COLUMN version_spans jsonb")
    op.execute(_POLICY_SWITCHES)
    op.execute(_TURN_VERSIONS)
    op.execute(_SAMPLE_VERSIONS)
    op.execute(f"GRANT SELECT ON {_VIEWS} TO trajstore_reader")


def downgrade() -> None:
    op.execute(f"REVOKE SELECT ON {_VIEWS} FROM trajstore_reader")
    op.execute("DROP VIEW sample_versions")
    op.execute("DROP VIEW turn_versions")
    op.execute("DROP VIEW policy_switches")
    op.execute("ALTER TABLE samples DROP COLUMN version_spans")
