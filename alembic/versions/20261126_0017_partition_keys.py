"""Event ids and stream versions unique per day partition, checked across days per batch.

Migration 0013 kept the log's two unique keys in `event_keys`, filled by a statement trigger from
every INSERT's or COPY's transition table: a second heap row and two more unique-index entries
for every event, on the write path every recorded token takes (`benchmarks/write_path.py`
measured it as most of what the writer paid over a raw COPY). Now:

- every partition has its own unique indexes on `event_id` and `(stream_id, stream_version)`
  (the parent's plain index on the latter goes: the partitions' serve its readers);
- across days, `trajstore_check_keys` checks a writer's batch once, by its streams' runs of
  versions, before its COPY, and the row trigger `events_keys` (replacing the statement one)
  checks every other insert row by row; its WHEN clause skips the rows of a checked transaction;
- `event_keys` keeps the keys of *sealed* days (closed days, copied there by `trajstore
  partitions`), up to `event_keys_sealed.through`, so the checks probe one index for them.

It keeps what `event_keys` holds (every key so far): a log with events is sealed through the
start of today, an empty one through -infinity. The unique indexes are built under the lock
on `events` (appends wait: about 4 s per million events, `benchmarks/partitions.py`).

Revision ID: 0017_partition_keys
Revises: 0016_lineages
Create Date: 2026-11-26
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017_partition_keys"
down_revision: str | None = "0016_lineages"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_GUARD_FUNCTION = """
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

_CHECK_FUNCTION = """
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

_ROW_TRIGGER = (
    "CREATE TRIGGER events_keys AFTER INSERT ON events FOR EACH ROW "
    "WHEN (current_setting('trajstore.keys_checked', true) IS DISTINCT FROM 'on') "
    "EXECUTE FUNCTION trajstore_guard_keys()"
)

_OLD_GUARD_FUNCTION = """
CREATE FUNCTION trajstore_guard_keys() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public AS $$
BEGIN
    INSERT INTO event_keys (event_id, stream_id, stream_version)
    SELECT event_id, stream_id, stream_version FROM appended;
    RETURN NULL;
END
$$"""

_OLD_STATEMENT_TRIGGER = (
    "CREATE TRIGGER events_keys AFTER INSERT ON events REFERENCING NEW TABLE AS appended "
    "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_guard_keys()"
)

#: Each partition's unique keys, named after it (`uq_events_event_id_20261125`).
_PARTITION_KEYS = """
DO $$
DECLARE
    part text;
    suffix text;
BEGIN
    FOR part IN SELECT inhrelid::regclass::text FROM pg_inherits
                WHERE inhparent = 'events'::regclass
    LOOP
        suffix := substr(part, length('events_') + 1);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I (event_id)',
                       'uq_events_event_id_' || suffix, part);
        EXECUTE format('CREATE UNIQUE INDEX %I ON %I (stream_id, stream_version)',
                       'uq_events_stream_id_stream_version_' || suffix, part);
    END LOOP;
END
$$"""

_DROP_PARTITION_KEYS = """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT x.indexrelid::regclass::text FROM pg_index x
                JOIN pg_inherits i ON i.inhrelid = x.indrelid
                WHERE i.inhparent = 'events'::regclass AND x.indisunique AND NOT x.indisprimary
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
END
$$"""

#: The parent's (stream_id, stream_version) index again, its partitions' copies named as 0013
#: named them.
_NAME_STREAM_INDEXES = """
DO $$
DECLARE
    idx record;
BEGIN
    FOR idx IN SELECT c.relname AS child, p.relname AS parent,
                      substr(x.indrelid::regclass::text, length('events_') + 1) AS suffix
               FROM pg_inherits i
               JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
               JOIN pg_index x ON x.indexrelid = c.oid
               WHERE p.relname = 'ix_events_stream_id_stream_version'
    LOOP
        EXECUTE format('ALTER INDEX %I RENAME TO %I', idx.child, idx.parent || '_' || idx.suffix);
    END LOOP;
END
$$"""


def _lock_events() -> None:
    # Wait at most 2 s for the lock (MigrationBlocked), then no limit for the index builds.
    op.execute("SET LOCAL lock_timeout = '2s'")
    op.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    op.execute("SET LOCAL lock_timeout = 0")


def upgrade() -> None:
    _lock_events()
    op.execute("DROP TRIGGER events_keys ON events")
    op.execute("DROP FUNCTION trajstore_guard_keys()")
    op.execute("DROP INDEX ix_events_stream_id_stream_version")
    op.execute(_PARTITION_KEYS)
    op.execute(
        """
CREATE TABLE event_keys_sealed (
    through timestamp with time zone NOT NULL,
    CONSTRAINT pk_event_keys_sealed PRIMARY KEY (through)
)"""
    )
    op.execute(
        "INSERT INTO event_keys_sealed (through) SELECT CASE WHEN EXISTS (SELECT FROM events) "
        "THEN date_trunc('day', now(), 'UTC') ELSE '-infinity' END"
    )
    op.execute(_GUARD_FUNCTION)
    op.execute(_CHECK_FUNCTION)
    op.execute(_ROW_TRIGGER)


def downgrade() -> None:
    _lock_events()
    op.execute("DROP TRIGGER events_keys ON events")
    op.execute("DROP FUNCTION trajstore_check_keys(text[], bigint[], bigint[])")
    op.execute("DROP FUNCTION trajstore_guard_keys()")
    # event_keys held every key before: the days not sealed give theirs back.
    op.execute(
        "INSERT INTO event_keys (event_id, stream_id, stream_version) "
        "SELECT event_id, stream_id, stream_version FROM events ON CONFLICT DO NOTHING"
    )
    op.execute("DROP TABLE event_keys_sealed")
    op.execute(_DROP_PARTITION_KEYS)
    op.execute(
        "CREATE INDEX ix_events_stream_id_stream_version ON events (stream_id, stream_version)"
    )
    op.execute(_NAME_STREAM_INDEXES)
    op.execute(_OLD_GUARD_FUNCTION)
    op.execute(_OLD_STATEMENT_TRIGGER)
