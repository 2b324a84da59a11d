"""One client for trajstore sessions: create one, hand it to an agent, reward, finish, read back.

    from trajstore.client import Client

    with Client("http://127.0.0.1:8400") as proxy:
        with proxy.session("my-run", task_id="task-1", group_id="task-1") as session:
            agent = openai.OpenAI(base_url=session.base_url, api_key=session.api_key)
            ...                                   # the agent works through the proxy
            session.reward(1.0)
        # finished `completed` on leaving the block; an exception finishes it `error` (with the
        # exception's message as the reason) and goes on up

`AsyncClient` is the same with `await` and `async with`. The session's `base_url` is what an
OpenAI client takes, `anthropic_base_url` what the Anthropic SDK takes, `api_key` serves both
and only calls models; `env()` gives them as the environment variables agents read. The
orchestrator's key (rewards, finishes, discards) stays inside the session object. Reading back:
`turns()` (the proxy's `GET /sessions/{id}`), `turn(n)` (`GET /sessions/{id}/turns/{n}`, one
turn whole), and, given the store's `database_url`, `record()` and `samples()`: the session
rebuilt from the log and the samples the projector makes of it (`store.recorded`).

The HTTP API stays the contract (README.md, "The session API"); this module is its one client
in the project: the demo, `trajstore run`, the rollouts and the benchmarks use it.

Errors (`ClientError` is the root):

    ClientError
    ├── ProxyUnreachable   no answer from the proxy (connection refused, timed out)
    └── ProxyRefused       the proxy answered 4xx/5xx; `.status`, `.message` say why
        └── SessionClosed  409: the session is finished, discarded or past its deadline
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

try:
    import httpx
except ImportError as exc:  # a store-only install: the client is an extra
    raise ImportError("trajstore.client needs httpx: pip install 'trajstore[client]'") from exc

from trajstore.proxy.sessions import CreateSession
from trajstore.store.eventstore import EventStore
from trajstore.store.recorded import recorded_samples, recorded_session
from trajstore.store.samples import Sample
from trajstore.store.sessions import SessionRecord

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How much of an exception's message becomes a finish's reason.
REASON_CHARS = 500


class ClientError(Exception):
    """The session API could not do what was asked."""


class ProxyUnreachable(ClientError):
    """The proxy did not answer."""


class ProxyRefused(ClientError):
    """The proxy answered with an error status."""

    def __init__(self, method: str, url: str, status: int, message: str) -> None:
        self.status, self.message = status, message
        super().__init__(f"{method} {url}: {status} {message}")


class SessionClosed(ProxyRefused):
    """The session is finished, discarded or past its deadline (409)."""


@dataclass(frozen=True)
class SessionInfo:
    """What an agent gets of a session: where to point its client, and its key."""

    session_id: str
    run_id: str
    base_url: str  #: an OpenAI client's base_url (OPENAI_BASE_URL); ends in /v1
    anthropic_base_url: str  #: the Anthropic SDK's base_url (ANTHROPIC_BASE_URL)
    api_key: str  #: calls models for this session only (never the orchestrator's key)

    def env(self) -> dict[str, str]:
        """The environment variables an agent process reads to reach this session."""
        return {
            "OPENAI_BASE_URL": self.base_url,
            "OPENAI_API_KEY": self.api_key,
            "ANTHROPIC_BASE_URL": self.anthropic_base_url,
            "ANTHROPIC_API_KEY": self.api_key,
            "TRAJSTORE_SESSION_ID": self.session_id,
        }


def exit_status(error: BaseException | None) -> tuple[str, str | None]:
    """How a session ends when its block ends: `completed`, or the status and reason an
    exception stands for (`timeout`, `aborted` when cancelled or interrupted, else `error`)."""
    if error is None:
        return "completed", None
    reason = f"{type(error).__name__}: {error}"[:REASON_CHARS]
    if isinstance(error, TimeoutError):
        return "timeout", reason
    if isinstance(error, asyncio.CancelledError | KeyboardInterrupt):
        return "aborted", reason
    return "error", reason


class _Calls:
    """The session API's requests and how its answers read, shared by both clients."""

    def __init__(self, proxy_url: str, api_key: str | None) -> None:
        self.url = proxy_url.rstrip("/")
        self.admin_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Request:
        return httpx.Request(method, f"{self.url}{path}", json=body, headers=self.admin_headers)

    def create(self, run_id: str, fields: dict[str, Any]) -> httpx.Request:
        # The proxy's own model of the body (pydantic only, no server): a misspelt or
        # ill-typed field fails here, naming it, before anything is sent.
        body = CreateSession(run_id=run_id, **fields).model_dump(mode="json", exclude_none=True)
        return self.admin("POST", "/sessions", body)

    @staticmethod
    def answer(request: httpx.Request, response: httpx.Response) -> Any:
        """The answer's JSON; `ProxyRefused` (or `SessionClosed`) saying why when it failed."""
        if response.status_code < 400:
            return response.json()
        try:
            message = str(response.json()["error"]["message"])
        except (ValueError, KeyError, TypeError):
            message = response.text[:REASON_CHARS]
        error = SessionClosed if response.status_code == 409 else ProxyRefused
        raise error(request.method, str(request.url), response.status_code, message)


class _ClientBase:
    """What both clients hold: the requests, the store's URL, and how they are configured."""

    def __init__(
        self,
        proxy_url: str,
        *,
        api_key: str | None = None,
        database_url: str | None = None,
        timeout: float = 60.0,
        transport: Any = None,
    ) -> None:
        """`api_key`: the proxy's admin key (TRAJSTORE_API_KEY), when it has one.
        `database_url`: the store, for `record()` and `samples()`. `transport`: httpx's (for
        tests and custom networking)."""
        self.calls = _Calls(proxy_url, api_key)
        self.database_url = database_url
        self.options: dict[str, Any] = {"timeout": timeout, "transport": transport}


class _SessionBase:
    """What both session handles hold: the agent's side, the orchestrator's key, the state."""

    def __init__(self, calls: _Calls, answer: dict[str, Any]) -> None:
        fields = SessionInfo.__dataclass_fields__
        self.info = SessionInfo(**{name: str(answer[name]) for name in fields})
        self.session_id, self.run_id = self.info.session_id, self.info.run_id
        self.base_url, self.api_key = self.info.base_url, self.info.api_key
        self.anthropic_base_url = self.info.anthropic_base_url
        self._calls, self._key = calls, str(answer["orchestrator_key"])
        self.closed: str | None = None  #: the status it was finished with, or "discarded"

    def env(self) -> dict[str, str]:
        """The environment variables an agent process reads (`SessionInfo.env`)."""
        return self.info.env()

    def request(self, method: str, path: str, body: Any = None, **params: Any) -> httpx.Request:
        """A request on this session, with the orchestrator's key."""
        url = f"{self._calls.url}/sessions/{self.session_id}{path}"
        params = {k: v for k, v in params.items() if v is not None}
        headers = {"Authorization": f"Bearer {self._key}"}
        return httpx.Request(method, url, json=body, headers=headers, params=params)

    def _reward(self, value: float, components: Any, source: str | None) -> httpx.Request:
        return self.request("POST", "/reward", {"value": value, "components": components,
                                                "source": source})  # fmt: skip

    def _finish(self, status: str, reason: str | None, main_lineage: int | None) -> httpx.Request:
        body: dict[str, Any] = {"status": status, "reason": reason}
        if main_lineage is not None:
            body["main_lineage"] = main_lineage
        return self.request("POST", "/finish", body)

    def _closing(self, error: BaseException | None) -> tuple[str, str | None] | None:
        """The finish a block's end calls for, or None when the session is closed already."""
        return None if self.closed is not None else exit_status(error)

    def _not_closed(self, failure: ClientError, error: BaseException | None, status: str) -> None:
        """A finish at a block's end failed: closed meanwhile (its deadline) is no failure; else
        raise, unless the block's own exception is on its way up (then log, and let it go)."""
        if isinstance(failure, SessionClosed):
            self.closed = "closed"
        elif error is None:
            raise failure
        else:
            log.error("session %s: could not finish it as %s: %s", self.session_id, status,
                      failure)  # fmt: skip


class Client(_ClientBase):
    """The session API from synchronous code (see the module docstring)."""

    def __init__(self, proxy_url: str, **options: Any) -> None:
        """As `_ClientBase`'s: `api_key`, `database_url`, `timeout`, `transport`."""
        super().__init__(proxy_url, **options)
        self.http = httpx.Client(**self.options)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP connections."""
        self.http.close()

    def send(self, request: httpx.Request) -> Any:
        """Send one request of the session API; its answer's JSON."""
        try:
            response = self.http.send(request)
        except httpx.TransportError as exc:
            raise ProxyUnreachable(f"{request.method} {request.url}: {exc!r}") from exc
        return self.calls.answer(request, response)

    def create_session(self, run_id: str, **fields: Any) -> Session:
        """`POST /sessions`: `task_id`, `group_id`, `deadline_s`, `metadata`, `session_id`,
        `rate_limit` (`proxy.sessions.CreateSession`); the same `session_id` again returns the
        same session."""
        return Session(self, self.send(self.calls.create(run_id, fields)))

    @contextmanager
    def session(self, run_id: str, **fields: Any) -> Iterator[Session]:
        """A new session (`create_session`'s arguments) finished when the block ends: as
        `completed`, or as `error` (`timeout`, `aborted`) with the exception's message."""
        session = self.create_session(run_id, **fields)
        try:
            yield session
        except BaseException as exc:
            session.close_after(exc)
            raise
        session.close_after(None)


class Session(_SessionBase):
    """One session, from synchronous code."""

    def __init__(self, client: Client, answer: dict[str, Any]) -> None:
        super().__init__(client.calls, answer)
        self.client = client

    def reward(
        self, value: float, *, components: dict[str, float] | None = None, source: str | None = None
    ) -> None:
        """`POST /sessions/{id}/reward`."""
        self.client.send(self._reward(value, components, source))

    def finish(
        self, status: str = "completed", *, reason: str | None = None,
        main_lineage: int | None = None,
    ) -> str:  # fmt: skip
        """`POST /sessions/{id}/finish`; the status the session ended with."""
        self.closed = str(self.client.send(self._finish(status, reason, main_lineage))["status"])
        return self.closed

    def discard(self, reason: str) -> None:
        """`POST /sessions/{id}/discard`: kept in the log, out of training."""
        self.client.send(self.request("POST", "/discard", {"reason": reason}))
        self.closed = "discarded"

    def turns(self, *, after: int | None = None, limit: int | None = None) -> dict[str, Any]:
        """`GET /sessions/{id}`: the session as recorded; with `after`/`limit`, a page of it."""
        answer: dict[str, Any] = self.client.send(self.request("GET", "", after=after, limit=limit))
        return answer

    def turn(self, n: int) -> dict[str, Any]:
        """`GET /sessions/{id}/turns/{n}`: turn `n`, whole."""
        answer: dict[str, Any] = self.client.send(self.request("GET", f"/turns/{n}"))
        return answer

    def record(self) -> SessionRecord:
        """The session rebuilt from the log (needs the client's `database_url`)."""
        return asyncio.run(_read(self.client.database_url, self.session_id, recorded_session))

    def samples(self) -> list[Sample]:
        """The samples the projector makes of the session, built from the log now."""
        return asyncio.run(_read(self.client.database_url, self.session_id, recorded_samples))

    def close_after(self, error: BaseException | None) -> None:
        """Finish the session as its block's end says (`exit_status`), unless it is closed."""
        if (ending := self._closing(error)) is not None:
            try:
                self.finish(ending[0], reason=ending[1])
            except ClientError as failure:
                self._not_closed(failure, error, ending[0])


class AsyncClient(_ClientBase):
    """The session API from async code (see the module docstring)."""

    def __init__(self, proxy_url: str, **options: Any) -> None:
        """As `Client`'s; the store (for `record()`, `samples()`) opens on first use."""
        super().__init__(proxy_url, **options)
        self.http = httpx.AsyncClient(**self.options)
        self._store: EventStore | None = None
        self._opening = asyncio.Lock()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the HTTP connections and the store's."""
        await self.http.aclose()
        if self._store is not None:
            await self._store.close()
            self._store = None

    async def send(self, request: httpx.Request) -> Any:
        """Send one request of the session API; its answer's JSON."""
        try:
            response = await self.http.send(request)
        except httpx.TransportError as exc:
            raise ProxyUnreachable(f"{request.method} {request.url}: {exc!r}") from exc
        return self.calls.answer(request, response)

    async def store(self) -> EventStore:
        """The store the proxy records into (the client's `database_url`), opened once."""
        async with self._opening:
            if self._store is None:
                self._store = await EventStore.open(_needed(self.database_url), max_size=2)
            return self._store

    async def set_policy_version(self, version: str, engine: str | None = None) -> None:
        """`POST /admin/engines/policy-version`: the version the engines (or `engine`) now serve,
        recorded with every request from here on (needs the admin key when the proxy has one)."""
        body = {"version": version, **({"engine": engine} if engine else {})}
        await self.send(self.calls.admin("POST", "/admin/engines/policy-version", body))

    async def create_session(self, run_id: str, **fields: Any) -> AsyncSession:
        """`POST /sessions`, as `Client.create_session`."""
        return AsyncSession(self, await self.send(self.calls.create(run_id, fields)))

    @asynccontextmanager
    async def session(self, run_id: str, **fields: Any) -> AsyncIterator[AsyncSession]:
        """A new session (`create_session`'s arguments) finished when the block ends: as
        `completed`, or as `error` (`timeout`, `aborted`) with the exception's message."""
        session = await self.create_session(run_id, **fields)
        try:
            yield session
        except BaseException as exc:
            # Shielded: a cancelled episode still records how it ended.
            await asyncio.shield(session.close_after(exc))
            raise
        await session.close_after(None)


class AsyncSession(_SessionBase):
    """One session, from async code."""

    def __init__(self, client: AsyncClient, answer: dict[str, Any]) -> None:
        super().__init__(client.calls, answer)
        self.client = client

    async def reward(
        self, value: float, *, components: dict[str, float] | None = None, source: str | None = None
    ) -> None:
        """`POST /sessions/{id}/reward`."""
        await self.client.send(self._reward(value, components, source))

    async def finish(
        self, status: str = "completed", *, reason: str | None = None,
        main_lineage: int | None = None,
    ) -> str:  # fmt: skip
        """`POST /sessions/{id}/finish`; the status the session ended with."""
        answer = await self.client.send(self._finish(status, reason, main_lineage))
        self.closed = str(answer["status"])
        return self.closed

    async def discard(self, reason: str) -> None:
        """`POST /sessions/{id}/discard`: kept in the log, out of training."""
        await self.client.send(self.request("POST", "/discard", {"reason": reason}))
        self.closed = "discarded"

    async def turns(self, *, after: int | None = None, limit: int | None = None) -> dict[str, Any]:
        """`GET /sessions/{id}`: the session as recorded; with `after`/`limit`, a page of it."""
        request = self.request("GET", "", after=after, limit=limit)
        answer: dict[str, Any] = await self.client.send(request)
        return answer

    async def turn(self, n: int) -> dict[str, Any]:
        """`GET /sessions/{id}/turns/{n}`: turn `n`, whole."""
        answer: dict[str, Any] = await self.client.send(self.request("GET", f"/turns/{n}"))
        return answer

    async def record(self) -> SessionRecord:
        """The session rebuilt from the log (needs the client's `database_url`)."""
        return await recorded_session(await self.client.store(), self.session_id)

    async def samples(self) -> list[Sample]:
        """The samples the projector makes of the session, built from the log now."""
        return await recorded_samples(await self.client.store(), self.session_id)

    async def close_after(self, error: BaseException | None) -> None:
        """Finish the session as its block's end says (`exit_status`), unless it is closed."""
        if (ending := self._closing(error)) is not None:
            try:
                await self.finish(ending[0], reason=ending[1])
            except ClientError as failure:
                self._not_closed(failure, error, ending[0])


def _needed(database_url: str | None) -> str:
    if not database_url:
        raise ClientError("reading a session back needs the store: pass database_url=")
    return database_url


async def _read(
    database_url: str | None,
    session_id: str,
    reader: Callable[[EventStore, str], Awaitable[T]],
) -> T:
    async with await EventStore.open(_needed(database_url), max_size=1) as store:
        return await reader(store, session_id)
