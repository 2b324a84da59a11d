"""SQL for people about policy versions: `policy_switches`, `turn_versions`, `sample_versions`.

`policy_switches` — one row per weight switch (`proxy.switching`): the version, the engines, the
checkpoint, when it began and ended, how (`live` | `failed` | `switching`, still under way),
how many turns in flight it cut, and why it failed.

`turn_versions` — one row per recorded turn that says which version generated which of its
tokens (choice 0; turns recorded before spans existed have none): its `version_spans`
`[{version, start, end}]`, how many versions wrote it, `straddled` (more than one: the turn was
generated across a switch — "which turns straddled an update" is `WHERE straddled`), its first
and last version, and `version_lag`, last minus first (integer versions).

`sample_versions` — each sample's `version_spans` over its `token_ids` (generated tokens only),
its oldest and newest version, and `version_lag` (newest minus oldest): how far apart the
policies are whose tokens one training row mixes.

`trajstore_reader` may read all three. The migrations create exactly these statements
(`tests/store/test_schema.py`).
"""

from __future__ import annotations

from trajstore.store.views import READER_ROLE

POLICY_SWITCHES_VIEW = """
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

TURN_VERSIONS_VIEW = """
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

SAMPLE_VERSIONS_VIEW = """
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

#: What `upgrade` runs, in order, after the tables and the other views exist.
CREATE = [
    POLICY_SWITCHES_VIEW,
    TURN_VERSIONS_VIEW,
    SAMPLE_VERSIONS_VIEW,
    f"GRANT SELECT ON policy_switches, turn_versions, sample_versions TO {READER_ROLE}",
]

#: What `downgrade` runs, in order.
DROP = [
    f"REVOKE SELECT ON policy_switches, turn_versions, sample_versions FROM {READER_ROLE}",
    "DROP VIEW sample_versions",
    "DROP VIEW turn_versions",
    "DROP VIEW policy_switches",
]
