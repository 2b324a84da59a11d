"""What the routes of the proxy's HTTP API share: the running proxy (`ProxyState`, built when the
app starts), FastAPI's dependencies on it, and who may call a route (`proxy.auth`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Header, Request

from trajstore.proxy.admission import Admission
from trajstore.proxy.auth import admin_key_is_valid, require_orchestrator_key, require_session_key
from trajstore.proxy.engines import EnginePool
from trajstore.proxy.errors import Unauthorized
from trajstore.proxy.forwarding import Forwarder
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.reads import Reader
from trajstore.proxy.sessions import SessionRegistry
from trajstore.proxy.settings import ProxySettings
from trajstore.store import EventStore


@dataclass
class ProxyState:
    """Everything a request handler needs, built at startup."""

    settings: ProxySettings
    store: EventStore
    registry: SessionRegistry
    forwarder: Forwarder
    engines: EnginePool
    metrics: ProxyMetrics
    public_url: str
    admission: Admission
    reader: Reader


async def _state(request: Request) -> ProxyState:
    # async on purpose: FastAPI runs a plain `def` dependency in a thread pool, per request.
    state: ProxyState = request.app.state.proxy
    return state


#: A route's running proxy.
State = Annotated[ProxyState, Depends(_state)]
#: A route's `Authorization` header, if any.
Authorization = Annotated[str | None, Header()]


def require_admin(state: ProxyState, authorization: str | None) -> None:
    """Refuse (401) a caller without the proxy's API key."""
    if not admin_key_is_valid(state.settings.api_key, authorization):
        raise Unauthorized("this call needs the proxy's API key (TRAJSTORE_API_KEY) as Bearer")


def require_session(
    state: ProxyState, session_id: str, authorization: str | None, *, model_call: bool = False
) -> None:
    """Refuse a caller without the session's key (or the admin's, `proxy.auth`)."""
    require_session_key(
        state.registry, state.settings.api_key, session_id, authorization, model_call=model_call
    )


def require_orchestrator(state: ProxyState, session_id: str, authorization: str | None) -> None:
    """Refuse a caller without the session's orchestrator key (or the admin's, `proxy.auth`)."""
    require_orchestrator_key(state.registry, state.settings.api_key, session_id, authorization)
