"""Who may call what.

- Model calls need the session's own key (from `POST /sessions`), or the proxy's admin key.
- Creating sessions and admin calls need the admin key (`TRAJSTORE_API_KEY`) when one is set.
- Session-level calls (reward, finish, discard, read) take the session's key or the admin key;
  with no admin key set they are open, for a local orchestrator.
Keys are compared in constant time and never recorded.
"""

from __future__ import annotations

import hmac

from proxy.errors import Unauthorized
from proxy.sessions import SessionRegistry


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:].strip()
    return None


def admin_key_is_valid(admin_key: str | None, authorization: str | None) -> bool:
    """True when no admin key is set, or the caller presents it."""
    if admin_key is None:
        return True
    return hmac.compare_digest(bearer(authorization) or "", admin_key)


def session_key_is_valid(
    registry: SessionRegistry,
    admin_key: str | None,
    session_id: str,
    authorization: str | None,
    *,
    open_without_admin_key: bool,
) -> bool:
    """True when the caller may act on `session_id` (see the module docstring)."""
    presented = bearer(authorization)
    if presented is not None and registry.key_matches(session_id, presented):
        return True
    if admin_key is None:
        return open_without_admin_key
    return presented is not None and hmac.compare_digest(presented, admin_key)


def require_session_key(
    registry: SessionRegistry,
    admin_key: str | None,
    session_id: str,
    authorization: str | None,
    *,
    model_call: bool,
) -> None:
    """Raise `Unauthorized` unless the caller may act on `session_id` (model calls never open)."""
    if not session_key_is_valid(
        registry, admin_key, session_id, authorization, open_without_admin_key=not model_call
    ):
        raise Unauthorized(f"use the api_key returned when session {session_id!r} was created")
