"""Every SQL statement of the store, in one place, called by name.

Hot paths use asyncpg directly; these are plain strings with positional parameters (and
`read_types`, which writes the event types into its statement).
"""

from __future__ import annotations

from collections.abc import Iterable

import asyncpg

from trajstore.store.errors import BadEvent
from trajstore.store.events import SESSION_FACTS


def sql_literals(values: Iterable[str]) -> str:
    """Strings as a list of SQL literals, for a predicate the planner must see as constants."""
    return ", ".join("'" + value.replace("'", "''") + "'" for value in values)


#: The session facts as SQL literals: the predicate of the events' partial index on them
#: (`store.schema`), and how a query names them for PostgreSQL to use that index.
FACT_TYPES = sql_literals(SESSION_FACTS)

#: The columns of a `RecordedEvent`, in its order.
EVENT_COLUMNS = (
    "position, tx_id, event_id, stream_id, stream_version, session_id, run_id, event_type, "
    "recorded_at, payload, token_ids, logprobs, side_data"
)

#: The columns a writer supplies; position, tx_id and recorded_at come from the database.
INSERT_COLUMNS = (
    "event_id",
    "stream_id",
    "stream_version",
    "session_id",
    "run_id",
    "event_type",
    "payload",
    "token_ids",
    "logprobs",
    "side_data",
)

APPEND = f"""
INSERT INTO events ({", ".join(INSERT_COLUMNS)})
SELECT * FROM unnest(
    $1::uuid[], $2::text[], $3::int8[], $4::text[], $5::text[], $6::text[], $7::jsonb[],
    $8::bytea[], $9::bytea[], $10::bytea[]
)
RETURNING event_id, position
"""

#: Serialises appends with ExpectedVersion.ANY to one stream until the transaction ends.
LOCK_STREAM = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"

# Each day's partition holds its own unique keys; `event_keys` holds those of the days sealed
# since (and each archived stream's last version): a stream's version is the higher of the two.
STREAM_VERSION = """
SELECT greatest(
    (SELECT max(stream_version) FROM event_keys WHERE stream_id = $1),
    (SELECT max(stream_version) FROM events WHERE stream_id = $1),
    0
)
"""

#: Stored events by id, from every partition's unique index on `event_id`.
FIND_EVENTS = """
SELECT event_id, position, stream_id, stream_version FROM events
WHERE event_id = ANY($1::uuid[])
"""

EXISTING_EVENT_IDS = "SELECT event_id FROM events WHERE event_id = ANY($1::uuid[])"

READ_STREAM = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = $1 AND stream_version > $2
ORDER BY stream_version
LIMIT $3
"""

READ_SESSION = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE session_id = $1
ORDER BY tx_id, position
"""

#: How many events a session has: the log only grows, so an unchanged count is an unchanged
#: session (the proxy's reader keeps a rebuilt session while it holds; an index-only count).
COUNT_SESSION_EVENTS = "SELECT count(*) FROM events WHERE session_id = $1"

# The global order is (tx_id, position). Positions are handed out when rows are inserted, not
# when they commit, so a transaction that started earlier can commit a smaller position after
# readers have passed it. Stopping below the oldest transaction still in flight (the snapshot's
# xmin) means nothing can ever appear behind a reader's checkpoint. Every transaction below xmin
# has finished, and rows are ordered by their writer's xid, so the order is final.
READ_ALL = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE (tx_id, position) > ($1::xid8, $2::int8)
  AND tx_id < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY tx_id, position
LIMIT $3
"""


def read_types(types: Iterable[str]) -> str:
    """Events of these types only, in global order below the horizon, after ($1 tx_id, $2
    position), at most $3 of them.

    The types are written into the statement as literals: for session facts PostgreSQL then
    reads the partial index on them (`store.schema`), which a parameter would hide from the
    generic plan it switches to after a few executions.
    """
    return f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE (tx_id, position) > ($1::xid8, $2::int8)
  AND tx_id < pg_snapshot_xmin(pg_current_snapshot())
  AND event_type IN ({sql_literals(types)})
ORDER BY tx_id, position
LIMIT $3
"""


#: The session facts (`read_types(SESSION_FACTS)`): what the projector follows.
READ_FACTS = read_types(SESSION_FACTS)

TX_ID_OF_POSITION = "SELECT tx_id FROM events WHERE position = $1"

# -- partitions of events (`store.partitions`, `store.archive`) --------------------------------

#: Give a new partition's indexes their parent's name and the partition's suffix, so that plans
#: name them recognisably (`ix_events_session_facts_20261125`, not `events_20261125_tx_id_idx1`).
NAME_PARTITION_INDEXES = """
DO $$
DECLARE
    idx record;
BEGIN
    FOR idx IN SELECT c.relname AS child, p.relname AS parent FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
               JOIN pg_index x ON x.indexrelid = c.oid
               WHERE x.indrelid = '{partition}'::regclass
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', idx.child, idx.parent || '_{suffix}');
    END LOOP;
END
$$"""

#: The partitions of events with their bounds, oldest first (the default one has no bounds).
PARTITIONS = """
SELECT c.relname AS name, pg_get_expr(c.relpartbound, c.oid) AS bound,
       pg_total_relation_size(c.oid) AS bytes
FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = 'events'::regclass
ORDER BY c.relname
"""


def read_partition(name: str) -> str:
    """Every event of one partition, every column (the payload as the JSON text PostgreSQL
    prints), in log order: what an archive file holds."""
    return f"""
SELECT position, tx_id, event_id, stream_id, stream_version, session_id, run_id, event_type,
       recorded_at, payload::text, token_ids, logprobs, side_data
FROM {name} ORDER BY tx_id, position
"""


def partition_positions(name: str) -> str:
    """How many events one partition holds, and their positions in order."""
    return f"SELECT position FROM {name} ORDER BY position"


def active_sessions_in(name: str) -> str:
    """The sessions with an event in partition `name` that are still active: created and never
    finished (what the proxy's reaper watches, `ACTIVE_SESSION_STREAMS`)."""
    return f"""
SELECT DISTINCT p.session_id FROM {name} p
WHERE p.session_id IS NOT NULL
  AND EXISTS (SELECT FROM events c WHERE c.session_id = p.session_id
              AND c.event_type = 'session_created')
  AND NOT EXISTS (SELECT FROM events f WHERE f.session_id = p.session_id
                  AND f.event_type = 'session_finished')
ORDER BY 1
"""


#: The derived facts of some samples (`store.side_data.sample_stream`: scores, failures), in
#: log order, from each partition's unique index on (stream_id, stream_version).
READ_SAMPLE_FACTS = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE stream_id = ANY($1::text[])
ORDER BY tx_id, position
"""

#: Samples of some runs ($1; NULL: every run) in the served projection with generated tokens and
#: no `sample_scored` of kind $2 by source $3 yet, by id after $4, at most $5: a scorer's work
#: list (`store.side_data.unscored_samples`). The NOT EXISTS probes the sample's stream.
UNSCORED_SAMPLES = """
SELECT s.sample_id, s.session_id, s.run_id, s.token_ids, s.loss_mask, s.logprobs
FROM samples s
WHERE s.projection_version
      = coalesce((SELECT version FROM projection_serving WHERE name = 'samples'), 1)
  AND ($1::text[] IS NULL OR s.run_id = ANY($1::text[]))
  AND s.response_len > 0
  AND s.sample_id > $4::uuid
  AND NOT EXISTS (
      SELECT FROM events e
      WHERE e.stream_id = 'sample-' || s.sample_id::text
        AND e.event_type = 'sample_scored'
        AND e.payload ->> 'kind' = $2 AND e.payload ->> 'source' = $3
  )
ORDER BY s.sample_id
LIMIT $5
"""

SNAPSHOT_XMIN = "SELECT pg_snapshot_xmin(pg_current_snapshot())"

SNAPSHOT_XMAX = "SELECT pg_snapshot_xmax(pg_current_snapshot())"

#: Who holds the horizon back: the oldest write transactions open anywhere in the cluster.
OLDEST_WRITERS = """
SELECT pid, datname, now() - xact_start AS age FROM pg_stat_activity
WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
ORDER BY xact_start LIMIT 3
"""

HEAD_POSITION = "SELECT coalesce(max(position), 0) FROM events"

SCHEMA_PRESENT = "SELECT to_regclass('events') IS NOT NULL"

# -- the samples projection --------------------------------------------------------------------

READ_CHECKPOINT = """
SELECT tx_id, position FROM projection_checkpoints WHERE name = $1 AND version = $2
"""

WRITE_CHECKPOINT = """
INSERT INTO projection_checkpoints (name, version, tx_id, position) VALUES ($1, $2, $3, $4)
ON CONFLICT (name, version)
DO UPDATE SET tx_id = EXCLUDED.tx_id, position = EXCLUDED.position, updated_at = now()
"""

#: Every event of several sessions, each session's in log order (one round trip per batch).
READ_SESSIONS = f"""
SELECT {EVENT_COLUMNS} FROM events
WHERE session_id = ANY($1::text[])
ORDER BY session_id, tx_id, position
"""

DELETE_SESSION_SAMPLES = """
DELETE FROM samples WHERE session_id = ANY($1::text[]) AND projection_version = $2
"""

SAMPLE_COLUMNS = (
    "sample_id", "projection_version", "session_id", "run_id", "task_id", "group_id", "branch",
    "alternative_of", "is_final", "status", "finish_reason", "reward", "token_ids", "loss_mask",
    "logprobs", "prompt_len", "response_len", "n_turns", "tool_turns", "policy_versions",
    "engines", "divergence", "last_position", "tags", "request_ids", "created_at",
    "finished_at", "policy_version_min", "policy_version_max", "images", "lineage", "role",
    "parent", "fork_at", "version_spans", "side", "side_data",
)  # fmt: skip

#: The version readers are served; FOR SHARE so a rebuild's switch waits for batches in flight.
READ_SERVED_VERSION = "SELECT version FROM projection_serving WHERE name = $1 FOR SHARE"

SERVE_FIRST_VERSION = """
INSERT INTO projection_serving (name, version) VALUES ($1, 1) ON CONFLICT (name) DO NOTHING
"""

LATEST_VERSION = """
SELECT greatest(
    (SELECT max(version) FROM projection_serving WHERE name = $1),
    (SELECT max(version) FROM projection_checkpoints WHERE name = $1)
)
"""

SWITCH_SERVED_VERSION = """
UPDATE projection_serving SET version = $2, switched_at = now() WHERE name = $1
"""

DELETE_VERSION_SAMPLES = "DELETE FROM samples WHERE projection_version = $1"

DELETE_CHECKPOINT = "DELETE FROM projection_checkpoints WHERE name = $1 AND version = $2"

#: How many facts a projection from scratch will read (the progress bar's total).
COUNT_SESSION_FACTS = f"""
SELECT count(*) FROM events
WHERE event_type IN ({FACT_TYPES}) AND tx_id < pg_snapshot_xmin(pg_current_snapshot())
"""

# -- readers of samples ---------------------------------------------------------------------------

#: The samples projection version readers use: the served one, 1 before any projector ran. (The
#: `trajectories` view spells it out too: a view cannot take it from here.)
SERVED_SAMPLES_VERSION = (
    "coalesce((SELECT version FROM projection_serving WHERE name = 'samples'), 1)"
)

# -- export ---------------------------------------------------------------------------------------

_EXPORT_FILTER = f"""
FROM samples s
WHERE s.projection_version = {SERVED_SAMPLES_VERSION}
  AND ($1::text[] IS NULL OR s.run_id = ANY($1::text[]))
  AND ($2::text[] IS NULL OR s.status = ANY($2::text[]))
"""

COUNT_EXPORT = "SELECT count(*) " + _EXPORT_FILTER

#: Keyset pages in (run, session, lineage, branch, sample id) order.
READ_EXPORT = (
    "SELECT s.*, s.sample_id::text AS order_key "
    + _EXPORT_FILTER
    + """
  AND (coalesce(s.run_id, ''), s.session_id, s.lineage, s.branch, s.sample_id::text)
      > ($3, $4, $5, $6, $7)
ORDER BY coalesce(s.run_id, ''), s.session_id, s.lineage, s.branch, s.sample_id::text
LIMIT $8
"""
)

#: What the requests of these sessions asked, and how the model replied to these requests (the
#: samples' last ones): the messages a sample's last request continues (`messages_prefix`) are
#: followed in Python. One pass over the sessions' events on the session index, linear in them;
#: a recursive CTE following the references joined once per link, a scan of `events` each time
#: (minutes for one 5,000-turn session).
READ_CONVERSATIONS = """
SELECT stream_id, event_type, payload FROM events
WHERE session_id = ANY($1::text[])
  AND (event_type = 'request_received'
       OR (event_type = 'completion_finished' AND stream_id = ANY($2::text[])))
"""

#: The bytes of data images, by hash, from the sessions that recorded them (`image_recorded`;
#: `trajstore export --images`). An image recorded twice (another replica) comes once.
READ_IMAGES = """
SELECT DISTINCT ON (payload ->> 'sha256') payload ->> 'sha256' AS sha256, payload ->> 'data' AS data
FROM events
WHERE session_id = ANY($1::text[]) AND event_type = 'image_recorded'
  AND payload ->> 'source' = 'data' AND payload ->> 'sha256' = ANY($2::text[])
"""

# -- time travel ----------------------------------------------------------------------------------

# No horizon (unlike the projector's reads): time travel asks about a point that was committed
# already, and waiting for unrelated transactions still open would only hide sessions.
SESSIONS_WITH_FACTS_UP_TO = f"""
SELECT session_id FROM (
    SELECT DISTINCT ON (session_id) session_id, tx_id, position FROM events
    WHERE (tx_id, position) <= ($1::xid8, $2::int8)
      AND event_type IN ({FACT_TYPES})
      AND session_id IS NOT NULL
    ORDER BY session_id, tx_id, position
) AS first_fact
ORDER BY tx_id, position
"""

# -- clients of the store ---------------------------------------------------------------------

#: The application names of this database's connections that start with $1: how the proxy
#: replicas find each other (`proxy.replicas`). pg_stat_activity shows every role's
#: application_name, even to a role that may not see the rest of another's row.
CLIENTS_NAMED = """
SELECT DISTINCT application_name FROM pg_stat_activity
WHERE datname = current_database() AND starts_with(application_name, $1)
"""

NOTIFY = "SELECT pg_notify($1, $2)"

# -- the proxy's reaper (`proxy.reaper`) ----------------------------------------------------------

#: Every stream of every session still active (created, never finished) and of the sessions in
#: $1 (finished lately), with what the reaper needs of each: whether its session is active, its
#: version, when it last changed, whether a request ended, the replica that served it, and the
#: completion tokens that reached the log. The active sessions come from the lifecycle index
#: (`ix_events_session_lifecycle`), their events from the session index.
ACTIVE_SESSION_STREAMS = """
WITH active AS (
    SELECT created.session_id FROM events AS created
    WHERE created.event_type = 'session_created'
      AND NOT EXISTS (
          SELECT 1 FROM events AS finished
          WHERE finished.event_type = 'session_finished'
            AND finished.session_id = created.session_id
      )
), watched AS (
    SELECT session_id, true AS active FROM active
    UNION
    SELECT recent.session_id, false FROM unnest($1::text[]) AS recent (session_id)
    WHERE recent.session_id NOT IN (SELECT session_id FROM active)
), streams AS (
    SELECT
        watched.active,
        e.session_id,
        e.stream_id,
        max(e.run_id) AS run_id,
        max(e.stream_version) AS version,
        extract(epoch FROM now() - max(e.recorded_at))::float8 AS idle_s,
        bool_or(e.event_type IN ('completion_finished', 'request_failed')) AS ended,
        coalesce(sum(octet_length(e.token_ids) / 4)
                 FILTER (WHERE e.event_type = 'completion_chunk'), 0)::bigint AS tokens
    FROM watched JOIN events AS e ON e.session_id = watched.session_id
    GROUP BY watched.active, e.session_id, e.stream_id
)
-- The replica, from the request_received payload (version 1 of a request's stream), of open
-- requests only: a payload holds the agent's whole body, and CASE reads it only when needed.
SELECT streams.*, CASE WHEN streams.ended THEN NULL ELSE (
    SELECT received.payload ->> 'replica' FROM events AS received
    WHERE received.stream_id = streams.stream_id AND received.stream_version = 1
      AND received.event_type = 'request_received'
) END AS replica
FROM streams
"""


async def tx_id_of(conn: asyncpg.Connection, position: int) -> int:
    """The writing transaction of the event at `position` (0 before the first event)."""
    if position == 0:
        return 0
    tx_id = await conn.fetchval(TX_ID_OF_POSITION, position)
    if tx_id is None:
        raise BadEvent(f"no event at position {position}; pass 0 or a position read before")
    return int(tx_id)
