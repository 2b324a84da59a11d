"""The log's unique keys: event ids and stream versions, unique over every partition and day.

Event ids and stream versions are unique across the whole log, every partition and every
day; how, without a second copy of every key on the hot path:
- within a day, by the day partition's own unique indexes (`PARTITION_UNIQUE_KEYS`);
- across days, by a check before each write against the days before: `EventWriter` calls
  `trajstore_check_keys` once per batch (its streams' runs of versions: a few dozen index
  probes, not one per event), every other insert (`EventStore.append`, plain SQL) runs the row
  trigger `events_keys`, which checks the row's id and (stream, version). Both first take the
  stream's advisory lock (the one `EventStore.append` takes), so two writers of one stream
  take turns and each sees what the other committed, across midnight too.
- `event_keys` holds the keys of *sealed* days: when a day has closed, maintenance
  (`store.partitions.seal_closed_days`) copies its keys here, so the checks probe one index
  for all of them, plus the partitions recorded since `event_keys_sealed.through`.
Archiving forgets the keys of archived events except each stream's last version, which keeps
stream versions increasing (`queries.STREAM_VERSION` reads it).

Here: the SQL of all three (declared in `store.schema`, run by `store.writer`,
`store.partitions` and `store.archive`), and the writer's batch as its streams' runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: A partition's own unique keys: event ids and (stream, version) are unique within each day
#: (across days, see above). Not declared on `events`: a partitioned table's unique
#: keys must include its partition key, `recorded_at`, which would make them refuse nothing.
PARTITION_UNIQUE_KEYS = (
    "CREATE UNIQUE INDEX uq_events_event_id_{suffix} ON {partition} (event_id)",
    "CREATE UNIQUE INDEX uq_events_stream_id_stream_version_{suffix} "
    "ON {partition} (stream_id, stream_version)",
)

#: Refuses a row whose id or (stream, version) is stored in another partition or sealed day; a
#: row dated outside the days the checks probe (before `through`, or later than now: an explicit
#: `recorded_at`) has its keys sealed at once. Runs for every insert into `events`
#: except the writer's COPY, which `trajstore_check_keys` checked (and said so). SECURITY
#: DEFINER: the recorder role may read `event_keys` but not write it.
GUARD_KEYS_FUNCTION = """
CREATE FUNCTION trajstore_guard_keys() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    sealed timestamptz := (SELECT coalesce(max(through), '-infinity') FROM event_keys_sealed);
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(NEW.stream_id, 0));
    IF EXISTS (SELECT FROM event_keys k WHERE k.event_id = NEW.event_id)
       OR EXISTS (SELECT FROM event_keys k
                  WHERE k.stream_id = NEW.stream_id AND k.stream_version = NEW.stream_version)
       OR EXISTS (SELECT FROM events e
                  WHERE e.event_id = NEW.event_id AND e.recorded_at >= sealed
                    AND e.tableoid <> TG_RELID)
       OR EXISTS (SELECT FROM events e
                  WHERE e.stream_id = NEW.stream_id AND e.stream_version = NEW.stream_version
                    AND e.recorded_at >= sealed AND e.tableoid <> TG_RELID)
    THEN
        RAISE EXCEPTION 'event % or version % of stream % is stored already',
            NEW.event_id, NEW.stream_version, NEW.stream_id USING ERRCODE = 'unique_violation';
    END IF;
    IF NEW.recorded_at < sealed OR NEW.recorded_at > clock_timestamp() THEN
        INSERT INTO event_keys VALUES (NEW.event_id, NEW.stream_id, NEW.stream_version);
    END IF;
    RETURN NULL;
END
$$"""

#: The writer's check of a batch, before its COPY (`CHECK_KEYS`): no version in these runs
#: ($1 stream, $2 first, $3 last version) is stored yet, on any day (ids are checked within the
#: day by the partition's index: a retried event is the same stream and version, which this
#: refuses, so the writer's look-up skips it). Then it marks the transaction checked, so
#: `events_keys` lets the COPY's rows through without a trigger call each. Generic plans:
#: planning the probes of every partition took longer than running them (which prune all but
#: today's and the unsealed days' at run time), so each connection plans them once.
CHECK_KEYS_FUNCTION = """
CREATE FUNCTION trajstore_check_keys(streams text[], lows bigint[], highs bigint[])
RETURNS void LANGUAGE plpgsql SECURITY DEFINER SET search_path = public
SET plan_cache_mode = force_generic_plan AS $$
DECLARE
    sealed timestamptz := (SELECT coalesce(max(through), '-infinity') FROM event_keys_sealed);
    upto timestamptz;
    clash record;
BEGIN
    PERFORM pg_advisory_xact_lock(key)
    FROM (SELECT DISTINCT hashtextextended(s, 0) AS key FROM unnest(streams) AS s ORDER BY 1) k;
    -- Read after the locks: every row committed so far was recorded before (later-dated rows
    -- were sealed when inserted), so the days ahead's partitions need no probing.
    upto := clock_timestamp();
    SELECT b.stream_id, b.low, b.high INTO clash
    FROM unnest(streams, lows, highs) AS b (stream_id, low, high)
    WHERE EXISTS (SELECT FROM event_keys k WHERE k.stream_id = b.stream_id
                  AND k.stream_version BETWEEN b.low AND b.high)
       OR EXISTS (SELECT FROM events e WHERE e.stream_id = b.stream_id
                  AND e.stream_version BETWEEN b.low AND b.high
                  AND e.recorded_at >= sealed AND e.recorded_at <= upto)
    LIMIT 1;
    IF FOUND THEN
        RAISE EXCEPTION 'a version in % to % of stream % is stored already',
            clash.low, clash.high, clash.stream_id USING ERRCODE = 'unique_violation';
    END IF;
    PERFORM set_config('trajstore.keys_checked', 'on', true);
END
$$"""

#: The row trigger's condition: not in a transaction whose writes `trajstore_check_keys` checked.
KEYS_UNCHECKED = "current_setting('trajstore.keys_checked', true) IS DISTINCT FROM 'on'"

#: The row trigger: for every insert except a checked transaction's. AFTER, not BEFORE: a BEFORE
#: ROW trigger would make COPY insert row by row; the WHEN clause keeps the writer's checked rows
#: from queueing a call at all.
ROW_TRIGGER = (
    "CREATE TRIGGER events_keys AFTER INSERT ON events FOR EACH ROW "
    f"WHEN ({KEYS_UNCHECKED}) EXECUTE FUNCTION trajstore_guard_keys()"
)

#: The writer's uniqueness check of a batch before its COPY (`CHECK_KEYS_FUNCTION`):
#: its streams' runs of consecutive versions, ($1 stream, $2 first, $3 last version) each.
CHECK_KEYS = "SELECT trajstore_check_keys($1::text[], $2::int8[], $3::int8[])"


def stream_runs(batch: Sequence[Sequence[Any]]) -> tuple[list[str], list[int], list[int]]:
    """The runs of consecutive versions of one stream in a batch of COPY rows (stream id and
    version second and third, `queries.INSERT_COLUMNS`), as three columns (stream, first, last):
    what `CHECK_KEYS` checks. A producer appends a stream's events in order, so a
    batch of thousands of events holds a few dozen runs."""
    streams: list[str] = []
    lows: list[int] = []
    highs: list[int] = []
    stream, low, last = None, 0, 0
    for row in batch:
        if row[1] == stream and row[2] == last + 1:
            last += 1
            continue
        if stream is not None:
            streams.append(stream)
            lows.append(low)
            highs.append(last)
        stream, low, last = row[1], row[2], row[2]
    if stream is not None:
        streams.append(stream)
        lows.append(low)
        highs.append(last)
    return streams, lows, highs


# -- sealing and archiving ----------------------------------------------------------------------


def seal_keys_of(name: str) -> str:
    """Copy the uniqueness keys of one partition's events into `event_keys` (those already
    there stay): what sealing a day does, and what archiving does before it detaches one."""
    return f"""
INSERT INTO event_keys (event_id, stream_id, stream_version)
SELECT event_id, stream_id, stream_version FROM {name}
ON CONFLICT DO NOTHING
"""


#: Every event recorded in [$1, $2) (any partition, the default one too) into `event_keys`.
SEAL_KEYS_BETWEEN = """
INSERT INTO event_keys (event_id, stream_id, stream_version)
SELECT event_id, stream_id, stream_version FROM events
WHERE recorded_at >= $1 AND recorded_at < $2
ON CONFLICT DO NOTHING
"""

#: Up to when events' keys are in `event_keys` (-infinity: none are).
SEALED_THROUGH = "SELECT coalesce(max(through), '-infinity') FROM event_keys_sealed"

#: Two statements, in one transaction: the table holds one row.
SET_SEALED_THROUGH = (
    "DELETE FROM event_keys_sealed",
    "INSERT INTO event_keys_sealed (through) VALUES ($1)",
)


def forget_keys_of(name: str) -> str:
    """Forget the uniqueness keys of a partition's events, except each stream's last version:
    stream versions keep increasing past archived events (`STREAM_VERSION`)."""
    return f"""
DELETE FROM event_keys k USING {name} p
WHERE k.event_id = p.event_id
  AND k.stream_version < (SELECT max(m.stream_version) FROM event_keys m
                          WHERE m.stream_id = k.stream_id)
"""
