"""`turns.prompt_tokens` counts a prompt stored as a reference to the session's previous turn.

From this version on, the proxy stores a prompt that continues the session's last turn as a
reference to that turn plus its new tokens (the prompt_tokens contract in `store.sessions`), so
the event's token array holds only the new tokens and its payload's `n_tokens` the whole
prompt's length. The view reads `n_tokens` where it is set, the array's length otherwise (every
event written before). `CREATE OR REPLACE` keeps the view's grants and the `trajectories` view
built on it.

Revision ID: 0008_prompt_references
Revises: 0007_payload_compression
Create Date: 2026-11-23
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0008_prompt_references"
down_revision: str | None = "0007_payload_compression"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_TURNS = """
CREATE OR REPLACE VIEW turns AS
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
    SELECT coalesce((payload ->> 'n_tokens')::int, octet_length(token_ids) / 4) AS prompt_tokens
    FROM events
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

# Before: the array's length alone.
_COUNT = "coalesce((payload ->> 'n_tokens')::int, octet_length(token_ids) / 4) AS prompt_tokens"
_COUNT_BEFORE = "octet_length(token_ids) / 4 AS prompt_tokens"
assert _COUNT in _TURNS
_TURNS_BEFORE = _TURNS.replace(_COUNT, _COUNT_BEFORE)


def upgrade() -> None:
    op.execute(_TURNS)


def downgrade() -> None:
    op.execute(_TURNS_BEFORE)
