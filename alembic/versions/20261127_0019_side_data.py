"""Per-token side data (`store.side_data`): teacher logprobs, their top-k, MoE routed experts.

`events` gains `side_data` (bytea, lz4 where the server has it): the packed typed arrays a
`side_data_recorded` / `sample_scored` payload describes. `samples` gains `side` (jsonb, the
arrays' specs) and `side_data` (bytea): turn-level side data aligned with `token_ids`. Rows
recorded or projected before have NULL: nothing to align. For people: the views `side_data`
(one row per array of every side-data fact) and `scoring_failures`, and the functions
`trajstore_float32s(bytea)` / `trajstore_uints(bytea, width)` that decode packed arrays.

Adding a nullable column without a default rewrites no row (a catalog change only).

Revision ID: 0019_side_data
Revises: 0018_version_spans
Create Date: 2026-11-27
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0019_side_data"
down_revision: str | None = "0018_version_spans"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_SIDE_DATA_VIEW = """CREATE VIEW side_data AS
SELECT
    e.session_id,
    e.run_id,
    e.event_type,
    (e.payload ->> 'sample_id')::uuid AS sample_id,
    e.payload ->> 'request_id' AS request_id,
    e.payload ->> 'kind' AS kind,
    e.payload ->> 'source' AS source,
    (e.payload ->> 'n_tokens')::integer AS n_tokens,
    (e.payload ->> 'mean_logprob')::double precision AS mean_logprob,
    (e.payload ->> 'mean_reverse_kl')::double precision AS mean_reverse_kl,
    a.spec ->> 'name' AS name,
    a.spec ->> 'dtype' AS dtype,
    ARRAY(SELECT jsonb_array_elements_text(a.spec -> 'shape')::integer) AS shape,
    substring(e.side_data FROM (a.spec ->> 'offset')::integer + 1
              FOR (a.spec ->> 'nbytes')::integer) AS data,
    e.recorded_at,
    e.position
FROM events e
CROSS JOIN LATERAL jsonb_array_elements(e.payload -> 'arrays') AS a (spec)
WHERE e.event_type IN ('side_data_recorded', 'sample_scored')"""

_SCORING_FAILURES_VIEW = """CREATE VIEW scoring_failures AS
SELECT
    e.session_id,
    e.run_id,
    (e.payload ->> 'sample_id')::uuid AS sample_id,
    e.payload ->> 'kind' AS kind,
    e.payload ->> 'source' AS source,
    e.payload ->> 'reason' AS reason,
    e.payload ->> 'message' AS message,
    e.recorded_at,
    e.position
FROM events e
WHERE e.event_type = 'scoring_failed'"""

_FLOAT32S = """CREATE FUNCTION trajstore_float32s(data bytea) RETURNS real[]
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
    out real[] := '{}';
    bits bigint;
    exponent integer;
    fraction bigint;
    sign integer;
BEGIN
    FOR i IN 0 .. length(data) / 4 - 1 LOOP
        -- PostgreSQL gives | and << one precedence, left to right: hence the parentheses.
        bits := get_byte(data, 4 * i)::bigint | (get_byte(data, 4 * i + 1)::bigint << 8)
              | (get_byte(data, 4 * i + 2)::bigint << 16)
              | (get_byte(data, 4 * i + 3)::bigint << 24);
        sign := CASE WHEN bits >> 31 = 1 THEN -1 ELSE 1 END;
        exponent := (bits >> 23) & 255;
        fraction := bits & 8388607;
        out := out || CASE
            WHEN exponent = 255 AND fraction <> 0 THEN 'NaN'::real
            WHEN exponent = 255 THEN sign * 'Infinity'::real
            WHEN exponent = 0 THEN (sign * fraction * 2.0 ^ (-149))::real
            ELSE (sign * (8388608 + fraction) * 2.0 ^ (exponent - 150))::real
        END;
    END LOOP;
    RETURN out;
END
$$"""

_UINTS = """CREATE FUNCTION trajstore_uints(data bytea, width integer) RETURNS bigint[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT coalesce(array_agg(
    (SELECT sum(get_byte(data, i * width + b)::bigint << (8 * b))
     FROM generate_series(0, width - 1) AS b) ORDER BY i), '{}')
FROM generate_series(0, length(data) / width - 1) AS i
$$"""

_COMPRESSION = """
DO $$
BEGIN
    ALTER TABLE events ALTER COLUMN side_data SET COMPRESSION lz4;
    ALTER TABLE samples ALTER COLUMN side_data SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN  -- a server built without lz4
    NULL;
END
$$"""


def upgrade() -> None:
    op.execute("ALTER TABLE events ADD COLUMN side_data bytea")
    op.execute("ALTER TABLE samples ADD COLUMN side jsonb")
    op.execute("ALTER TABLE samples ADD COLUMN side_data bytea")
    op.execute(_COMPRESSION)
    for statement in (_SIDE_DATA_VIEW, _SCORING_FAILURES_VIEW, _FLOAT32S, _UINTS):
        op.execute(statement)
    op.execute("GRANT SELECT ON side_data, scoring_failures TO trajstore_reader")


def downgrade() -> None:
    op.execute("DROP FUNCTION trajstore_uints(bytea, integer)")
    op.execute("DROP FUNCTION trajstore_float32s(bytea)")
    op.execute("DROP VIEW scoring_failures")
    op.execute("DROP VIEW side_data")
    op.execute("ALTER TABLE samples DROP COLUMN side_data")
    op.execute("ALTER TABLE samples DROP COLUMN side")
    op.execute("ALTER TABLE events DROP COLUMN side_data")
