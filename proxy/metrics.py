"""Prometheus metrics of one proxy: requests, tokens, latency, time to first token, the
recorder's queue and lag, engine health, event-loop lag, and admission per run. One registry per
app.

Run ids are chosen by whoever creates sessions, so a `run` label could grow without end: the
first `MAX_RUN_LABELS` runs a replica serves get a label of their own, every later run is
counted under `run="(other)"` (`run_label`). Restart the replica, or raise the bound, to see
newer runs by name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from trajstore.proxy.admission import Admission

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

#: Runs with a `run` label of their own per replica; the rest share `OTHER_RUNS`.
MAX_RUN_LABELS = 100
OTHER_RUNS = "(other)"


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
        self.contexts_held = Gauge(
            "trajstore_context_bytes",
            "Bytes of sessions' remembered turns this replica holds (`TRAJSTORE_CONTEXT_BYTES`)",
            registry=r,
        )
        self.loop_lag = Gauge(
            "trajstore_event_loop_lag_seconds", "Latest event-loop delay observed", registry=r
        )
        # Admission (`proxy.admission`), per run.
        self.admitted = Counter(
            "trajstore_admission_admitted", "Model requests admitted, by run", ["run"], registry=r
        )
        self.rate_limited = Counter(
            "trajstore_admission_rate_limited",
            "Model requests refused with 429 (the run's queue was full), by run", ["run"],
            registry=r,
        )  # fmt: skip
        self.left_queued = Counter(
            "trajstore_admission_left_queued",
            "Model requests whose agent hung up while they waited, by run", ["run"], registry=r,
        )  # fmt: skip
        self.admission_wait = Histogram(
            "trajstore_admission_wait_seconds",
            "Time a model request waited for admission, by run (runs with limits, or all runs "
            "under a global cap)", ["run"], buckets=_WAIT_BUCKETS, registry=r,
        )  # fmt: skip
        self._run_labels: dict[str, str] = {}
        for metric in (
            self.requests_started, self.requests, self.tokens, self.latency, self.ttft,
            self.prompts, self.admitted, self.rate_limited, self.left_queued, self.admission_wait,
        ):  # fmt: skip
            _keep_children(metric)

    def run_label(self, run_id: str) -> str:
        """The `run` label of a run: its id, for the first `MAX_RUN_LABELS` runs seen."""
        label = self._run_labels.get(run_id)
        if label is None:
            if len(self._run_labels) >= MAX_RUN_LABELS:
                return OTHER_RUNS
            label = self._run_labels[run_id] = run_id
        return label

    def watch_admission(self, admission: Admission) -> None:
        """Report each run's requests in flight and waiting at scrape time."""
        self.registry.register(_AdmissionGauges(admission, self.run_label))

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


def _keep_children(metric: Counter | Histogram) -> None:
    """Answer `metric.labels(...)` from a dict once the values were seen: prometheus_client
    checks the values and takes a lock on every call, and a request makes about ten of them.
    Label values are bounded (APIs, statuses, `run_label`), and so is the dict."""
    children: dict[tuple[Any, ...], Any] = {}
    lookup = metric.labels

    def labels(*values: Any, **named: Any) -> Any:
        key = (values, tuple(named.items()))
        child = children.get(key)
        if child is None:
            child = children[key] = lookup(*values, **named)
        return child

    metric.labels = labels  # type: ignore[method-assign]


class _AdmissionGauges(Collector):
    """`trajstore_admission_in_flight` and `_queued` by run, read from admission when scraped."""

    def __init__(self, admission: Admission, run_label: Callable[[str], str]) -> None:
        self.admission = admission
        self.run_label = run_label

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "trajstore_admission_in_flight",
            "Model requests being served that admission accounts for, by run", labels=["run"],
        )  # fmt: skip
        queued = GaugeMetricFamily(
            "trajstore_admission_queued", "Model requests waiting for admission, by run",
            labels=["run"],
        )  # fmt: skip
        totals: dict[str, list[int]] = {}
        for run_id, serving, waiting in self.admission.runs():
            total = totals.setdefault(self.run_label(run_id), [0, 0])
            total[0] += serving
            total[1] += waiting
        for label, (serving, waiting) in totals.items():
            in_flight.add_metric([label], serving)
            queued.add_metric([label], waiting)
        yield in_flight
        yield queued
