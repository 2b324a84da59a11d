"""OTLP export of the proxy's spans, encoded for half the SDK encoder's CPU.

The SDK's OTLP encoder builds, in Python, one protobuf message for every attribute and another
for its value: 5/6 of what a span cost the proxy (docs/performance.md, "Tracing"), in the
exporter's thread but on the same cores as the recording. Here a batch is written as plain dicts
and lists and handed to the official protobuf classes once; the protobuf runtime (upb, in C)
builds the nested messages. The request is the same OTLP message, read by any collector.

    encode_spans(spans)   the `ExportTraceServiceRequest` of a batch of finished spans
    grpc_exporter()       the SDK's OTLP/gRPC exporter (its transport, retries and settings)
                          with this encoding, through its `_translate_data` hook
    HttpSpanExporter      OTLP/HTTP with protobuf bodies: one POST a batch, retried with backoff
                          on 429, 502, 503 and 504 and on a connection's failure within its
                          timeout; endpoint, headers, timeout, compression and certificate from
                          the standard `OTEL_EXPORTER_OTLP_[TRACES_]*` variables, as the SDK's

Nothing here raises into the span processor: a batch that cannot be sent is logged and dropped
(the recording never depends on a collector).
"""

from __future__ import annotations

import gzip
import logging
import os
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

log = logging.getLogger(__name__)

#: Span flags: the parent's is-remote bit is known (OTLP's SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE),
#: and set when the parent is remote (SPAN_FLAGS_CONTEXT_IS_REMOTE), as the SDK encodes them.
_HAS_IS_REMOTE, _IS_REMOTE = 0x100, 0x200
_RETRIED_STATUSES = frozenset({429, 502, 503, 504})


#: OTLP's `AnyValue` field of each plain type (`bool` before `int`: it is one).
_SCALARS = {str: "string_value", bool: "bool_value", int: "int_value", float: "double_value",
            bytes: "bytes_value"}  # fmt: skip


def _value(value: Any) -> dict[str, Any]:
    """An attribute's value as OTLP's `AnyValue`, in dict form."""
    field = _SCALARS.get(type(value))
    if field is not None:  # the plain types, by one lookup; their subclasses below
        return {field: value}
    for kind, name in _SCALARS.items():  # in order: bool before int, of which it is one
        if isinstance(value, kind):
            return {name: value}
    if isinstance(value, Mapping):
        return {"kvlist_value": {"values": _attributes(value)}}
    if isinstance(value, Sequence):
        return {"array_value": {"values": [_value(v) for v in value]}}
    return {}  # None: an empty value, as the SDK sends it


def _attributes(attributes: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in (attributes or {}).items()]


def _flags(parent: Any) -> int:
    return _HAS_IS_REMOTE | (_IS_REMOTE if parent is not None and parent.is_remote else 0)


def _span(span: ReadableSpan) -> dict[str, Any]:
    context = span.get_span_context()
    assert context is not None  # a finished span has one
    encoded: dict[str, Any] = {
        "trace_id": context.trace_id.to_bytes(16, "big"),
        "span_id": context.span_id.to_bytes(8, "big"),
        "name": span.name,
        "kind": span.kind.value + 1,  # OTLP counts from SPAN_KIND_UNSPECIFIED = 0
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "attributes": _attributes(span.attributes),
        "dropped_attributes_count": span.dropped_attributes,
        "dropped_events_count": span.dropped_events,
        "dropped_links_count": span.dropped_links,
        "flags": _flags(span.parent),
        "status": {"code": span.status.status_code.value, "message": span.status.description or ""},
    }
    if context.trace_state:
        encoded["trace_state"] = ",".join(f"{k}={v}" for k, v in context.trace_state.items())
    if span.parent is not None:
        encoded["parent_span_id"] = span.parent.span_id.to_bytes(8, "big")
    if span.events:
        encoded["events"] = [
            {"name": e.name, "time_unix_nano": e.timestamp, "attributes": _attributes(e.attributes)}
            for e in span.events
        ]
    if span.links:
        encoded["links"] = [
            {"trace_id": link.context.trace_id.to_bytes(16, "big"),
             "span_id": link.context.span_id.to_bytes(8, "big"),
             "attributes": _attributes(link.attributes), "flags": _flags(link.context)}
            for link in span.links
        ]  # fmt: skip
    return encoded


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The OTLP request of a batch: its spans grouped by resource, then by instrumentation scope."""
    # By identity: a provider's spans share one resource and scope (their hashes cost a JSON
    # dump each), and equal ones that are not the same object just make two groups.
    grouped: dict[int, tuple[Any, dict[int, tuple[Any, list[dict[str, Any]]]]]] = {}
    for span in spans:
        _, scopes = grouped.setdefault(id(span.resource), (span.resource, {}))
        scope = span.instrumentation_scope
        scopes.setdefault(id(scope), (scope, []))[1].append(_span(span))
    resource_spans: list[Any] = []  # dicts: protobuf builds the messages from them
    for resource, scopes in grouped.values():
        scope_spans = []
        for scope, encoded in scopes.values():
            entry: dict[str, Any] = {"spans": encoded}
            if scope is not None:
                entry["scope"] = {"name": scope.name, "version": scope.version or ""}
                entry["schema_url"] = scope.schema_url or ""
            scope_spans.append(entry)
        resource_spans.append({
            "resource": {"attributes": _attributes(resource.attributes)},
            "scope_spans": scope_spans,
            "schema_url": resource.schema_url or "",
        })  # fmt: skip
    return ExportTraceServiceRequest(resource_spans=resource_spans)


def grpc_exporter() -> SpanExporter:
    """The SDK's OTLP/gRPC span exporter, encoding with `encode_spans` (gRPC is imported only
    when asked for: it is heavy)."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    class GrpcSpanExporter(OTLPSpanExporter):
        def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
            return encode_spans(data)

    return GrpcSpanExporter()


def _setting(name: str, default: str | None = None) -> str | None:
    """`OTEL_EXPORTER_OTLP_TRACES_<name>`, else `OTEL_EXPORTER_OTLP_<name>`, else `default`."""
    return (
        os.environ.get(f"OTEL_EXPORTER_OTLP_TRACES_{name}")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{name}")
        or default
    )


class HttpSpanExporter(SpanExporter):
    """Spans to an OTLP/HTTP collector, protobuf bodies encoded by `encode_spans`."""

    def __init__(self) -> None:
        endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        if not endpoint:  # the signal's path goes after a base endpoint, as the spec says
            base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://localhost:4318"
            endpoint = base.rstrip("/") + "/v1/traces"
        self.endpoint = endpoint
        self.timeout = float(_setting("TIMEOUT", "10") or 10)  # seconds, as the Python SDK reads it
        self.gzip = (_setting("COMPRESSION") or "none").lower() == "gzip"
        headers = {"content-type": "application/x-protobuf"}
        headers |= {k.lower(): v for k, v in parse_env_headers(_setting("HEADERS") or "",
                                                                liberal=True).items()}  # fmt: skip
        if self.gzip:
            headers["content-encoding"] = "gzip"
        certificate = _setting("CERTIFICATE")  # a CA bundle to trust instead of the system's
        verify = ssl.create_default_context(cafile=certificate) if certificate else True
        self._client = httpx.Client(headers=headers, verify=verify)
        self._shut = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """POST the batch; retried with backoff until the timeout on what a collector retries."""
        if self._shut:
            return SpanExportResult.FAILURE
        body = encode_spans(spans).SerializeToString()
        if self.gzip:
            body = gzip.compress(body)
        deadline, delay = time.monotonic() + self.timeout, 0.25
        while True:
            left = deadline - time.monotonic()
            try:
                response = self._client.post(self.endpoint, content=body, timeout=max(left, 0.01))
                if response.is_success:
                    return SpanExportResult.SUCCESS
                why, again = (
                    f"HTTP {response.status_code}",
                    response.status_code in _RETRIED_STATUSES,
                )
            except httpx.HTTPError as exc:
                why, again = f"{type(exc).__name__}: {exc}", not self._shut
            if not again or time.monotonic() + delay >= deadline:
                log.warning("%d spans not exported to %s: %s", len(spans), self.endpoint, why)
                return SpanExportResult.FAILURE
            time.sleep(delay)
            delay *= 2

    def shutdown(self) -> None:
        self._shut = True
        self._client.close()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True  # each batch is sent when exported: nothing is held here
