"""Every error the store raises, rooted at one class.

    StoreError
    ├── BadEvent                    an event cannot be stored as given (type, dtype, size, JSON)
    │   └── PayloadTooLarge
    ├── ConcurrencyError            a stream moved on: expected version != actual version
    ├── DuplicateEventError         an event id is already stored, but not as part of this batch
    ├── StoreUnavailable            PostgreSQL cannot be reached (after retries)
    ├── WriterError                 the background writer cannot take or keep events
    │   ├── WriterBackpressure      its queue is full: slow down (HTTP: 503 + Retry-After)
    │   ├── WriterClosed            it was closed; nothing more is accepted
    │   └── WriteFailed             events it accepted could not be made durable
    ├── SchemaNotReady              the database has not been migrated (`trajstore migrate`)
    ├── BadQuery                    a query given by a person (`trajstore sql`) failed
    ├── SessionNotFound             no events of this session (as of the position asked)
    ├── ArchiveError                archiving refused or failed: nothing was dropped
    └── EmbeddedServerError         the private PostgreSQL could not be set up, started or stopped

Driver errors (asyncpg, OS errors) are re-raised as the most specific of these, `from` the
original, so callers never need to import asyncpg to handle a failure.
"""

from __future__ import annotations


class StoreError(Exception):
    """The trajectory store failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class BadEvent(StoreError, ValueError):
    """The event cannot be stored as given."""


class PayloadTooLarge(BadEvent):
    """The event's payload is larger than the store accepts."""


class BadQuery(StoreError, ValueError):
    """The query failed; the message is PostgreSQL's, which says what is wrong with it."""


class SessionNotFound(StoreError, LookupError):
    """The store has no events of this session (as of the position asked)."""


class ConcurrencyError(StoreError):
    """The stream was changed by someone else: its version is not the one expected."""

    def __init__(self, stream_id: str, expected: int, actual: int) -> None:
        self.stream_id = stream_id
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"stream {stream_id!r} is at version {actual}, but the append expected {expected}"
        )


class DuplicateEventError(StoreError):
    """An event id in the batch is already stored, but the stored events are not this batch."""


class StoreUnavailable(StoreError):
    """PostgreSQL cannot be reached."""


class WriterError(StoreError):
    """The background event writer cannot take or keep events."""


class WriterBackpressure(WriterError):
    """The event writer's queue is full; retry after a short pause."""

    def __init__(self, pending: int, limit: int, retry_after: float) -> None:
        self.pending = pending
        self.limit = limit
        self.retry_after = retry_after
        super().__init__(
            f"the event writer is {pending} events behind (limit {limit}); "
            f"retry in {retry_after:.1f}s"
        )


class WriterClosed(WriterError):
    """The event writer is closed and accepts no more events."""


class WriteFailed(WriterError):
    """Events accepted by the writer could not be made durable."""


class SchemaNotReady(StoreError):
    """The database has no trajstore schema yet: run `trajstore migrate`."""


class MigrationBlocked(StoreError):
    """A migration gave up waiting for a table lock (a long transaction holds the table)."""


class EmbeddedServerError(StoreError):
    """The embedded PostgreSQL server could not be set up, started or stopped."""


class ArchiveError(StoreError):
    """Archiving was refused or failed; no partition was detached or dropped."""
