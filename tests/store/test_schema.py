"""The schema: Alembic's revisions produce exactly the declared metadata; events are immutable."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy.ext.asyncio import create_async_engine

from trajstore.store import EventStore, EventType, NewEvent, SchemaNotReady, migrations
from trajstore.store.connection import asyncpg_dsn, sqlalchemy_url
from trajstore.store.errors import MigrationBlocked
from trajstore.store.schema import metadata

# What the catalog says about everything trajstore owns, in a form two databases can compare.
CATALOG_QUERIES = {
    "columns": """
        SELECT table_name, column_name, data_type, udt_name, is_nullable, column_default,
               is_identity, identity_generation
        FROM information_schema.columns
        WHERE table_schema = 'public' AND table_name <> 'alembic_version'
          AND table_name NOT IN (SELECT inhrelid::regclass::text FROM pg_inherits)
        ORDER BY table_name, column_name""",
    # How large values are stored: pg_attribute's compression ('l' lz4, '' the default) and
    # storage ('x' compressed then out of line, 'e' out of line uncompressed).
    "storage": """
        SELECT attrelid::regclass::text, attname, attcompression, attstorage
        FROM pg_attribute
        WHERE attrelid::regclass::text IN ('events', 'samples') AND attnum > 0
          AND NOT attisdropped
        ORDER BY 1, 2""",
    "constraints": """
        SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid)
        FROM pg_constraint
        WHERE connamespace = 'public'::regnamespace
          AND conrelid::regclass::text <> 'alembic_version'
          AND conrelid NOT IN (SELECT inhrelid FROM pg_inherits)
        ORDER BY 1, 2""",
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname = 'public' AND tablename <> 'alembic_version'
          AND tablename NOT IN (SELECT inhrelid::regclass::text FROM pg_inherits)
        ORDER BY 1, 2""",
    "triggers": """
        SELECT tgrelid::regclass::text, tgname, pg_get_triggerdef(oid) FROM pg_trigger
        WHERE NOT tgisinternal AND tgparentid = 0 ORDER BY 1, 2""",
    # Partitions of events (store.partitions) are the log's data, not its schema: they clone the
    # parent's columns, indexes and row triggers, so the entries above leave them out. A new
    # store has the default one only.
    "partitions": """
        SELECT inhparent::regclass::text, inhrelid::regclass::text FROM pg_inherits
        WHERE inhparent IN (SELECT oid FROM pg_class WHERE relkind = 'p') ORDER BY 1, 2""",
    "functions": """
        SELECT proname, pg_get_functiondef(oid) FROM pg_proc
        WHERE pronamespace = 'public'::regnamespace ORDER BY 1""",
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = 'public' ORDER BY 1""",
    # Who may execute each function besides its owner ("-" is PUBLIC, every role).
    "function grants": """
        SELECT p.proname, coalesce(r.rolname, '-'), a.privilege_type
        FROM pg_proc p,
             aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) AS a
             LEFT JOIN pg_roles r ON r.oid = a.grantee
        WHERE p.pronamespace = 'public'::regnamespace AND a.grantee <> p.proowner
        ORDER BY 1, 2""",
    "grants": r"""
        SELECT grantee, table_name, privilege_type FROM information_schema.role_table_grants
        WHERE grantee LIKE 'trajstore\_%' ORDER BY 1, 2, 3""",
}


async def catalog(url: str) -> dict[str, list[tuple[Any, ...]]]:
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        return {
            name: [tuple(row) for row in await conn.fetch(sql)]
            for name, sql in CATALOG_QUERIES.items()
        }
    finally:
        await conn.close()


def _not_a_partition(name: str | None, type_: str, parent_names: Any) -> bool:
    # The events' partitions (events_default, events_YYYYMMDD) are not declared tables.
    return not (type_ == "table" and name is not None and name.startswith("events_"))


async def test_migrations_produce_exactly_the_declared_schema(
    database_url: str, empty_database_url: str
) -> None:
    # Alembic's own comparison: tables, columns, types, indexes, constraints.
    engine = create_async_engine(sqlalchemy_url(database_url))
    async with engine.connect() as conn:
        diff = await conn.run_sync(
            lambda sync: compare_metadata(
                MigrationContext.configure(sync, opts={"include_name": _not_a_partition}),
                metadata,
            )
        )
    await engine.dispose()
    assert diff == []

    # And what Alembic does not compare (triggers, functions, exact defaults): build the declared
    # schema in an empty database and compare the two catalogs entry by entry.
    engine = create_async_engine(sqlalchemy_url(empty_database_url))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    await engine.dispose()
    migrated, declared = await catalog(database_url), await catalog(empty_database_url)
    for name in CATALOG_QUERIES:
        assert migrated[name] == declared[name], name
    assert len(migrated["triggers"]) == 6
    assert len(migrated["functions"]) == 7  # with side data's two decoders
    assert migrated["partitions"] == [("events", "events_default")]
    assert [view for view, _ in migrated["views"]] == [
        "policy_switches", "sample_versions", "scoring_failures", "side_data", "trajectories",
        "turn_versions", "turns",
    ]  # fmt: skip
    grants = {(who, table, what) for who, table, what in migrated["grants"]}
    assert {(t, w) for who, t, w in grants if who == "trajstore_reader"} == {
        ("samples", "SELECT"), ("trajectories", "SELECT"), ("turns", "SELECT"),
        ("policy_switches", "SELECT"), ("turn_versions", "SELECT"), ("sample_versions", "SELECT"),
        ("side_data", "SELECT"), ("scoring_failures", "SELECT"),
    }  # fmt: skip
    # The function reading events with its owner's rights: the reader's to execute, no one else's.
    assert [g for g in migrated["function grants"] if g[0] == "trajstore_turn_messages"] == [
        ("trajstore_turn_messages", "trajstore_reader", "EXECUTE")
    ]
    # The proxy's role reads and appends events (and reads the keys that guard their uniqueness)
    # and nothing else; the projector's reads events.
    assert {(t, w) for who, t, w in grants if who == "trajstore_recorder"} == {
        ("events", "INSERT"), ("events", "SELECT"), ("event_keys", "SELECT")
    }  # fmt: skip
    assert {w for who, t, w in grants if who == "trajstore_projector" and t == "events"} == {
        "SELECT"
    }


async def test_downgrade_to_base_removes_everything_and_upgrade_restores_it(
    database_url: str,
) -> None:
    before = await catalog(database_url)
    await asyncio.to_thread(migrations.downgrade, database_url, "base")
    emptied = await catalog(database_url)
    assert emptied["triggers"] == []
    assert emptied["functions"] == []
    assert emptied["columns"] == []
    assert emptied["views"] == emptied["grants"] == []
    await asyncio.to_thread(migrations.upgrade, database_url)
    assert await catalog(database_url) == before


async def test_the_facts_index_migration_reruns_over_what_a_cut_off_build_left(
    database_url: str,
) -> None:
    # Migration 0005 builds its index CONCURRENTLY, outside a transaction: cut off, it leaves an
    # index behind without stamping the version. The rerun must replace it, not fail on it.
    before = await catalog(database_url)
    await asyncio.to_thread(migrations.downgrade, database_url, "0004_fact_notify")
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await conn.execute("CREATE INDEX ix_events_session_facts ON events (run_id)")
    finally:
        await conn.close()
    await asyncio.to_thread(migrations.upgrade, database_url)
    assert await catalog(database_url) == before


async def test_the_compression_migration_gives_up_quickly_behind_a_long_reader(
    database_url: str,
) -> None:
    # Migration 0006 takes an ACCESS EXCLUSIVE lock on events. Behind an open transaction that
    # read events it must fail within its 2 s lock timeout, not queue appends indefinitely.
    before = await catalog(database_url)
    await asyncio.to_thread(migrations.downgrade, database_url, "0005_facts_index")  # before 0006
    reader = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        async with reader.transaction():
            await reader.fetchval("SELECT count(*) FROM events")  # holds its lock until the end
            started = time.monotonic()
            with pytest.raises(MigrationBlocked, match="long transaction holds it"):
                await asyncio.to_thread(migrations.upgrade, database_url)
            assert time.monotonic() - started < 10
    finally:
        await reader.close()
    await asyncio.to_thread(migrations.upgrade, database_url)  # the reader gone, it goes through
    assert await catalog(database_url) == before


async def test_opening_an_unmigrated_database_says_to_migrate(empty_database_url: str) -> None:
    with pytest.raises(SchemaNotReady, match="trajstore migrate"):
        await EventStore.open(empty_database_url)


@pytest.mark.parametrize(
    "statement",
    [
        "UPDATE events SET event_type = 'session_finished'",
        "DELETE FROM events",
        "TRUNCATE events",
    ],
)
async def test_events_cannot_be_changed_or_removed(store: EventStore, statement: str) -> None:
    await store.append("session-a", [NewEvent(EventType.SESSION_CREATED, session_id="a")])
    with pytest.raises(asyncpg.RestrictViolationError, match="events are immutable"):
        await store.pool.execute(statement)
    assert len(await store.read_stream("session-a")) == 1


async def server_has_lz4(conn: asyncpg.Connection) -> bool:
    try:
        await conn.execute("CREATE TEMP TABLE lz4_probe (b bytea COMPRESSION lz4)")
    except asyncpg.FeatureNotSupportedError:
        return False
    await conn.execute("DROP TABLE lz4_probe")
    return True


async def test_a_long_request_body_is_compressed_with_lz4_where_the_server_has_it(
    store: EventStore,
) -> None:
    # A request's body is the conversation so far; pglz made storing it the most of what a
    # model call cost PostgreSQL (migration 0007).
    body = {"messages": [{"role": "user", "content": "def f(x): return x + 1\n" * 2000}]}
    event = NewEvent(EventType.REQUEST_RECEIVED, session_id="a", payload={"body": body})
    await store.append("request-r1", [event])
    async with store.pool.acquire() as conn:
        expected = "lz4" if await server_has_lz4(conn) else "pglz"
        method = await conn.fetchval(
            "SELECT pg_column_compression(payload) FROM events WHERE stream_id = 'request-r1'"
        )
    assert method == expected
    [stored] = await store.read_stream("request-r1")
    assert stored.payload == {"body": body}


async def test_token_arrays_are_compressed_with_lz4_or_not_at_all(store: EventStore) -> None:
    # pglz, PostgreSQL's default, is slow on token arrays (migration 0006): lz4 where the server
    # was built with it, else stored uncompressed. A long, repetitive prompt would be compressed.
    prompt = [1, 2, 3, 4] * 2000
    await store.append(
        "request-r1", [NewEvent(EventType.PROMPT_TOKENS, session_id="a", token_ids=prompt)]
    )
    async with store.pool.acquire() as conn:
        expected = "lz4" if await server_has_lz4(conn) else None
        method = await conn.fetchval(
            "SELECT pg_column_compression(token_ids) FROM events WHERE stream_id = 'request-r1'"
        )
    assert method == expected
    [event] = await store.read_stream("request-r1")
    assert event.token_ids is not None and event.token_ids.tolist() == prompt
