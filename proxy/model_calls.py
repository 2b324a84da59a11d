"""The model-call routes, served straight from ASGI in front of the FastAPI app.

    POST /sessions/{id}/v1/chat/completions     POST /v1/chat/completions   (X-Session-Id)
    POST /sessions/{id}/v1/completions          POST /v1/completions        (X-Session-Id)
    POST /sessions/{id}/v1/messages             POST /v1/messages           (Anthropic)
    POST /sessions/{id}/v1/messages/count_tokens
    POST /sessions/{id}/v1/responses            POST /v1/responses          (OpenAI Responses)

These are the proxy's hot path: every turn of every agent comes through here, and a stream sends
dozens of writes. Measured here, FastAPI's routing, dependency injection and middleware layers
(each wrapping every write) cost about as much CPU as the relay itself, so these four routes
bypass them, all of them: `proxy.app.ProxyApp` hands every request to `ModelCalls` before
FastAPI and Starlette see it. The body is read with its limit, the caller's key checked, the
request admitted among its run's (`proxy.admission`: it may wait, or be refused with 429), and the
`Forwarder`'s response sent as-is. Everything else (sessions, admin, metrics) goes to FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from trajstore.proxy.admission import RateLimited, Ticket
from trajstore.proxy.apis import TRANSLATIONS, as_chat, dropped_json
from trajstore.proxy.auth import require_session_key
from trajstore.proxy.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    ProxyError,
    from_bug,
    from_store_error,
)
from trajstore.proxy.recorder import RequestRecorder, new_request_id
from trajstore.proxy.sessions import Session
from trajstore.proxy.wire import Api
from trajstore.store import StoreError

log = logging.getLogger(__name__)

#: Headers of the agent's that never reach the engine.
_KEPT = frozenset({"x-session-id", "x-api-key"})

#: Path (after /v1/) -> API. `count_tokens` is Anthropic's, answered without the model.
_APIS: dict[str, Api | Literal["count_tokens"]] = {
    "chat/completions": "chat",
    "completions": "completions",
    "messages": "messages",
    "messages/count_tokens": "count_tokens",
    "responses": "responses",
}


def match(path: str) -> tuple[Api | Literal["count_tokens"], str | None] | None:
    """(api, session id from the path or None) for a model-call path, else None."""
    if path.startswith("/v1/"):
        api = _APIS.get(path[4:])
        return None if api is None else (api, None)
    if path.startswith("/sessions/"):
        session_id, _, rest = path[10:].partition("/v1/")
        api = _APIS.get(rest)
        if api is not None and session_id and "/" not in session_id:
            return api, session_id
    return None


def presented_key(headers: dict[str, str]) -> str | None:
    """The caller's key as an `Authorization` value: OpenAI clients send a Bearer token, the
    Anthropic SDK its `x-api-key` (Claude-Code-style CLIs either, per their settings)."""
    authorization = headers.get("authorization")
    if authorization is None and "x-api-key" in headers:
        return f"Bearer {headers['x-api-key']}"
    return authorization


class ModelCalls:
    """ASGI middleware answering the model-call routes itself; the rest goes to `app`.

    `state` gives the running proxy's `ProxyState` (built when the app starts).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, state: Callable[[], Any]) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = match(scope["path"])
        if route is None:
            await self.app(scope, receive, send)
            return
        api, session_id = route
        shape = "messages" if api == "count_tokens" else api
        try:
            response, ticket = await self._respond(scope, receive, api, session_id)
        except _AgentLeft:
            return  # while its request waited: nobody to answer (the abandon is recorded)
        except ProxyError as exc:
            await send_error(send, exc, shape)
            return
        except StoreError as exc:
            await send_error(send, from_store_error(exc), shape)
            return
        except Exception as exc:  # a bug of ours: logged, and answered in the API's shape
            log.exception("serving a model call failed")
            await send_error(send, from_bug(exc), shape)
            return
        try:
            await response(scope, receive, send)
        finally:
            if ticket is not None:
                ticket.release()  # streamed to the end, or cut: its place goes to the next

    async def _respond(
        self,
        scope: Scope,
        receive: Receive,
        api: Api | Literal["count_tokens"],
        session_id: str | None,
    ) -> tuple[Any, Ticket | None]:
        state = self.state()
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        session_id = session_id or headers.get("x-session-id")
        if not session_id:
            raise NotFound(
                "no session: use the base_url returned by POST /sessions, "
                "or send the X-Session-Id header"
            )
        require_session_key(
            state.registry, state.settings.api_key, session_id, presented_key(headers),
            model_call=True,
        )  # fmt: skip
        check_declared(headers.get("content-length", ""), self.max_body_bytes)
        body = await self._read_body(receive)
        session = await state.registry.ready_for_requests(session_id)
        if api == "count_tokens":
            return await state.forwarder.count_tokens(session, body), None
        ticket = await admit(state, api, session, body, receive)
        try:
            # The agent's own X-* headers go on to the engine (vLLM's X-Request-Id); its key never.
            passed_on = {k: v for k, v in headers.items() if k.startswith("x-") and k not in _KEPT}
            return await state.forwarder.handle(api, session, body, passed_on), ticket
        except BaseException:
            ticket.release()
            raise

    async def _read_body(self, receive: Receive) -> bytes:
        receive = limited(receive, self.max_body_bytes)
        parts: list[bytes] = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise BadRequest("the client went away before sending its body")
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                return b"".join(parts)


class _AgentLeft(Exception):
    """The agent hung up while its request waited for admission."""


async def admit(state: Any, api: Api, session: Session, body: bytes, receive: Receive) -> Ticket:
    """Wait for the request's turn among its run's and the other runs' (`proxy.admission`).

    A refusal (429) and an agent that leaves while waiting are recorded as the request's own
    `request_received` + `request_failed`, as an engine's refusal is: nothing is dropped
    silently.
    """
    admission, metrics = state.admission, state.metrics
    admission.offer(session.run_id, session.rate_limit, session.created_at)
    run = metrics.run_label(session.run_id)
    try:
        ticket: Ticket = admission.request(session.run_id)
    except RateLimited as exc:
        metrics.rate_limited.labels(run=run).inc()
        metrics.requests.labels(api=api, status="429").inc()
        await record_refusal(state, api, session, body, "rate_limited", exc.message, 429)
        raise
    if not ticket.ready:
        try:
            left = await _until_admitted(ticket, receive)
        except BaseException:  # cancelled (the server stops): leave the queue
            ticket.cancel()
            raise
        if left:
            ticket.cancel()
            metrics.left_queued.labels(run=run).inc()
            metrics.requests.labels(api=api, status="499").inc()
            message = f"the agent left after {ticket.waited:.3f}s waiting for admission"
            await record_refusal(state, api, session, body, "client_disconnected", message, None)
            raise _AgentLeft()
    metrics.admitted.labels(run=run).inc()
    if ticket.tracked:
        metrics.admission_wait.labels(run=run).observe(ticket.waited)
    return ticket


async def _until_admitted(ticket: Ticket, receive: Receive) -> bool:
    """Wait until the ticket is admitted (False) or the agent hangs up first (True).

    The body is read, so the next message the server gives is the disconnect.
    """

    async def agent_left() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    assert ticket.admitted is not None
    watcher = asyncio.ensure_future(agent_left())
    try:
        await asyncio.wait({ticket.admitted, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    return not ticket.ready


async def record_refusal(
    state: Any,
    api: Api,
    session: Session,
    raw: bytes,
    reason: str,
    message: str,
    status: int | None,
) -> None:
    """Record a request the proxy did not forward: its `request_received` (no engine chosen)
    and its `request_failed`. A body that is not valid is a 400 instead, as it would have been."""
    body, chat, asked, _, dropped, images = as_chat(api, raw, state.settings.hosted_tools)
    # No engine was chosen; the policy is the one the session's engine would have served.
    engines = state.engines
    policy_version = (
        engines.preferred(session.session_id).policy_version
        if engines.engines
        else state.settings.policy_version
    )
    tracer = state.forwarder.tracer  # a refused call is a call: its span says why (`error.type`)
    recorder = RequestRecorder(
        state.registry.writer,
        session_id=session.session_id,
        run_id=session.run_id,
        request_id=new_request_id(),
        max_image_bytes=state.settings.max_image_bytes,
        image_token_id=state.settings.image_token_id,
        on_ended=None if tracer is None else tracer.call(
            api=api, session=session, engine="", policy_version=policy_version, body=body
        ),
    )  # fmt: skip
    received = recorder.received_event(
        api=api,
        body=body,
        chat=chat,
        engine="",
        policy_version=policy_version,
        logprobs_mode=state.settings.logprobs_mode,
        asked=asked,
        replica=state.forwarder.replica_id,
        dropped_tools=dropped_json(dropped),
        images=images,
    )
    await recorder.emit(received)
    await recorder.failed(reason, message, status)


class BodyLimit:
    """Refuse bodies over the limit with 413 before reading them (pure ASGI, no buffering);
    for the FastAPI routes (`ModelCalls` applies the same limit to its own)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"").decode("latin-1")
        try:
            check_declared(declared, self.max_bytes)
        except PayloadTooLarge as exc:
            await send_error(send, exc)
            return
        await self.app(scope, limited(receive, self.max_bytes), send)


def too_large(size: int, limit: int) -> PayloadTooLarge:
    """The 413 for a body of `size` bytes."""
    return PayloadTooLarge(f"the request body is {size} bytes; the limit is {limit} bytes")


def check_declared(content_length: str, limit: int) -> None:
    """Refuse a body whose declared length is over the limit, before reading any of it."""
    if content_length.isdigit() and int(content_length) > limit:
        raise too_large(int(content_length), limit)


def limited(receive: Receive, limit: int) -> Receive:
    """`receive`, raising `PayloadTooLarge` once more than `limit` body bytes came in."""
    seen = 0

    async def counting_receive() -> Message:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            raise too_large(seen, limit)
        return message

    return counting_receive


async def send_error(send: Send, error: ProxyError, api: str = "chat") -> None:
    """Answer with an error in the API's shape (OpenAI's by default), straight over ASGI."""
    translation = TRANSLATIONS.get(api)
    body = orjson.dumps(error.body() if translation is None else translation.error_body(error))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers().items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
