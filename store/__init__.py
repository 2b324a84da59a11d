"""trajstore's event store: an append-only log of what agents and models did, in PostgreSQL.

from trajstore.store import EventStore, NewEvent, EventType

async with await EventStore.open(url) as store:
    await store.append("session-1", [NewEvent(EventType.SESSION_CREATED, session_id="1")])
    async for event in store.subscribe(after=0):
        ...
"""

from trajstore.store.errors import (
    BadEvent,
    BadQuery,
    ConcurrencyError,
    DuplicateEventError,
    EmbeddedServerError,
    PayloadTooLarge,
    SchemaNotReady,
    SessionNotFound,
    StoreError,
    StoreUnavailable,
    WriteFailed,
    WriterBackpressure,
    WriterClosed,
    WriterError,
)
from trajstore.store.events import (
    EventType,
    ExpectedVersion,
    NewEvent,
    RecordedEvent,
    request_stream,
    session_stream,
)
from trajstore.store.eventstore import EventStore
from trajstore.store.subscription import Subscription
from trajstore.store.writer import EventWriter

__all__ = [
    "BadEvent",
    "BadQuery",
    "ConcurrencyError",
    "DuplicateEventError",
    "EmbeddedServerError",
    "EventStore",
    "EventType",
    "EventWriter",
    "ExpectedVersion",
    "NewEvent",
    "PayloadTooLarge",
    "RecordedEvent",
    "SchemaNotReady",
    "SessionNotFound",
    "StoreError",
    "StoreUnavailable",
    "Subscription",
    "WriteFailed",
    "WriterBackpressure",
    "WriterClosed",
    "WriterError",
    "request_stream",
    "session_stream",
]
