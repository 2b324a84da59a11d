"""The proxy's OTLP export (`proxy.otlp_export`): the same request the SDK's encoder makes, for
every kind of span and attribute; over HTTP, the standard settings honoured, a collector's
"retry later" retried and its refusal not."""

from __future__ import annotations

import enum
import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from tests.proxy.otlp_receiver import http_receiver
from trajstore.proxy.otlp_export import HttpSpanExporter, encode_spans


class Outcome(enum.StrEnum):
    """A str subclass as an attribute value (encoded as its string, not as a list of letters)."""

    OK = "ok"


def finished_spans() -> list[ReadableSpan]:
    """Spans of two resources and three scopes, with every attribute type, events, links, a
    remote parent with a trace state, and each status."""
    spans: list[ReadableSpan] = []
    remote = SpanContext(trace_id=7, span_id=9, is_remote=True,
                         trace_flags=TraceFlags(TraceFlags.SAMPLED),
                         trace_state=TraceState([("vendor", "a1")]))  # fmt: skip
    for service in ("proxy-a", "proxy-b"):
        memory = InMemorySpanExporter()
        provider = TracerProvider(resource=Resource.create({"service.name": service, "n": 1}))
        provider.add_span_processor(SimpleSpanProcessor(memory))
        plain = provider.get_tracer("trajstore")
        versioned = provider.get_tracer("other", "1.2", schema_url="https://x/1.0")
        with plain.start_as_current_span("root", kind=SpanKind.SERVER) as root:
            root.set_attributes({"s": "text", "b": True, "i": 42, "f": 0.5,
                                 "list": ["length", "stop"], "ints": [1, 2],
                                 "kind": SpanKind.CLIENT.name, "status": Outcome.OK})  # fmt: skip
            root.add_event("gen_ai.first_token", {"at": 3})
            with versioned.start_as_current_span("child", links=[Link(remote, {"why": "x"})]) as c:
                c.set_status(Status(StatusCode.ERROR, "engine_error"))
        parent = set_span_in_context(NonRecordingSpan(remote))
        with plain.start_as_current_span("remote child", context=parent, kind=SpanKind.CLIENT) as r:
            r.set_status(Status(StatusCode.OK))
        spans += memory.get_finished_spans()
    return spans


def test_a_batch_encodes_as_the_sdks_encoder_encodes_it() -> None:
    spans = finished_spans()
    ours, theirs = encode_spans(spans), sdk_encode(spans)
    assert len(ours.resource_spans) == 2
    assert ours == theirs  # message equality: every field, in order
    assert ours.SerializeToString() == theirs.SerializeToString()


@pytest.fixture
def otlp_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("ENDPOINT", "HEADERS", "TIMEOUT", "COMPRESSION", "CERTIFICATE"):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{name}", raising=False)
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_TRACES_{name}", raising=False)
    return monkeypatch


def test_http_export_honours_the_settings_and_retries_what_the_collector_asks(
    otlp_env: pytest.MonkeyPatch,
) -> None:
    spans = finished_spans()
    with http_receiver(refuse=(503, 429)) as (endpoint, received):
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint + "/")  # the path is added
        otlp_env.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-team=rl,authorization=Bearer%20t")
        otlp_env.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
        exporter = HttpSpanExporter()
        assert exporter.export(spans) is SpanExportResult.SUCCESS
        exporter.shutdown()
    assert received.requests == 1 and len(received.headers) == 3  # two refusals, then taken
    assert len(received.spans) == len(spans)
    sent = received.headers[-1]  # the body gzipped: the receiver inflated it to read the spans
    assert sent["x-team"] == "rl" and sent["authorization"] == "Bearer t"
    assert sent["content-type"] == "application/x-protobuf" and sent["content-encoding"] == "gzip"


def test_http_export_gives_up_on_a_refusal_and_on_a_collector_that_is_down(
    otlp_env: pytest.MonkeyPatch,
) -> None:
    with http_receiver(refuse=(400,)) as (endpoint, received):
        otlp_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint + "/v1/traces")
        exporter = HttpSpanExporter()
        assert exporter.export(finished_spans()) is SpanExportResult.FAILURE
        exporter.shutdown()
    assert len(received.headers) == 1 and received.spans == []  # a 400 is not retried
    # Down: retried with backoff until the timeout, then dropped (never raised).
    otlp_env.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint + "/v1/traces")
    otlp_env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
    exporter = HttpSpanExporter()
    started = time.monotonic()
    assert exporter.export(finished_spans()) is SpanExportResult.FAILURE
    assert time.monotonic() - started < 2.0
    exporter.shutdown()
    assert exporter.export(finished_spans()) is SpanExportResult.FAILURE  # after shutdown
