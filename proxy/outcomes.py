"""How a model call ended, recorded and counted: the engine's failures and refusals as events
and errors (a lost engine as `EngineLost`, which sends the request elsewhere), and each answer's
status, latency, time to first token and tokens as metrics.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from trajstore.proxy.attempts import EngineLost, Reply
from trajstore.proxy.engines import Engine, EnginePool
from trajstore.proxy.errors import BadRequest, EngineFailed
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.recorder import RequestRecorder
from trajstore.proxy.streaming import JsonAnswer
from trajstore.proxy.transport import AnswerBroken, EngineUnreachable
from trajstore.proxy.wire import Api


class Outcomes:
    """Records and counts how the model calls of one proxy ended."""

    def __init__(self, engines: EnginePool, metrics: ProxyMetrics) -> None:
        """`engines`: told of an engine lost or suspected; `metrics`: where answers count."""
        self.engines = engines
        self.metrics = metrics

    async def engine_failure(
        self, api: Api, engine: Engine, recorder: RequestRecorder, exc: BaseException
    ) -> BaseException:
        """Record why the engine gave no (whole) answer; return the error to raise: a lost
        engine is `EngineLost`, which sends the request to another engine."""
        if isinstance(exc, asyncio.CancelledError):
            await recorder.failed("client_disconnected", "the agent closed the connection")
            return exc
        if isinstance(exc, TimeoutError):
            await recorder.failed("engine_timeout", "the engine did not answer in time")
            self.count(api, 504)
            return EngineFailed("the engine did not answer in time", status=504)
        if isinstance(exc, EngineUnreachable):
            self.engines.mark_failed(engine, str(exc))
            await recorder.failed("engine_unreachable", f"{type(exc).__name__}: {exc}")
            self.count(api, 502)
            return EngineLost(EngineFailed(f"the engine at {engine.url} cannot be reached: {exc}"))
        if isinstance(exc, AnswerBroken):
            message = f"the engine's answer broke off: {exc}"
            self.engines.suspect(engine, message)
            await recorder.failed("engine_error", message)
            self.count(api, 502)
            return EngineLost(EngineFailed(f"the engine at {engine.url} broke off: {exc}"))
        await recorder.failed("proxy_error", f"{type(exc).__name__}: {exc}")
        return exc

    async def engine_refusal(
        self, api: Api, recorder: RequestRecorder, status: int, raw: bytes, reply: Reply
    ) -> JsonAnswer:
        """The engine refused the request: record it, pass its (OpenAI-shaped) error on, in the
        agent's API's shape."""
        try:
            message = str(orjson.loads(raw).get("error", {}).get("message"))
        except (orjson.JSONDecodeError, AttributeError):
            message = raw[:500].decode(errors="replace")
        await recorder.failed("engine_error", message, status)
        self.count(api, status)
        if reply.translation is not None:
            error = BadRequest(message) if status == 400 else EngineFailed(message, status=status)
            error.status = status
            raw = orjson.dumps(reply.translation.error_body(error))
        return JsonAnswer(raw, status)

    def count(self, api: Api, status: int) -> None:
        """One answer of `api` with `status`."""
        self.metrics.requests.labels(api=api, status=str(status)).inc()

    def observe(self, api: Api, recorder: RequestRecorder, usage: dict[str, Any] | None) -> None:
        """One whole answer: its status, latency, time to first token and tokens."""
        self.count(api, 200)
        latency = time.monotonic() - recorder.started
        self.metrics.latency.labels(api=api).observe(latency)
        if recorder.first_token_at is not None:
            self.metrics.ttft.labels(api=api).observe(recorder.first_token_at - recorder.started)
        if usage:
            self.metrics.tokens.labels(kind="prompt").inc(usage.get("prompt_tokens") or 0)
            self.metrics.tokens.labels(kind="completion").inc(usage.get("completion_tokens") or 0)
