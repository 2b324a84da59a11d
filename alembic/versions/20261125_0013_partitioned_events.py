"""Partition `events` by day of `recorded_at`; event ids and stream versions stay unique in
`event_keys`.

A partitioned table's unique constraints must contain its partition key, so the two that made
appends safe (event ids: idempotent retries; (stream, version): optimistic concurrency) move to
`event_keys`, filled from each INSERT's or COPY's transition table by a statement trigger
(`store.schema`). Positions, transaction ids, triggers, views and grants are kept.

How: lock `events`, rename it, create the partitioned table with a partition per day the log
holds (and the default one), copy the rows in position order with their positions, fill
`event_keys` from them, point the views at the new table, drop the old one. ACCESS EXCLUSIVE on
`events` for the whole copy: appends and reads wait (measured here: about 10 s per million chunk
events, see docs/architecture.md). It gives up after 2 s when a long transaction holds `events`
(`MigrationBlocked`, as 0006 does) rather than queue every append behind its lock request.

Revision ID: 0013_partitioned_events
Revises: 0012_process_roles
Create Date: 2026-11-25
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0013_partitioned_events"
down_revision: str | None = "0012_process_roles"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Written out, not imported: a revision keeps the statements it was written with.
_COLUMNS = (
    "position, tx_id, event_id, stream_id, stream_version, session_id, run_id, event_type, "
    "recorded_at, payload, token_ids, logprobs"
)
_FACTS = "'session_finished', 'session_discarded', 'reward_assigned'"
_LIFECYCLE = "event_type IN ('session_created', 'session_finished')"

#: The columns of `events`, the same before and after this revision.
_COLUMNS_DDL = """
    position bigint GENERATED ALWAYS AS IDENTITY NOT NULL,
    tx_id xid8 DEFAULT pg_current_xact_id() NOT NULL,
    event_id uuid NOT NULL,
    stream_id text NOT NULL,
    stream_version bigint NOT NULL,
    session_id text,
    run_id text,
    event_type text NOT NULL,
    recorded_at timestamp with time zone DEFAULT now() NOT NULL,
    payload jsonb DEFAULT '{}'::jsonb NOT NULL,
    token_ids bytea,
    logprobs bytea,"""

_CREATE_PARTITIONED = f"""
CREATE TABLE events ({_COLUMNS_DDL}
    CONSTRAINT pk_events PRIMARY KEY (position, recorded_at)
) PARTITION BY RANGE (recorded_at)"""

_CREATE_PLAIN = f"""
CREATE TABLE events ({_COLUMNS_DDL}
    CONSTRAINT pk_events PRIMARY KEY (position),
    CONSTRAINT uq_events_event_id UNIQUE (event_id),
    CONSTRAINT uq_events_stream_id_stream_version UNIQUE (stream_id, stream_version)
)"""

_COMMON_INDEXES = [
    "CREATE INDEX ix_events_session_id_tx_id_position ON events (session_id, tx_id, position)",
    "CREATE INDEX ix_events_run_id ON events (run_id)",
    f"CREATE INDEX ix_events_session_facts ON events (tx_id, position) "
    f"WHERE event_type IN ({_FACTS})",
    f"CREATE INDEX ix_events_session_lifecycle ON events (session_id, event_type) "
    f"WHERE {_LIFECYCLE}",
    "CREATE INDEX ix_events_tx_id_position ON events (tx_id, position)",
]

_NAME_INDEXES = """
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

_GUARD_FUNCTION = """
CREATE FUNCTION trajstore_guard_keys() RETURNS trigger LANGUAGE plpgsql
SECURITY DEFINER SET search_path = public AS $$
BEGIN
    INSERT INTO event_keys (event_id, stream_id, stream_version)
    SELECT event_id, stream_id, stream_version FROM appended;
    RETURN NULL;
END
$$"""

_TRIGGERS = [
    "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
    "FOR EACH ROW EXECUTE FUNCTION trajstore_refuse_change()",
    "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
    "FOR EACH ROW EXECUTE FUNCTION trajstore_refuse_change()",
    "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
    "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_refuse_change()",
    "CREATE TRIGGER events_notify AFTER INSERT ON events "
    "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_notify('trajstore_events')",
    f"CREATE TRIGGER events_notify_facts AFTER INSERT ON events FOR EACH ROW "
    f"WHEN (NEW.event_type IN ({_FACTS})) EXECUTE FUNCTION trajstore_notify('trajstore_facts')",
]

_GRANTS = [
    "GRANT SELECT, INSERT ON events TO trajstore_recorder",
    "GRANT SELECT ON events TO trajstore_projector",
]

# The views that read events, oldest first, as the catalog prints them now: CREATE OR REPLACE
# with the same text binds them to the new table and keeps their grants.
_VIEW_DEFINITIONS = """
SELECT DISTINCT v.oid, v.relname, pg_get_viewdef(v.oid)
FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid JOIN pg_class v ON v.oid = r.ev_class
WHERE d.classid = 'pg_rewrite'::regclass AND d.refobjid = 'events'::regclass AND v.relkind = 'v'
ORDER BY v.oid"""


def _lock_events() -> None:
    # Wait at most 2 s for the lock (MigrationBlocked), then no limit for the copy itself.
    op.execute("SET LOCAL lock_timeout = '2s'")
    op.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
    op.execute("SET LOCAL lock_timeout = 0")


def _views() -> list[tuple[str, str]]:
    rows = op.get_bind().exec_driver_sql(_VIEW_DEFINITIONS).fetchall()
    return [(str(name), str(definition)) for _, name, definition in rows]


def _set_aside_old_table() -> None:
    """Rename the current table, and free the names of its indexes, constraints and sequence."""
    op.execute("ALTER TABLE events RENAME TO events_moving")
    op.execute("ALTER SEQUENCE events_position_seq RENAME TO events_moving_position_seq")
    op.execute("ALTER TABLE events_moving RENAME CONSTRAINT pk_events TO pk_events_moving")
    op.execute(
        """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT indexrelid::regclass::text FROM pg_index
                WHERE indrelid = 'events_moving'::regclass AND NOT indisprimary
                  AND indexrelid NOT IN (SELECT conindid FROM pg_constraint
                                         WHERE conrelid = 'events_moving'::regclass)
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
END
$$"""
    )
    op.execute(
        """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT conname FROM pg_constraint
                WHERE conrelid = 'events_moving'::regclass AND contype = 'u'
    LOOP
        EXECUTE format('ALTER TABLE events_moving DROP CONSTRAINT %I', name);
    END LOOP;
END
$$"""
    )


def _copy_storage_settings() -> None:
    """The new table's columns compress and store large values as the old one's did."""
    op.execute(
        """
DO $$
DECLARE
    col record;
BEGIN
    FOR col IN SELECT attname, attcompression, attstorage FROM pg_attribute
               WHERE attrelid = 'events_moving'::regclass AND attnum > 0 AND NOT attisdropped
    LOOP
        IF col.attcompression = 'l' THEN
            EXECUTE format('ALTER TABLE events ALTER COLUMN %I SET COMPRESSION lz4', col.attname);
        ELSIF col.attcompression = 'p' THEN
            EXECUTE format('ALTER TABLE events ALTER COLUMN %I SET COMPRESSION pglz', col.attname);
        END IF;
        EXECUTE format('ALTER TABLE events ALTER COLUMN %I SET STORAGE %s', col.attname,
                       CASE col.attstorage WHEN 'p' THEN 'PLAIN' WHEN 'e' THEN 'EXTERNAL'
                                           WHEN 'm' THEN 'MAIN' ELSE 'EXTENDED' END);
    END LOOP;
END
$$"""
    )


def _move_rows_and_finish(views: list[tuple[str, str]]) -> None:
    op.execute(
        f"INSERT INTO events ({_COLUMNS}) OVERRIDING SYSTEM VALUE "
        f"SELECT {_COLUMNS} FROM events_moving ORDER BY position"
    )
    op.execute(
        "SELECT setval(pg_get_serial_sequence('events', 'position'), "
        "coalesce((SELECT max(position) FROM events), 1), "
        "(SELECT max(position) FROM events) IS NOT NULL)"
    )
    for name, definition in views:
        op.execute(f"CREATE OR REPLACE VIEW {name} AS {definition}")
    op.execute("DROP TABLE events_moving")
    for statement in _GRANTS:
        op.execute(statement)


def upgrade() -> None:
    _lock_events()
    views = _views()
    _set_aside_old_table()
    op.execute(_CREATE_PARTITIONED)
    _copy_storage_settings()
    op.execute(
        """
CREATE TABLE event_keys (
    event_id uuid NOT NULL,
    stream_id text NOT NULL,
    stream_version bigint NOT NULL,
    CONSTRAINT pk_event_keys PRIMARY KEY (event_id),
    CONSTRAINT uq_event_keys_stream_id_stream_version UNIQUE (stream_id, stream_version)
)"""
    )
    for statement in _COMMON_INDEXES:
        op.execute(statement)
    op.execute(
        "CREATE INDEX ix_events_stream_id_stream_version ON events (stream_id, stream_version)"
    )
    # A partition for every UTC day the log holds, so that history never lands in the default
    # one (which would keep those days from ever getting a partition of their own).
    op.execute(
        """
DO $$
DECLARE
    day date;
    idx record;
BEGIN
    FOR day IN SELECT DISTINCT (recorded_at AT TIME ZONE 'UTC')::date FROM events_moving
    LOOP
        EXECUTE format(
            'CREATE TABLE %I PARTITION OF events FOR VALUES FROM (%L) TO (%L)',
            'events_' || to_char(day, 'YYYYMMDD'),
            day::text || ' 00:00:00+00', (day + 1)::text || ' 00:00:00+00');
        FOR idx IN SELECT c.relname AS child, p.relname AS parent FROM pg_inherits i
                   JOIN pg_class c ON c.oid = i.inhrelid JOIN pg_class p ON p.oid = i.inhparent
                   JOIN pg_index x ON x.indexrelid = c.oid
                   WHERE x.indrelid = ('events_' || to_char(day, 'YYYYMMDD'))::regclass
        LOOP
            EXECUTE format('ALTER INDEX %I RENAME TO %I', idx.child,
                           idx.parent || '_' || to_char(day, 'YYYYMMDD'));
        END LOOP;
    END LOOP;
END
$$"""
    )
    op.execute("CREATE TABLE events_default PARTITION OF events DEFAULT")
    op.execute(_NAME_INDEXES.format(partition="events_default", suffix="default"))
    # Keys in one set-based statement, before the triggers exist (no NOTIFY for old rows).
    op.execute(
        "INSERT INTO event_keys (event_id, stream_id, stream_version) "
        "SELECT event_id, stream_id, stream_version FROM events_moving"
    )
    _move_rows_and_finish(views)
    op.execute(_GUARD_FUNCTION)
    op.execute(
        "CREATE TRIGGER events_keys AFTER INSERT ON events REFERENCING NEW TABLE AS appended "
        "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_guard_keys()"
    )
    for statement in _TRIGGERS:
        op.execute(statement)
    op.execute("GRANT SELECT ON event_keys TO trajstore_recorder")


def downgrade() -> None:
    # Archived partitions are gone: a downgrade keeps what the log still holds.
    _lock_events()
    views = _views()
    op.execute("ALTER TABLE events RENAME TO events_moving")
    op.execute("ALTER SEQUENCE events_position_seq RENAME TO events_moving_position_seq")
    op.execute("ALTER TABLE events_moving RENAME CONSTRAINT pk_events TO pk_events_moving")
    op.execute(
        """
DO $$
DECLARE
    name text;
BEGIN
    FOR name IN SELECT indexrelid::regclass::text FROM pg_index
                WHERE indrelid = 'events_moving'::regclass AND NOT indisprimary
    LOOP
        EXECUTE format('DROP INDEX %s', name);
    END LOOP;
END
$$"""
    )
    op.execute(_CREATE_PLAIN)
    _copy_storage_settings()
    for statement in _COMMON_INDEXES:
        op.execute(statement)
    _move_rows_and_finish(views)
    op.execute("DROP TABLE event_keys")
    op.execute("DROP FUNCTION trajstore_guard_keys()")
    for statement in _TRIGGERS:
        op.execute(statement)
