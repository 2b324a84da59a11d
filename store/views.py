"""SQL for people: the `turns` and `trajectories` views, and the read-only `trajstore_reader` role.

The views read the event log itself (the source of truth), so they are never stale; `samples`
is a table (the projection). Together they answer questions such as "mean reward per run and
policy version" in one SELECT; the README lists tested examples.

`turns` — one row per model request: the messages the agent sent (whole; `messages_added`:
what the request stored after the turn it continues, `messages_prefix`: which), the completion
text and tool calls, finish reason, token counts, latency and time to first token, engine,
policy version, and how the prompt reached the engine (`prompt_source` continued | rendered,
`prompt_fallback` why not continued, `drift_at` where the text rendering would have differed;
`proxy.continuation`), and the lineage it belongs to once its session is projected.

`trajectories` — one row per session: run, task, group, status, reward, turns, tool turns,
tokens, duration, engines, policy versions, the divergences its samples recorded (from the
served projection version), its continued turns and the drift they avoided, and its lineages
(the conversations it held, `store.lineages`), samples, and calls per sample (how many model
calls each training row merged).

`trajstore_reader` can SELECT these two views and `samples`, and nothing else: not the events
table, not a write anywhere. The function that makes `turns.messages` whole reads `events` with
its owner's rights, so only the reader role may execute it (not PUBLIC, every role). Roles
belong to the whole PostgreSQL cluster, so the role is created once if missing and never dropped
by a downgrade (it may hold grants in other databases); a downgrade only takes its grants away.
Give it to a person with `GRANT trajstore_reader TO alice`.

The migrations create exactly these statements; `tests/store/test_schema.py` proves the migrated
catalog equals the one built from `store.schema`.
"""

from __future__ import annotations

from trajstore.store.roles import create_role

READER_ROLE = "trajstore_reader"

# One statement per string: the asyncpg driver prepares statements, one command each.

#: A request's whole messages from its `request_received` payload: follow `messages_prefix`
#: back to a request stored whole, then join the lists in order; NULL when a link is missing,
#: names another count of messages than its source holds, is not a list, or the chain loops
#: (10,000 links): never a guess. A loop over the session's requests' messages, read once in one
#: scan of the session's index, not a recursive query (issue 43); a probe of `events` per link
#: cost 0.25 ms a link (each probe wakes every day's partition), the scan 43 ms for a whole
#: 2,000-turn session. Every turn's whole messages remain the square of a session: a query over a
#: run selects `messages_added` and `messages_prefix` instead. SECURITY DEFINER
#: with a fixed search_path, so `trajstore_reader` (who may read the views, not `events`) can
#: read `turns.messages`; it reads request messages only, which the view shows anyway.
TURN_MESSAGES_FUNCTION = """
CREATE FUNCTION trajstore_turn_messages(session text, received jsonb) RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, public AS $$
DECLARE
    link jsonb := jsonb_build_array(received -> 'messages_prefix',
                                    received -> 'body' -> 'messages');
    links jsonb;  -- request id -> [its messages_prefix, its stored messages], the session's
    parts jsonb[] := ARRAY[]::jsonb[];
    counts int[] := ARRAY[]::int[];
    total int := 0;
    whole jsonb;
BEGIN
    LOOP
        IF jsonb_typeof(link -> 1) IS DISTINCT FROM 'array' OR cardinality(parts) >= 10000 THEN
            RETURN NULL;
        END IF;
        parts := parts || (link -> 1);
        EXIT WHEN jsonb_typeof(link -> 0) IS DISTINCT FROM 'object';
        counts := counts || (link -> 0 ->> 'n_messages')::int;
        IF links IS NULL THEN
            SELECT jsonb_object_agg(payload ->> 'request_id', jsonb_build_array(
                       payload -> 'messages_prefix', payload -> 'body' -> 'messages'))
            INTO links
            FROM events
            WHERE session_id = session AND event_type = 'request_received';
        END IF;
        link := links -> (link -> 0 ->> 'request_id');
        IF link IS NULL THEN
            RETURN NULL;
        END IF;
    END LOOP;
    -- From the request stored whole forward: each link must continue exactly the count its
    -- reference names.
    FOR i IN REVERSE cardinality(parts)..1 LOOP
        IF i < cardinality(parts) AND total IS DISTINCT FROM counts[i] THEN
            RETURN NULL;
        END IF;
        total := total + jsonb_array_length(parts[i]);
    END LOOP;
    SELECT coalesce(jsonb_agg(m.value ORDER BY p.n DESC, m.n), '[]'::jsonb) INTO whole
    FROM unnest(parts) WITH ORDINALITY AS p (messages, n),
         jsonb_array_elements(p.messages) WITH ORDINALITY AS m (value, n);
    RETURN whole;
END
$$"""

TURNS_VIEW = """
CREATE VIEW turns AS
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
    CASE WHEN r.payload ? 'messages_prefix'
        -- Stored as a reference to an earlier turn's messages plus the new ones (the
        -- request_received contract in store.sessions): made whole by a loop, not a recursive
        -- query (TURN_MESSAGES_FUNCTION), and only when this column is asked for.
        THEN trajstore_turn_messages(r.session_id, r.payload)
        ELSE r.payload -> 'body' -> 'messages'
    END AS messages,
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
    CASE WHEN e.event_type = 'request_failed' THEN e.payload ->> 'reason' END AS failure,
    p.prompt_source,
    p.prompt_fallback,
    p.drift_at,
    (
        -- The conversation of the session this turn belongs to (store.lineages), as the served
        -- projection found it: NULL until the session is finished and projected.
        SELECT s.lineage FROM samples s
        WHERE s.session_id = r.session_id
          AND s.request_ids @> ARRAY[r.payload ->> 'request_id']
          AND s.alternative_of IS NULL
          AND s.projection_version = (
              SELECT version FROM projection_serving WHERE name = 'samples'
          )
        LIMIT 1
    ) AS lineage,
    -- What the request stored: its messages after those of the turn it continues (all of them
    -- without `messages_prefix`). Linear in a session's turns, where whole lists are its square.
    r.payload -> 'body' -> 'messages' AS messages_added,
    r.payload -> 'messages_prefix' AS messages_prefix
FROM events r
LEFT JOIN LATERAL (
    SELECT
        coalesce((payload ->> 'n_tokens')::int, octet_length(token_ids) / 4) AS prompt_tokens,
        payload ->> 'prompt_source' AS prompt_source,
        payload -> 'continuation' ->> 'fallback' AS prompt_fallback,
        (payload -> 'continuation' ->> 'drift_at')::int AS drift_at
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

TRAJECTORIES_VIEW = """
CREATE VIEW trajectories AS
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
    coalesce(v.divergence_reasons, '{}') AS divergence_reasons,
    coalesce(t.continued_turns, 0) AS continued_turns,
    coalesce(t.drift_avoided, 0) AS drift_avoided,
    coalesce(v.lineages, 0) AS lineages,
    coalesce(v.samples, 0) AS samples,
    round(t.turns::numeric / nullif(v.samples, 0), 2) AS calls_per_sample
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
            FILTER (WHERE policy_version IS NOT NULL) AS policy_versions,
        (count(*) FILTER (WHERE prompt_source = 'continued'))::int AS continued_turns,
        (count(*) FILTER (WHERE drift_at IS NOT NULL))::int AS drift_avoided
    FROM turns WHERE session_id = s.session_id
) t ON true
LEFT JOIN LATERAL (
    SELECT
        (count(*) FILTER (WHERE divergence IS NOT NULL))::int AS divergences,
        array_agg(divergence ->> 'reason' ORDER BY lineage, branch)
            FILTER (WHERE divergence IS NOT NULL) AS divergence_reasons,
        (count(DISTINCT lineage))::int AS lineages,
        count(*)::int AS samples
    FROM samples
    WHERE session_id = s.session_id
      AND alternative_of IS NULL
      AND projection_version = (
          SELECT version FROM projection_serving WHERE name = 'samples'
      )
) v ON true
WHERE s.event_type = 'session_created'
"""

# Side data for people (`store.side_data`): one row per array of every side-data fact, its bytes
# cut out of the event's `side_data`; `trajstore_float32s` / `trajstore_uints` decode them.
SIDE_DATA_VIEW = """
CREATE VIEW side_data AS
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
WHERE e.event_type IN ('side_data_recorded', 'sample_scored')
"""

#: Every sample a scorer could not score, and why (a gap is never silent).
SCORING_FAILURES_VIEW = """
CREATE VIEW scoring_failures AS
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
WHERE e.event_type = 'scoring_failed'
"""

#: Little-endian float32 bytes (logprobs, a teacher's) as real[], NaN and infinities kept.
FLOAT32S_FUNCTION = """
CREATE FUNCTION trajstore_float32s(data bytea) RETURNS real[]
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

#: Little-endian unsigned integers of `width` bytes (1, 2; 4 for int32 ids) as integer[].
UINTS_FUNCTION = """
CREATE FUNCTION trajstore_uints(data bytea, width integer) RETURNS bigint[]
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
SELECT coalesce(array_agg(
    (SELECT sum(get_byte(data, i * width + b)::bigint << (8 * b))
     FROM generate_series(0, width - 1) AS b) ORDER BY i), '{}')
FROM generate_series(0, length(data) / width - 1) AS i
$$"""

CREATE_READER_ROLE = create_role(READER_ROLE, login=False)

#: What `upgrade` runs, in order, after the tables exist.
CREATE = [
    TURN_MESSAGES_FUNCTION,
    # It reads events with its owner's rights: the reader's alone, not every role's (PUBLIC's).
    "REVOKE EXECUTE ON FUNCTION trajstore_turn_messages(text, jsonb) FROM PUBLIC",
    TURNS_VIEW,
    TRAJECTORIES_VIEW,
    SIDE_DATA_VIEW,
    SCORING_FAILURES_VIEW,
    FLOAT32S_FUNCTION,
    UINTS_FUNCTION,
    CREATE_READER_ROLE,
    f"GRANT USAGE ON SCHEMA public TO {READER_ROLE}",
    f"GRANT SELECT ON turns, trajectories, samples TO {READER_ROLE}",
    f"GRANT SELECT ON side_data, scoring_failures TO {READER_ROLE}",
    f"GRANT EXECUTE ON FUNCTION trajstore_turn_messages(text, jsonb) TO {READER_ROLE}",
]

#: What `downgrade` runs, in order, before the tables go (the role stays: see above).
DROP = [
    f"REVOKE EXECUTE ON FUNCTION trajstore_turn_messages(text, jsonb) FROM {READER_ROLE}",
    f"REVOKE SELECT ON side_data, scoring_failures FROM {READER_ROLE}",
    f"REVOKE SELECT ON turns, trajectories, samples FROM {READER_ROLE}",
    f"REVOKE USAGE ON SCHEMA public FROM {READER_ROLE}",
    "DROP FUNCTION trajstore_uints(bytea, integer)",
    "DROP FUNCTION trajstore_float32s(bytea)",
    "DROP VIEW scoring_failures",
    "DROP VIEW side_data",
    "DROP VIEW trajectories",
    "DROP VIEW turns",
    "DROP FUNCTION trajstore_turn_messages(text, jsonb)",
]
