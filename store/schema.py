"""The database schema, declared once. Alembic revisions are tested to produce exactly this.

The `events` table is the source of truth and is append-only: triggers refuse UPDATE, DELETE and
TRUNCATE. A statement-level trigger sends a payload-less NOTIFY on `NOTIFY_CHANNEL` after every
insert, so live subscribers wake up; a row-level one notifies `FACTS_CHANNEL` only when a session
fact (`store.events.SESSION_FACTS`) is inserted, so the projector and the proxy replicas, which
care for nothing else, are not woken by every batch of tokens. Listeners never trust a
notification for content (see `store.subscription`).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    DDL,
    BigInteger,
    Boolean,
    Column,
    Double,
    Identity,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    PrimaryKeyConstraint,
    Table,
    Text,
    UniqueConstraint,
    event,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, TIMESTAMP, UUID
from sqlalchemy.dialects.postgresql.base import ischema_names
from sqlalchemy.types import UserDefinedType

from trajstore.store import keys, queries, roles, version_views, views

#: The channel live subscribers LISTEN on. Notifications carry no payload: they are a wake-up.
NOTIFY_CHANNEL = "trajstore_events"
#: Notified when a transaction inserts a session fact (finish, discard, reward); no payload.
FACTS_CHANNEL = "trajstore_facts"
#: The partition of `events` for rows outside every day's partition.
DEFAULT_PARTITION = "events_default"


class XID8(UserDefinedType[int]):
    """PostgreSQL's 64-bit, epoch-extended transaction id (`xid8`)."""

    cache_ok = True

    def get_col_spec(self, **kw: Any) -> str:
        return "XID8"


# Teach SQLAlchemy's reflection the type, so schema comparisons see xid8 rather than NullType.
ischema_names["xid8"] = XID8

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

events = Table(
    "events",
    metadata,
    Column("position", BigInteger, Identity(always=True), nullable=False),
    # The id of the writing transaction: readers order by (tx_id, position) and never read past
    # the oldest transaction still in flight, so a slow commit is never skipped.
    Column("tx_id", XID8, nullable=False, server_default=text("pg_current_xact_id()")),
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("stream_version", BigInteger, nullable=False),
    Column("session_id", Text),
    Column("run_id", Text),
    Column("event_type", Text, nullable=False),
    Column("recorded_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("token_ids", LargeBinary),  # little-endian int32, see store.tokens
    Column("logprobs", LargeBinary),  # little-endian float32, one per token id
    # Typed per-token arrays the payload describes (`store.side_data`): routed experts, a
    # teacher's logprobs; NULL for every other event.
    Column("side_data", LargeBinary),
    # A partitioned table's unique constraints must include its partition key, which would make
    # them refuse nothing: each partition has unique indexes of its own on `event_id` and
    # `(stream_id, stream_version)` (`store.keys`), and across partitions the keys are checked
    # as `store.keys` describes.
    PrimaryKeyConstraint("position", "recorded_at"),
    Index(None, "tx_id", "position"),
    # read_session: a session's events in log order, straight from the index, no sort.
    Index(None, "session_id", "tx_id", "position"),
    Index(None, "run_id"),
    # Session facts in log order (`queries.READ_FACTS`): the projector and the proxy replicas
    # find the next fact without scanning the tokens recorded since the last one.
    Index(
        "ix_events_session_facts",
        "tx_id",
        "position",
        postgresql_where=text(f"event_type IN ({queries.FACT_TYPES})"),
    ),
    # The sessions still active (`queries.ACTIVE_SESSION_STREAMS`, the proxy's reaper).
    Index(
        "ix_events_session_lifecycle",
        "session_id",
        "event_type",
        postgresql_where=text("event_type IN ('session_created', 'session_finished')"),
    ),
    # Daily range partitions (`store.partitions`) so that retention detaches whole days
    # (`store.archive`) instead of deleting rows from an append-only log.
    postgresql_partition_by="RANGE (recorded_at)",
)

#: The keys of sealed days (and each archived stream's last version): see `store.keys`.
event_keys = Table(
    "event_keys",
    metadata,
    Column("event_id", UUID(as_uuid=True), nullable=False),
    Column("stream_id", Text, nullable=False),
    Column("stream_version", BigInteger, nullable=False),
    PrimaryKeyConstraint("event_id"),
    UniqueConstraint("stream_id", "stream_version"),
)

#: One row: every event recorded before `through` has its keys in `event_keys` (-infinity, or no
#: row: none has).
event_keys_sealed = Table(
    "event_keys_sealed",
    metadata,
    Column("through", TIMESTAMP(timezone=True), nullable=False),
    PrimaryKeyConstraint("through"),
)


def _ddl(statement: str) -> DDL:
    return DDL(statement)  # type: ignore[no-untyped-call]


#: Training samples: a projection of the log (rebuildable from it, never the source of truth).
#: Token ids int32, loss mask uint8 (1 = the model generated it), behaviour logprobs float32,
#: all packed little-endian like the events' arrays.
samples = Table(
    "samples",
    metadata,
    Column("sample_id", UUID(as_uuid=True), nullable=False),
    Column("projection_version", Integer, nullable=False),
    Column("session_id", Text, nullable=False),
    Column("run_id", Text),
    Column("task_id", Text),
    Column("group_id", Text),
    Column("branch", Integer, nullable=False),
    Column("alternative_of", Integer),
    Column("is_final", Boolean, nullable=False),
    Column("status", Text, nullable=False),
    Column("finish_reason", Text),
    Column("reward", Double),
    Column("token_ids", LargeBinary, nullable=False),
    Column("loss_mask", LargeBinary, nullable=False),
    Column("logprobs", LargeBinary, nullable=False),
    Column("prompt_len", Integer, nullable=False),
    Column("response_len", Integer, nullable=False),
    Column("n_turns", Integer, nullable=False),
    Column("tool_turns", Integer, nullable=False),
    Column("policy_versions", ARRAY(Text), nullable=False),
    Column("engines", ARRAY(Text), nullable=False),
    Column("divergence", JSONB),
    Column("last_position", BigInteger, nullable=False),
    Column("projected_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    Column("tags", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    # The model requests the sample was built from, in order (their streams: `request-<id>`).
    Column("request_ids", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    Column("created_at", TIMESTAMP(timezone=True)),  # the session's creation
    Column("finished_at", TIMESTAMP(timezone=True)),  # the session's finish
    # Integer policy versions of the sample's turns (NULL when one is not an integer).
    Column("policy_version_min", BigInteger),
    Column("policy_version_max", BigInteger),
    # The images in the sample's messages: [{sha256, source, url, media_type, start, end}], the
    # span that of their placeholder ids in token_ids (`store.samples`); NULL for none.
    Column("images", JSONB),
    # Its conversation within the session (`store.lineages`): the lineage's index, its role
    # (main | subagent | side), the lineage it forked from and how many tokens they share.
    Column("lineage", Integer, nullable=False, server_default=text("0")),
    Column("role", Text, nullable=False, server_default=text("'main'")),
    Column("parent", Integer),
    Column("fork_at", Integer),
    # Which policy version generated which tokens: [{version, start, end}] over token_ids, the
    # generated tokens only (`store.samples`); NULL for rows projected before spans existed.
    Column("version_spans", JSONB),
    # Turn-level side data (`store.side_data`: routed experts) aligned with token_ids: the
    # arrays' specs ({kind, source, name, dtype, shape, offset, nbytes}) and their packed bytes.
    Column("side", JSONB),
    Column("side_data", LargeBinary),
    # Live readers (the trainer) tail rows in (projected_tx, projected_seq) order below the
    # horizon, exactly as readers of the log do (see queries.READ_ALL).
    Column("projected_tx", XID8, nullable=False, server_default=text("pg_current_xact_id()")),
    Column("projected_seq", BigInteger, Identity(always=True), nullable=False),
    # The same sample id in two projection versions (a rebuild) is the same sample.
    PrimaryKeyConstraint("projection_version", "sample_id"),
    Index(None, "projection_version", "run_id"),
    Index(None, "session_id"),
    Index(None, "projected_tx", "projected_seq"),
)

#: Which projection version readers are served (a rebuild writes a new one, then switches).
projection_serving = Table(
    "projection_serving",
    metadata,
    Column("name", Text, primary_key=True),
    Column("version", Integer, nullable=False),
    Column("switched_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
)

#: Where each projection has read the log up to, written in the same transaction as its output.
projection_checkpoints = Table(
    "projection_checkpoints",
    metadata,
    Column("name", Text, nullable=False),
    Column("version", Integer, nullable=False),
    Column("tx_id", XID8, nullable=False),
    Column("position", BigInteger, nullable=False),
    Column("updated_at", TIMESTAMP(timezone=True), nullable=False, server_default=text("now()")),
    PrimaryKeyConstraint("name", "version"),
)

# Each statement on its own: the asyncpg driver prepares statements, one command each. DDL() formats
# its text with `%`, hence the doubled `%%` in RAISE.
EVENTS_DDL = [
    _ddl(
        """
CREATE FUNCTION trajstore_refuse_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'trajstore events are immutable: %% on %% is refused', TG_OP, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'Append a new event (a correction, a discard) instead of changing one.';
END
$$"""
    ),
    # Rows that fall on no day's partition (maintenance fell behind) land here rather than being
    # refused; `trajstore partitions` reports them. It is never archived.
    _ddl(f"CREATE TABLE {DEFAULT_PARTITION} PARTITION OF events DEFAULT"),
    _ddl(
        queries.NAME_PARTITION_INDEXES.format(
            partition=DEFAULT_PARTITION, suffix="default"
        ).replace("%", "%%")
    ),
    *(
        _ddl(statement.format(partition=DEFAULT_PARTITION, suffix="default"))
        for statement in keys.PARTITION_UNIQUE_KEYS
    ),
    _ddl(keys.GUARD_KEYS_FUNCTION.replace("%", "%%")),
    _ddl(keys.CHECK_KEYS_FUNCTION.replace("%", "%%")),
    _ddl(keys.ROW_TRIGGER),
    _ddl(
        "CREATE TRIGGER events_no_update BEFORE UPDATE ON events "
        "FOR EACH ROW EXECUTE FUNCTION trajstore_refuse_change()"
    ),
    _ddl(
        "CREATE TRIGGER events_no_delete BEFORE DELETE ON events "
        "FOR EACH ROW EXECUTE FUNCTION trajstore_refuse_change()"
    ),
    _ddl(
        "CREATE TRIGGER events_no_truncate BEFORE TRUNCATE ON events "
        "FOR EACH STATEMENT EXECUTE FUNCTION trajstore_refuse_change()"
    ),
    # One wake-up function; each trigger names its channel (TG_ARGV[0]).
    _ddl(
        """
CREATE FUNCTION trajstore_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$$"""
    ),
    _ddl(
        "CREATE TRIGGER events_notify AFTER INSERT ON events "
        f"FOR EACH STATEMENT EXECUTE FUNCTION trajstore_notify('{NOTIFY_CHANNEL}')"
    ),
    # Row level with a WHEN clause: rows of other types queue no trigger call at all, and
    # PostgreSQL sends a transaction's identical notifications once.
    _ddl(
        "CREATE TRIGGER events_notify_facts AFTER INSERT ON events FOR EACH ROW "
        f"WHEN (NEW.event_type IN ({queries.FACT_TYPES})) "
        f"EXECUTE FUNCTION trajstore_notify('{FACTS_CHANNEL}')"
    ),
]

for _statement in EVENTS_DDL:
    event.listen(events, "after_create", _statement)

# Token arrays: lz4 where the server has it, else uncompressed. pglz, PostgreSQL's default, cost
# half of its CPU in the projector's COPY and gains little on int32 ids (migration 0006 says more).
# Payloads (a request's body is the whole conversation): lz4 where the server has it, else pglz
# (migration 0007).
COMPRESSION_DDL = """
DO $$
BEGIN
    ALTER TABLE events ALTER COLUMN token_ids SET COMPRESSION lz4,
        ALTER COLUMN logprobs SET COMPRESSION lz4,
        ALTER COLUMN payload SET COMPRESSION lz4,
        ALTER COLUMN side_data SET COMPRESSION lz4;
    ALTER TABLE samples ALTER COLUMN token_ids SET COMPRESSION lz4,
        ALTER COLUMN loss_mask SET COMPRESSION lz4,
        ALTER COLUMN logprobs SET COMPRESSION lz4,
        ALTER COLUMN side_data SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported THEN  -- a server built without lz4
    ALTER TABLE events ALTER COLUMN token_ids SET STORAGE EXTERNAL,
        ALTER COLUMN logprobs SET STORAGE EXTERNAL;
    ALTER TABLE samples ALTER COLUMN token_ids SET STORAGE EXTERNAL,
        ALTER COLUMN logprobs SET STORAGE EXTERNAL;
END
$$"""
event.listen(metadata, "after_create", _ddl(COMPRESSION_DDL))

# The views and the reader role come after every table (they read events and samples); the
# processes' grants (store.roles) come last.
for _sql in [*views.CREATE, *version_views.CREATE, *roles.CREATE]:
    event.listen(metadata, "after_create", _ddl(_sql))
for _sql in [*version_views.DROP, *views.DROP, *roles.DROP]:
    event.listen(metadata, "before_drop", _ddl(_sql))
