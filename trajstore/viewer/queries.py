"""Every SQL statement the viewer runs, called by name. All of them only read.

They read the `trajectories` view (`trajstore.store.views`), the `samples` table and, for the
runs' list and the live pages, the events table through its indexes. A session itself is read
with `EventStore.read_session` and rebuilt by `trajstore.store.sessions`, as the proxy's
`GET /sessions/{id}` does.
"""

from __future__ import annotations

#: Each run's sessions by status (a run's list is small; runs are few). The finish is found
#: through the lifecycle index (ix_events_session_lifecycle), not by scanning a run's tokens.
RUNS = """
SELECT s.run_id, coalesce(f.status, 'active') AS status, count(*)::int AS sessions,
       min(s.recorded_at) AS first_at, max(s.recorded_at) AS last_at
FROM events s
LEFT JOIN LATERAL (
    SELECT payload ->> 'status' AS status FROM events
    WHERE session_id = s.session_id AND event_type = 'session_finished'
    ORDER BY tx_id DESC, position DESC
    LIMIT 1
) f ON true
WHERE s.event_type = 'session_created' AND s.run_id IS NOT NULL
GROUP BY s.run_id, coalesce(f.status, 'active')
"""

#: Whether a run has any session (the run page of an unknown run is a 404).
RUN_EXISTS = """
SELECT EXISTS (SELECT FROM events WHERE run_id = $1 AND event_type = 'session_created')
"""

#: What the run page's figures and plots are made of: one row per session, oldest first.
RUN_SESSIONS = """
SELECT session_id, task_id, status, discarded, reward, turns, prompt_tokens, completion_tokens,
       created_at, policy_versions, divergences
FROM trajectories
WHERE run_id = $1
ORDER BY created_at, session_id
LIMIT $2
"""

#: Columns the sessions' table sorts by, as the page names them.
SORTABLE = {
    "created": "created_at",
    "status": "status",
    "task": "task_id",
    "reward": "reward",
    "turns": "turns",
    "tokens": "prompt_tokens + completion_tokens",
    "duration": "duration_s",
    "divergences": "divergences",
}


def sessions_page(sort: str, descending: bool) -> str:
    """One page of a run's sessions, filtered ($2..$7, NULL: any) and sorted by a `SORTABLE`
    column (written in as a literal; a parameter cannot name a column); $8 LIMIT, $9 OFFSET."""
    column = SORTABLE[sort]
    direction = "DESC" if descending else "ASC"
    return f"""
SELECT session_id, task_id, status, finish_reason, discarded, discard_reason, reward, turns,
       tool_turns, failed_turns, prompt_tokens, completion_tokens, created_at, duration_s,
       policy_versions, divergences, divergence_reasons, count(*) OVER ()::int AS total
FROM trajectories
WHERE run_id = $1
  AND ($2::text IS NULL OR status = $2)
  AND ($3::text IS NULL OR task_id = $3)
  AND ($4::float8 IS NULL OR reward >= $4)
  AND ($5::float8 IS NULL OR reward <= $5)
  AND ($6::bool IS NULL OR (divergences > 0) = $6)
  AND ($7::bool IS NULL OR discarded = $7)
ORDER BY {column} {direction} NULLS LAST, session_id
LIMIT $8 OFFSET $9
"""


#: Where a session's log stands: it changed when either number did (live pages, the cache).
#: Counting matters: an event committed late can take a position below the largest one.
SESSION_HEAD = """
SELECT count(*)::int AS n_events, coalesce(max(position), 0) AS last_position
FROM events WHERE session_id = $1
"""

#: One image a session recorded (`image_recorded`), by its hash: its media type and base64 data.
SESSION_IMAGE = """
SELECT payload ->> 'media_type' AS media_type, payload ->> 'data' AS data FROM events
WHERE session_id = $1 AND event_type = 'image_recorded' AND payload ->> 'source' = 'data'
  AND payload ->> 'sha256' = $2
LIMIT 1
"""
