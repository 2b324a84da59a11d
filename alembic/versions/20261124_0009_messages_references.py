"""`turns.messages` follows a request's messages stored as a reference to an earlier turn's.

From this version on, the proxy stores a request whose messages continue the session's previous
turn's as `messages_prefix: {request_id, n_messages}` plus only the new messages in
`body.messages` (the request_received contract in `store.sessions`): an agent re-sends its whole
conversation every turn, and storing it whole made request bodies most of an agent session's
bytes. The view follows the chain back to a turn stored whole and gives the whole list (NULL when
the counts do not add up); rows without a reference read as before. `CREATE OR REPLACE` keeps the
view's grants and the `trajectories` view built on it.

Revision ID: 0009_messages_references
Revises: 0008_prompt_references
Create Date: 2026-11-24
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0009_messages_references"
down_revision: str | None = "0008_prompt_references"
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
    CASE WHEN r.payload ? 'messages_prefix' THEN (
        -- Stored as a reference to an earlier turn's messages plus the new ones (the
        -- request_received contract in store.sessions): follow the chain back to a turn stored
        -- whole, and give the whole list only when the counts add up (never a guess).
        WITH RECURSIVE chain (payload, depth) AS (
            SELECT r.payload, 0
            UNION ALL
            SELECT earlier.payload, chain.depth + 1
            FROM chain
            JOIN events earlier
              ON earlier.stream_id
                 = 'request-' || (chain.payload -> 'messages_prefix' ->> 'request_id')
             AND earlier.event_type = 'request_received'
            WHERE chain.payload ? 'messages_prefix' AND chain.depth < 10000
        )
        SELECT CASE
            WHEN count(*) FILTER (WHERE NOT chain.payload ? 'messages_prefix') = 1
             AND sum(CASE WHEN jsonb_typeof(chain.payload -> 'body' -> 'messages') = 'array'
                          THEN jsonb_array_length(chain.payload -> 'body' -> 'messages') END)
                 = (r.payload -> 'messages_prefix' ->> 'n_messages')::int
                   + jsonb_array_length(r.payload -> 'body' -> 'messages')
            THEN (
                SELECT jsonb_agg(m.value ORDER BY link.depth DESC, m.ordinality)
                FROM chain AS link,
                     jsonb_array_elements(link.payload -> 'body' -> 'messages')
                         WITH ORDINALITY AS m
            )
        END
        FROM chain
    ) ELSE r.payload -> 'body' -> 'messages' END AS messages,
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

# Before: the stored messages as they are.
_MESSAGES_BEFORE = "    r.payload -> 'body' -> 'messages' AS messages,\n"
_MESSAGES = _TURNS[
    _TURNS.index("    CASE WHEN r.payload ? 'messages_prefix'") : _TURNS.index("AS messages,\n")
    + len("AS messages,\n")
]
_TURNS_BEFORE = _TURNS.replace(_MESSAGES, _MESSAGES_BEFORE)


def upgrade() -> None:
    op.execute(_TURNS)


def downgrade() -> None:
    op.execute(_TURNS_BEFORE)
