"""The proxy's errors, each with its HTTP status; all answer in OpenAI's error shape.

ProxyError
├── BadRequest              400  the body is not what the API takes (says what to fix)
├── Unauthorized            401  missing or wrong API key
├── NotFound                404  unknown session
├── Conflict                409  session finished, discarded, past its deadline, or reused
├── PayloadTooLarge         413  body above the limit
├── RetryLater                   not now, retry after the time it says (Retry-After)
│   ├── Overloaded          503  the recorder or every engine is saturated
│   └── RateLimited         429  the run has too many requests waiting (`proxy.admission`)
├── EngineFailed            502/504  the engine failed or timed out (recorded as an event)
└── TracingUnavailable      (at start) tracing asked for, and it cannot export
"""

from __future__ import annotations

import math
from typing import Any

from trajstore.store.errors import BadEvent, StoreError, StoreUnavailable, WriterBackpressure


class ProxyError(Exception):
    """The proxy cannot serve the request."""

    status = 500
    type = "internal_error"

    def __init__(self, message: str | None = None, *, param: str | None = None) -> None:
        self.message = message or (self.__doc__ or "").strip()
        self.param = param
        super().__init__(self.message)

    def headers(self) -> dict[str, str]:
        """Extra response headers (Retry-After for 503)."""
        return {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error shape, which every OpenAI client knows how to raise."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


class BadRequest(ProxyError):
    """The request body is not valid."""

    status = 400
    type = "invalid_request_error"


class Unauthorized(ProxyError):
    """Missing or wrong API key."""

    status = 401
    type = "authentication_error"


class NotFound(ProxyError):
    """No such session."""

    status = 404
    type = "not_found_error"


class Conflict(ProxyError):
    """The session cannot take this request in its current state."""

    status = 409
    type = "conflict_error"


class PayloadTooLarge(ProxyError):
    """The request body is larger than the proxy accepts."""

    status = 413
    type = "invalid_request_error"


class RetryLater(ProxyError):
    """Not now: the answer says when to retry (Retry-After, whole seconds, rounded up)."""

    def __init__(self, message: str | None = None, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        """Retry-After: at least the wait asked (a client told less would be refused again)."""
        return {"Retry-After": str(max(1, math.ceil(self.retry_after)))}


class Overloaded(RetryLater):
    """The proxy is saturated; retry later."""

    status = 503
    type = "overloaded_error"


class EngineFailed(ProxyError):
    """The inference engine failed to answer."""

    status = 502
    type = "engine_error"

    def __init__(self, message: str | None = None, *, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


def from_store_error(exc: StoreError) -> ProxyError:
    """The HTTP answer to a store error met while serving a request."""
    if isinstance(exc, WriterBackpressure):
        return Overloaded(str(exc), retry_after=exc.retry_after)
    if isinstance(exc, StoreUnavailable):
        return Overloaded(f"the store is unavailable: {exc}")
    if isinstance(exc, BadEvent):
        return BadRequest(f"cannot be recorded: {exc}")
    return ProxyError(f"the store failed: {exc}")  # WriteFailed and the rest: our side, a 500


def from_bug(exc: Exception) -> ProxyError:
    """The HTTP answer to an unexpected exception of ours (a 500 naming it)."""
    return ProxyError(f"the proxy failed: {type(exc).__name__}: {exc}")


class TracingUnavailable(ProxyError):
    """Tracing is on, and the OpenTelemetry SDK cannot export as asked (`proxy.tracing`)."""
