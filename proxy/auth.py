"""Who may call what. The agent under training runs model-written code: it is untrusted, and it
holds its session's `api_key` (its OPENAI_API_KEY / ANTHROPIC_API_KEY).

    call                           admin key   orchestrator key   session api_key   no key
    model calls of the session     yes         no                 yes               no
    GET /sessions/{id}[/turns/n]   yes         yes                yes               open proxy
    reward, finish, discard        yes         yes                NO                open proxy
    POST /sessions, /admin/*       yes         no                 no                open proxy

(On an open proxy the admin calls take any key too: there is no key they could be wrong for.)

- The admin key is `TRAJSTORE_API_KEY`; with none set the proxy is "open" (a local orchestrator
  on a trusted machine) and calls that present no key at all are let through where the table
  says so.
- `POST /sessions` returns both per-session keys to its caller, the orchestrator: it hands
  `api_key` to the agent and keeps `orchestrator_key`, so the agent cannot reward, finish or
  discard its own session (or any other), even when it finds the proxy's URL.
- A key that is presented and wrong for the call is a 401, open proxy or not: a key of another
  session, or the agent's key on a control call, never falls back to "open".

Both keys are HMACs of the session id under the proxy's secret (`proxy.sessions`): any replica
sharing the secret checks them without a lookup. Keys are compared in constant time and never
recorded.
"""

from __future__ import annotations

import hmac

from trajstore.proxy.errors import Unauthorized
from trajstore.proxy.sessions import SessionRegistry


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def _is_admin(admin_key: str | None, presented: str | None) -> bool:
    return (
        admin_key is not None
        and presented is not None
        and hmac.compare_digest(presented, admin_key)
    )


def admin_key_is_valid(admin_key: str | None, authorization: str | None) -> bool:
    """True when no admin key is set (an open proxy), or the caller presents it."""
    return admin_key is None or _is_admin(admin_key, bearer(authorization))


def require_session_key(
    registry: SessionRegistry,
    admin_key: str | None,
    session_id: str,
    authorization: str | None,
    *,
    model_call: bool,
) -> None:
    """Raise `Unauthorized` unless the caller may call models of `session_id` (`model_call`) or
    read it (see the module docstring)."""
    presented = bearer(authorization)
    if presented is not None and (
        registry.key_matches(session_id, presented) or _is_admin(admin_key, presented)
    ):
        return
    if not model_call:
        if presented is not None and registry.orchestrator_key_matches(session_id, presented):
            return
        if presented is None and admin_key is None:
            return  # an open proxy: a local orchestrator reading its sessions
    raise Unauthorized(f"use the api_key returned when session {session_id!r} was created")


def require_orchestrator_key(
    registry: SessionRegistry, admin_key: str | None, session_id: str, authorization: str | None
) -> None:
    """Raise `Unauthorized` unless the caller may reward, finish or discard `session_id`: the
    orchestrator's key of the session or the admin key (no key at all on an open proxy); never
    the session's own `api_key`, which the agent holds."""
    presented = bearer(authorization)
    if presented is None:
        if admin_key is None:
            return
    elif _is_admin(admin_key, presented) or registry.orchestrator_key_matches(
        session_id, presented
    ):
        return
    raise Unauthorized(
        "rewards, finishes and discards need the orchestrator_key returned when session "
        f"{session_id!r} was created, or the admin key (TRAJSTORE_API_KEY); the session's "
        "api_key only calls models"
    )
