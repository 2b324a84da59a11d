"""Prometheus metrics of one proxy: requests, tokens, latency, time to first token, the
recorder's queue and lag, engine health and event-loop lag. One registry per app."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class ProxyMetrics:
    """The proxy's metrics, in their own registry (so tests can run several apps)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests_started = Counter(
            "trajstore_requests_started", "Model requests accepted", ["api"], registry=r
        )
        self.requests = Counter(
            "trajstore_requests", "Model requests answered, by status", ["api", "status"],
            registry=r,
        )  # fmt: skip
        self.tokens = Counter("trajstore_tokens", "Tokens served", ["kind"], registry=r)
        self.latency = Histogram(
            "trajstore_request_latency_seconds", "Request latency", ["api"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "trajstore_time_to_first_token_seconds", "Time to first token", ["api"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompts = Counter(
            "trajstore_chat_prompts", "Chat prompts by how they reached the engine "
            "(continued from ids, or rendered from text) and why not continued",
            ["source", "fallback"], registry=r,
        )  # fmt: skip
        self.drift_avoided = Counter(
            "trajstore_prompt_drift_avoided",
            "Continued prompts whose text rendering would have differed from the ids sampled",
            registry=r,
        )
        self.writer_pending = Gauge(
            "trajstore_writer_pending_events", "Events queued, not yet durable", registry=r
        )
        self.writer_lag = Gauge(
            "trajstore_writer_lag_seconds", "Age of the oldest event not yet durable", registry=r
        )
        self.writer_failed = Gauge(
            "trajstore_writer_failed_events", "Events the store refused", registry=r
        )
        self.engines_healthy = Gauge(
            "trajstore_engines_healthy", "Engines passing their health check", registry=r
        )
        self.sessions_cached = Gauge(
            "trajstore_sessions_cached", "Sessions this replica holds in memory", registry=r
        )
        self.loop_lag = Gauge(
            "trajstore_event_loop_lag_seconds", "Latest event-loop delay observed", registry=r
        )

    def watch(
        self,
        *,
        pending: Callable[[], float],
        lag: Callable[[], float],
        failed: Callable[[], float],
        healthy: Callable[[], float],
        sessions: Callable[[], float],
    ) -> None:
        """Read the live gauges from their sources at scrape time."""
        self.sessions_cached.set_function(sessions)
        self.writer_pending.set_function(pending)
        self.writer_lag.set_function(lag)
        self.writer_failed.set_function(failed)
        self.engines_healthy.set_function(healthy)
