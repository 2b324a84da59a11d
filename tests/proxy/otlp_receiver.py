"""Real OTLP trace receivers for tests: HTTP (`POST /v1/traces`) and gRPC (`TraceService`).

Each decodes the wire format with the OpenTelemetry protocol package
(`ExportTraceServiceRequest`), as a collector does, and keeps every span it got, flattened
with its resource's attributes. `benchmarks/proxy_overhead.py --tracing` uses the HTTP one as
its collector.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


def value_of(value: AnyValue) -> Any:
    """An OTLP attribute value as Python."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [value_of(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    """One span as the collector got it."""

    name: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    events: list[tuple[str, int]]  #: (name, time in ns)
    links: list[tuple[int, int]]  #: (trace id, span id) of each linked span
    status_code: int
    resource: dict[str, Any]


@dataclass
class Received:
    """What a receiver got, thread-safe."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    headers: list[dict[str, str]] = field(default_factory=list)  #: each POST's (HTTP)
    refusals: list[int] = field(default_factory=list)  #: statuses still to answer (HTTP)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        """Decode one export request's spans."""
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: value_of(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(ReceivedSpan(
                        name=span.name,
                        trace_id=int.from_bytes(span.trace_id, "big"),
                        span_id=int.from_bytes(span.span_id, "big"),
                        parent_span_id=(int.from_bytes(span.parent_span_id, "big")
                                        if span.parent_span_id else None),
                        kind=span.kind,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano,
                        attributes={a.key: value_of(a.value) for a in span.attributes},
                        events=[(e.name, e.time_unix_nano) for e in span.events],
                        links=[(int.from_bytes(k.trace_id, "big"), int.from_bytes(k.span_id, "big"))
                               for k in span.links],
                        status_code=span.status.code,
                        resource=resource,
                    ))  # fmt: skip
        with self.lock:
            self.requests += 1
            self.spans += spans

    def wait_for(self, n: int, timeout: float = 20.0) -> list[ReceivedSpan]:
        """The spans, once at least `n` came (AssertionError after `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= n:
                    return list(self.spans)
            time.sleep(0.02)
        raise AssertionError(f"the collector got {len(self.spans)} spans, not {n}")


@contextlib.contextmanager
def http_receiver(refuse: tuple[int, ...] = ()) -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver (protobuf bodies on /v1/traces): its endpoint and what it got.
    `refuse`: statuses it answers its first POSTs with, in order, before it takes any."""
    received = Received(refusals=list(refuse))

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            with received.lock:
                received.headers.append({k.lower(): v for k, v in self.headers.items()})
                refusal = received.refusals.pop(0) if received.refusals else None
            if self.path != "/v1/traces" or refusal is not None:
                self.send_response(refusal or 404)
                self.send_header("content-length", "0")
                self.end_headers()
                return
            if self.headers.get("content-encoding") == "gzip":
                import gzip

                body = gzip.decompress(body)
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.take(request)
            answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver (`TraceService/Export`, plaintext): its endpoint and what it got."""
    from concurrent import futures

    import grpc

    received = Received()

    class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(  # noqa: N802 (the protocol's name)
            self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
        ) -> trace_service_pb2.ExportTraceServiceResponse:
            received.take(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)
