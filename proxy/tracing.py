"""Every model call as an OpenTelemetry GenAI span, exported over OTLP off the request path.

Off by default; `TRAJSTORE_TRACING=otlp` turns it on, and the SDK's own `OTEL_*` variables say
where and how (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`,
`OTEL_EXPORTER_OTLP_PROTOCOL` `http/protobuf` (the default) or `grpc`, `OTEL_SERVICE_NAME`,
`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`).

One span per model call, named and attributed after OpenTelemetry's GenAI semantic conventions
(`gen_ai.operation.name`, `gen_ai.request.model`, `gen_ai.response.model`,
`gen_ai.usage.input_tokens` / `output_tokens`, `gen_ai.response.finish_reasons`,
`gen_ai.conversation.id`), its duration the call's latency, plus trajstore's own: the session,
run, task, group, lineage, policy version, request id, time to first token (also as the span
event `gen_ai.first_token`), and `trajstore.viewer.url`, the viewer's page of the turn. The
lineage is an edge: `trajstore.lineage.extends` names the turn whose tokens this prompt extends,
and the span links to that turn's span (a call's span id is a digest of its request id); a call
without it starts a lineage (the projection numbers lineages later, from the whole log). Token
counts are the recorded ones (the prompt and completion ids in the log), so a span says what the
log says.
Prompt and completion text go into a span only with `TRAJSTORE_TRACING_CONTENT=true` (as
`gen_ai.input.messages` and `gen_ai.output.messages`): agents' prompts hold code, keys and
user data.

One trace per session: the trace id is a digest of the session id, so every replica's spans of
one session share it without talking to each other. Each call's span is a child of the
session's span, whose id is a digest of the session id too; that span itself (run, task,
status) is emitted once, by the replica that records its finish (`SessionRegistry.on_finished`:
the orchestrator's, the deadline's or the reaper's; not a retried one), spanning its whole
life. The replica is the spans' resource's `service.instance.id`.

Cost and failure: the span is built when the recorder has queued the turn's last event, as a
finished span (`TurnTracer`), and handed to the SDK's `BatchSpanProcessor`, whose thread
encodes (`proxy.otlp_export`: half the SDK encoder's CPU) and sends batches. Nothing on the
request path waits for the collector: when it is slow or down, the processor's bounded queue
drops spans (the SDK logs it), the agents see nothing, and the recording, which never depended
on it, is whole. `benchmarks/proxy_overhead.py` measures the CPU it adds per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import orjson

from trajstore.proxy.errors import TracingUnavailable
from trajstore.store.payloads_request import CompletionFinished, FinishedChoice, RequestFailed

if TYPE_CHECKING:  # the SDK loads only when tracing is on: the proxy runs without it
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

    from trajstore.proxy.recorder import RequestRecorder
    from trajstore.proxy.sessions import Session
    from trajstore.proxy.settings import ProxySettings

log = logging.getLogger(__name__)

#: The service name when `OTEL_SERVICE_NAME` (or `service.name` in `OTEL_RESOURCE_ATTRIBUTES`)
#: does not say one.
SERVICE_NAME = "trajstore-proxy"

#: Seconds the proxy waits, when it stops, for the spans still queued to be sent.
SHUTDOWN_SECONDS = 5.0

#: What a recorder calls when its turn ended: the recorder and its last event's payload
#: (`completion_finished` or `request_failed`).
TurnEnded = Callable[["RequestRecorder", "CompletionFinished | RequestFailed"], None]


def trace_id_of(session_id: str) -> int:
    """The session's trace id: the first 128 bits of a digest of its id (never 0)."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=16, person=b"trajstore-trace")
    return int.from_bytes(digest.digest(), "big") or 1


def session_span_id(session_id: str) -> int:
    """The id of the session's own span, the parent of its calls' spans (never 0)."""
    digest = hashlib.blake2b(session_id.encode(), digest_size=8, person=b"trajstore-span")
    return int.from_bytes(digest.digest(), "big") or 1


def span_id_of(request_id: str) -> int:
    """The id of one call's span: a digest of its request id (never 0)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8, person=b"trajstore-call")
    return int.from_bytes(digest.digest(), "big") or 1


def turn_url(viewer_url: str, session_id: str, request_id: str) -> str:
    """The viewer's page of one turn (`trajstore.viewer.sessions`: it opens the turn)."""
    return f"{viewer_url.rstrip('/')}/sessions/{quote(session_id, safe='')}/requests/{request_id}"


def exporter_protocol() -> str:
    """The OTLP protocol the standard variables ask for (`http/protobuf` unless told)."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    return protocol.strip()


class TurnTracer:
    """Makes each model call's span, and the session's when it finishes; owns the exporter.

    A span is made finished: a call's whole story is known when its last event is queued, so
    it is built as the SDK's `ReadableSpan` (what its processors and exporters take) and handed
    to the `BatchSpanProcessor`, skipping what a live span costs (locks, the attribute checks of
    values that are already plain strings and numbers). Measured: 14.5 µs a span against 31 µs
    for `start_span` + `end`. The provider's sampler still decides (`OTEL_TRACES_SAMPLER`).
    """

    def __init__(
        self,
        provider: TracerProvider,
        processor: SpanProcessor,
        *,
        viewer_url: str | None = None,
        content: bool = False,
    ) -> None:
        """`provider`: an SDK tracer provider (its resource and sampler) owning `processor`,
        the span processor spans go to (see `start_tracing`); `viewer_url`: where people reach
        the viewer (`trajstore.viewer.url` on each span); `content`: put the messages and
        replies into the spans."""
        from opentelemetry import trace
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.sdk.trace.sampling import Decision
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

        self.provider = provider
        self.processor = processor
        self.viewer_url = viewer_url
        self.content = content
        self._scope = InstrumentationScope("trajstore.proxy")
        self._trace = trace
        self._readable = ReadableSpan
        self._event = Event
        self._span_context = SpanContext
        self._link = Link
        self._sampled = TraceFlags(TraceFlags.SAMPLED)
        self._client = SpanKind.CLIENT
        self._internal = SpanKind.INTERNAL
        self._status = Status
        self._error = StatusCode.ERROR
        self._unset = Status(StatusCode.UNSET)
        self._record_and_sample = Decision.RECORD_AND_SAMPLE

    def _context(self, trace_id: int, span_id: int, *, remote: bool = False) -> Any:
        return self._span_context(trace_id, span_id, is_remote=remote, trace_flags=self._sampled)

    def _sampled_in(self, parent: Any, name: str) -> bool:
        """Whether the provider's sampler keeps a call under `parent`, the session's span
        (ParentBased, the default, keeps every one: the session's span is sampled)."""
        context = self._trace.set_span_in_context(self._trace.NonRecordingSpan(parent))
        decision = self.provider.sampler.should_sample(context, parent.trace_id, name, self._client)
        return bool(decision.decision is self._record_and_sample)

    def call(
        self,
        *,
        api: str,
        session: Session,
        engine: str,
        policy_version: str,
        body: dict[str, Any],
    ) -> TurnEnded | None:
        """What the recorder of one call calls when the call ended: it emits the call's span.

        The attributes known before the call are gathered here, once. None when the sampler
        leaves the session out.
        """
        model = body.get("model")
        operation = "text_completion" if api == "completions" else "chat"
        name = f"{operation} {model}" if isinstance(model, str) else operation
        trace_id = trace_id_of(session.session_id)
        parent = self._context(trace_id, session_span_id(session.session_id), remote=True)
        if not self._sampled_in(parent, name):
            return None
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": "vllm",
            "gen_ai.conversation.id": session.session_id,
            "trajstore.session.id": session.session_id,
            "trajstore.run.id": session.run_id,
            "trajstore.api": api,
            "trajstore.policy.version": policy_version,
            "trajstore.engine": engine,
        }
        if isinstance(model, str):
            attributes["gen_ai.request.model"] = model
        for key, attribute in _REQUEST_FIELDS:
            value = body.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                attributes[attribute] = value
        if session.task_id is not None:
            attributes["trajstore.task.id"] = session.task_id
        if session.group_id is not None:
            attributes["trajstore.group.id"] = session.group_id

        def ended(recorder: RequestRecorder, payload: CompletionFinished | RequestFailed) -> None:
            try:
                self._turn_span(name, attributes, parent, recorder, payload)
            except Exception:  # a span is never worth a turn: the recording goes on
                log.exception("emitting the span of request %s failed", recorder.request_id)

        return ended

    def _turn_span(
        self,
        name: str,
        static: dict[str, Any],
        parent: Any,
        recorder: RequestRecorder,
        payload: CompletionFinished | RequestFailed,
    ) -> None:
        end = time.time_ns()
        trace_id = parent.trace_id
        start = end - int((payload.latency_s or 0.0) * 1e9)
        session_id, request_id = recorder.session_id, recorder.request_id
        attributes = {**static, "trajstore.request.id": request_id}
        if recorder.response_model is not None:
            attributes["gen_ai.response.model"] = recorder.response_model
        if recorder.prompt_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = recorder.prompt_tokens
        attributes["gen_ai.usage.output_tokens"] = recorder.completion_tokens
        if self.viewer_url:
            attributes["trajstore.viewer.url"] = turn_url(self.viewer_url, session_id, request_id)
        extends = recorder.extends
        links: tuple[Any, ...] = ()
        if extends is not None:
            # The lineage's edge: the turn this prompt extends, and a link to its span.
            attributes["trajstore.lineage.extends"] = extends
            links = (self._link(self._context(trace_id, span_id_of(extends), remote=True)),)
        if recorder.plan.source:
            attributes["trajstore.prompt.source"] = recorder.plan.source
        choices: list[FinishedChoice] = []
        status = self._unset
        ttft = None
        if isinstance(payload, CompletionFinished):
            choices = payload.choices
            ttft = payload.ttft_s
            attributes["gen_ai.response.finish_reasons"] = tuple(
                c.finish_reason or "" for c in choices
            )
        else:
            failure = payload.reason or "failed"
            attributes["error.type"] = failure
            status = self._status(self._error, payload.message or failure)
        events: tuple[Any, ...] = ()
        if ttft is not None:
            attributes["trajstore.time_to_first_token_s"] = ttft
            events = (self._event("gen_ai.first_token", timestamp=start + int(ttft * 1e9)),)
        if self.content:
            attributes |= _content(recorder, choices)
        span = self._readable(
            name,
            # The span's id is a digest of the request id, so a later turn can link to it.
            context=self._context(trace_id, span_id_of(request_id)),
            parent=parent,
            resource=self.provider.resource,
            attributes=attributes,
            events=events,
            links=links,
            kind=self._client,
            instrumentation_scope=self._scope,
            start_time=start,
            end_time=end,
            status=status,
        )
        self.processor.on_end(span)

    def session_finished(self, session: Session) -> None:
        """The session's own span: from its creation to now, the parent of its calls' spans.

        Its id is fixed by the session id, so the calls' spans (made earlier, perhaps on other
        replicas) already name it as their parent."""
        try:
            self._session_span(session, session.status)
        except Exception:
            log.exception("emitting the span of session %s failed", session.session_id)

    def _session_span(self, session: Session, status: str) -> None:
        name = f"invoke_agent {session.run_id}"
        trace_id, span_id = trace_id_of(session.session_id), session_span_id(session.session_id)
        if not self._sampled_in(self._context(trace_id, span_id, remote=True), name):
            return
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.conversation.id": session.session_id,
            "trajstore.session.id": session.session_id,
            "trajstore.run.id": session.run_id,
            "trajstore.session.status": status,
        }
        if session.task_id is not None:
            attributes["trajstore.task.id"] = session.task_id
        if session.group_id is not None:
            attributes["trajstore.group.id"] = session.group_id
        if self.viewer_url:
            base = self.viewer_url.rstrip("/")
            attributes["trajstore.viewer.url"] = f"{base}/sessions/{quote(session.session_id)}"
        end = time.time_ns()
        span = self._readable(
            name,
            context=self._context(trace_id, span_id),
            resource=self.provider.resource,
            attributes=attributes,
            kind=self._internal,
            instrumentation_scope=self._scope,
            start_time=int(session.created_at * 1e9) if session.created_at else end,
            end_time=end,
        )
        self.processor.on_end(span)

    async def close(self) -> None:
        """Send what is queued (at most `SHUTDOWN_SECONDS`), then stop the exporter."""
        done = threading.Event()

        def shut() -> None:
            try:
                self.provider.shutdown()
            finally:
                done.set()

        # A daemon thread, not the loop's executor: with the collector down, the exporter may
        # retry past the wait, and the proxy must still exit promptly.
        threading.Thread(target=shut, name="trajstore-tracing-shutdown", daemon=True).start()
        deadline = time.monotonic() + SHUTDOWN_SECONDS
        while not done.is_set() and time.monotonic() < deadline:  # noqa: ASYNC110 (a thread's)
            await asyncio.sleep(0.02)
        if not done.is_set():
            log.warning("the OTLP collector took too long: spans still queued were dropped")


#: Request fields -> GenAI request attributes.
_REQUEST_FIELDS = (
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("seed", "gen_ai.request.seed"),
    ("n", "gen_ai.request.choice.count"),
)


def _content(recorder: RequestRecorder, choices: list[FinishedChoice]) -> dict[str, str]:
    """The call's messages and replies, as the GenAI conventions' JSON attributes."""
    found: dict[str, str] = {}
    if recorder.messages_json:
        found["gen_ai.input.messages"] = recorder.messages_json.decode()
    replies = [c.message for c in choices if c.message is not None]
    if replies:
        found["gen_ai.output.messages"] = orjson.dumps(replies).decode()
    return found


def start_tracing(settings: ProxySettings, replica_id: str | None = None) -> TurnTracer | None:
    """The proxy's tracer as its settings and the `OTEL_*` variables say; None when off.

    `TracingUnavailable` when tracing is asked for and the SDK is not installed, or the
    protocol is one the SDK does not export.
    """
    if settings.tracing == "off":
        return None
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailable(
            "TRAJSTORE_TRACING=otlp needs the OpenTelemetry SDK and exporters: "
            "pip install 'trajstore[observe]'"
        ) from exc
    protocol = exporter_protocol()
    exporter: Any
    # Encoded by `proxy.otlp_export`, for less of the proxy's CPU than the SDK's encoder.
    if protocol == "grpc":
        from trajstore.proxy.otlp_export import grpc_exporter

        exporter = grpc_exporter()
    elif protocol == "http/protobuf":
        from trajstore.proxy.otlp_export import HttpSpanExporter

        exporter = HttpSpanExporter()
    else:
        raise TracingUnavailable(
            f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: the proxy exports traces over "
            "'http/protobuf' or 'grpc'"
        )
    given: dict[str, Any] = {}
    if replica_id is not None:
        given["service.instance.id"] = replica_id
    resource = Resource.create(given)
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", ""
    ):
        resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    processor = BatchSpanProcessor(exporter)
    provider.add_span_processor(processor)
    return TurnTracer(
        provider, processor, viewer_url=settings.viewer_url, content=settings.tracing_content
    )
