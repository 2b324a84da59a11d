"""Connections to PostgreSQL: one asyncpg pool per store, with the codecs the store relies on.

JSONB travels in binary form (a version byte, then UTF-8 JSON). On the way in a payload is
serialised exactly once (`NewEvent.payload_json`, or orjson for anything else); on the way out a
jsonb value arrives as the UTF-8 bytes of its JSON text, unparsed: readers of many events parse
only the payloads they look at (`RecordedEvent.payload`), which measured here keeps reads within
a few percent of raw asyncpg, where parsing every payload while fetching cost about 30%.
(asyncpg maps `xid8` to a Python int by itself.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import asyncpg
import orjson

from trajstore.store.errors import SchemaNotReady, StoreUnavailable

T = TypeVar("T")

#: Errors that mean "the connection or the server went away"; worth a retry.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError,  # includes ConnectionError: refused, reset, socket gone
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,  # "connection is closed", "connection was closed in the middle"
    asyncpg.AdminShutdownError,  # pg_terminate_backend, server stopping
    asyncpg.CannotConnectNowError,  # server starting up or shutting down
    asyncpg.TooManyConnectionsError,
    asyncpg.InternalClientError,  # the protocol is in a state it cannot leave: start afresh
)

#: Worth a retry with a new connection: the connection broke, or the server is not there.
RETRYABLE_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, StoreUnavailable)

_JSONB_VERSION = b"\x01"


def _encode_jsonb(value: Any) -> bytes:
    if isinstance(value, bytes):  # already serialised (NewEvent.payload_json)
        return _JSONB_VERSION + value
    return _JSONB_VERSION + orjson.dumps(value)


def _decode_jsonb(data: bytes) -> bytes:
    return data[1:]


async def init_connection(conn: asyncpg.Connection) -> None:
    """Install the store's codecs on a fresh connection."""
    await conn.set_type_codec(
        "jsonb",
        schema="pg_catalog",
        encoder=_encode_jsonb,
        decoder=_decode_jsonb,
        format="binary",
    )


def asyncpg_dsn(url: str) -> str:
    """Turn a SQLAlchemy-style URL (`postgresql+asyncpg://`) into one asyncpg accepts."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a database URL: {url!r}")
    return f"postgresql://{rest}" if scheme.startswith("postgres") else url


def sqlalchemy_url(url: str) -> str:
    """The same database as a SQLAlchemy URL with the asyncpg driver."""
    _, _, rest = url.partition("://")
    return f"postgresql+asyncpg://{rest}"


async def connect(url: str, *, application_name: str = "trajstore") -> asyncpg.Connection:
    """Open one connection with the store's codecs; `StoreUnavailable` when it cannot.

    `application_name` shows in `pg_stat_activity`, so operators can tell the writer and the
    subscribers apart.
    """
    try:
        conn = await asyncpg.connect(
            asyncpg_dsn(url), server_settings={"application_name": application_name}
        )
    except CONNECTION_ERRORS as exc:
        raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
    await init_connection(conn)
    return conn


async def create_pool(url: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """Open a connection pool with the store's codecs; `StoreUnavailable` when it cannot."""
    try:
        pool = await asyncpg.create_pool(
            asyncpg_dsn(url), min_size=min_size, max_size=max_size, init=init_connection
        )
    except CONNECTION_ERRORS as exc:
        raise StoreUnavailable(f"cannot connect to PostgreSQL: {exc}") from exc
    except asyncpg.InvalidAuthorizationSpecificationError as exc:
        if 'role "trajstore_' in str(exc):  # a process role (store.roles) not made yet
            raise SchemaNotReady(
                f"{exc}: run `trajstore migrate`, which creates the roles trajstore's processes "
                "connect as"
            ) from exc
        raise
    assert pool is not None
    return pool


_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*CONNECTION_ERRORS, TimeoutError)


async def close_quietly(conn: asyncpg.Connection | None) -> None:
    """Close a connection that may already be broken; terminate it if a clean close fails."""
    if conn is None or conn.is_closed():
        return
    try:
        await conn.close(timeout=2)
    except _CLOSE_ERRORS:
        conn.terminate()


@contextlib.asynccontextmanager
async def unavailable_as_store_error() -> AsyncIterator[None]:
    """Re-raise a lost connection as `StoreUnavailable`, keeping the driver error as the cause."""
    try:
        yield
    except CONNECTION_ERRORS as exc:
        raise StoreUnavailable(f"lost the connection to PostgreSQL: {exc}") from exc


async def with_connection(
    pool: asyncpg.Pool, work: Callable[[asyncpg.Connection], Awaitable[T]]
) -> T:
    """Run `work` on a pooled connection, translating connection loss to `StoreUnavailable`."""
    async with unavailable_as_store_error(), pool.acquire() as conn:
        return await work(conn)
