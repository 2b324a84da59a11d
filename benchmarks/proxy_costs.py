"""Where the proxy's CPU goes: each stage of a model call, timed alone, in this process.

    python benchmarks/proxy_costs.py [--repeat 7] [--tracing]

benchmarks/proxy_overhead.py measures the whole proxy against the floor; this splits the proxy's
own work into its stages, each run on the benchmark's own request (the two-message chat of
max_tokens 64) and on the fake engine's own answers to it (whole, and the 64-token stream of 67
server-sent events), through the proxy's real functions: routing and the key check, the body's
parse, the request's event, the engine's body, the answer's parse and record, the agent's answer,
the metrics, the writer's queue; with `--tracing`, the call's OpenTelemetry span (`proxy.tracing`:
built and queued on the request path, then encoded for OTLP by the exporter's thread). The
writer's COPY and PostgreSQL are not here (overhead's db/req
column), nor the server, the engine client and the event loop (overhead's `--floors`: the
pass-through on the proxy's own server). Each figure is the least thread CPU time per call over
`--repeat` rounds: the machine's other load cannot add to it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from overhead_servers import request_body

from tests.proxy.fake_engine import FakeEngine
from trajstore.proxy.apis import as_chat
from trajstore.proxy.attempts import Reply
from trajstore.proxy.auth import require_session_key
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.model_calls import match, presented_key
from trajstore.proxy.outcomes import Outcomes
from trajstore.proxy.recorder import RequestRecorder
from trajstore.proxy.sessions import SessionRegistry
from trajstore.proxy.streaming import StreamRelay
from trajstore.proxy.wire import engine_body, extract, extract_stream
from trajstore.store.writer import copy_row


class _Queue:
    """The writer's side of `put`: the row COPY will send, built and queued, nothing written."""

    saturated = False

    def __init__(self) -> None:
        self.rows: list[tuple[Any, ...]] = []

    async def put(self, stream_id: str, version: int, event: Any) -> None:
        self.rows.append(copy_row(stream_id, version, event))


def least(call: Callable[[], Any], repeat: int, number: int = 300) -> float:
    """The least thread CPU time of one call, in µs."""
    best = float("inf")
    for _ in range(repeat):
        started = time.thread_time()
        for _ in range(number):
            call()
        best = min(best, (time.thread_time() - started) / number)
    return best * 1e6


def drive(coroutine: Coroutine[Any, Any, Any]) -> None:
    """Run a coroutine that never waits (the queue above always has room) without a loop."""
    try:
        coroutine.send(None)
    except StopIteration:
        return
    raise RuntimeError("the coroutine waited")


def recorder() -> RequestRecorder:
    return RequestRecorder(_Queue(), session_id="s-1", run_id="r", request_id="q" * 32)  # type: ignore[arg-type]


def tracing_stages(repeat: int) -> list[tuple[str, str, float]]:
    """(part, stage, µs) of one call's span: built and queued, then encoded (in a batch of 512,
    as the exporter's thread does; sending a batch is one HTTP request for 512 spans)."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import (
        encode_spans as sdk_encode_spans,
    )
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from trajstore.proxy.otlp_export import encode_spans
    from trajstore.proxy.sessions import Session
    from trajstore.proxy.tracing import TurnTracer
    from trajstore.store.payloads_request import CompletionFinished

    provider = TracerProvider(resource=Resource.create({"service.name": "trajstore-proxy"}))
    # A queue nothing empties while timing: `on_end` costs what it costs when the exporter
    # keeps up (a full queue drops spans, which is cheaper).
    processor = BatchSpanProcessor(
        InMemorySpanExporter(), max_queue_size=10**7, max_export_batch_size=10**7,
        schedule_delay_millis=10**9,
    )  # fmt: skip
    provider.add_span_processor(processor)
    tracer = TurnTracer(provider, processor, viewer_url="http://127.0.0.1:8500")
    session = Session(session_id="s-1", run_id="r", task_id="task-1", group_id="g-1")
    body = orjson.loads(request_body(False))
    rec = recorder()
    rec.prompt_recorded = False
    whole = orjson.loads(FakeEngine(instant=True)._render("chat", engine_body("chat", body)))
    rec.record(extract("chat", whole))
    drive(rec.finished(None))
    # The stored form the recorder writes; with tracing on it reads it typed for the tracer.
    finished = {"choices": [{"index": 0, "finish_reason": "length", "n_tokens": 64}],
                "latency_s": 0.01, "ttft_s": 0.002}  # fmt: skip

    def span() -> None:
        ended = tracer.call(api="chat", session=session, engine="http://e", policy_version="0",
                            body=body)  # fmt: skip
        assert ended is not None
        ended(rec, CompletionFinished.read(finished))

    built = least(span, repeat)
    queued = list(processor._batch_processor._queue)[:512]
    assert queued and "gen_ai.usage.output_tokens" in queued[0].attributes  # spans, not errors
    encoded = least(lambda: encode_spans(queued).SerializeToString(), repeat, 3)
    by_sdk = least(lambda: sdk_encode_spans(queued).SerializePartialToString(), repeat, 3)
    processor.shutdown()
    return [
        ("tracing", "the call's span built and queued (request path)", built),
        ("tracing", "the span encoded for OTLP (exporter thread)", encoded / len(queued)),
        ("sdk", "the span encoded by the SDK's encoder instead (before)", by_sdk / len(queued)),
    ]


def stages(repeat: int) -> list[tuple[str, str, float]]:
    """(part, stage, µs) for one request, one stream and one stream event."""
    run = drive
    engine = FakeEngine(instant=True)
    raw = request_body(False)
    request = as_chat("chat", raw)
    whole = engine._render("chat", engine_body("chat", request.chat))
    stream_raw = request_body(True)
    stream_request = as_chat("chat", stream_raw)
    events = engine._render("chat", engine_body("chat", stream_request.chat))
    assert isinstance(whole, bytes) and isinstance(events, list)
    answer = b"".join(events)
    registry = SessionRegistry(None, None, b"secret", replica_id="x")  # type: ignore[arg-type]
    headers = [(b"authorization", f"Bearer {registry.key_for('s-1')}".encode())] * 1 + [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(raw)),
        (b"host", b"127.0.0.1:8400"), (b"user-agent", b"Python/3.11 aiohttp/3.14"),
    ]  # fmt: skip
    outcomes = Outcomes(None, ProxyMetrics())  # type: ignore[arg-type]  # no engine is lost here

    def route_and_auth() -> None:
        match("/sessions/s-1/v1/chat/completions")
        named = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers}
        require_session_key(registry, None, "s-1", presented_key(named), model_call=True)

    def received(rec: RequestRecorder, call: Any = request) -> None:
        event = rec.received_event(
            api="chat", body=call.body, chat=call.chat, engine="http://e", policy_version="0",
            logprobs_mode="raw", asked=call.asked, replica="x",
        )  # fmt: skip
        run(rec.emit(event))

    def record_whole() -> None:
        rec = recorder()
        rec.record(extract("chat", orjson.loads(whole)))
        run(rec.drain())
        run(rec.finished(None))

    data = orjson.loads(whole)
    reply = Reply(request.asked, None, request.body, "q")
    reply.answer(data)  # stripped in place once: later calls serialise the same answer
    usage = data.get("usage")

    def relay_stream() -> None:
        rec = recorder()
        relay = StreamRelay("chat", rec, stream_request.asked)
        relay.read(answer)
        run(rec.drain())
        run(rec.finished(relay.usage))

    payloads = [event[6:-2] for event in events[:-1]]
    joined = b"[" + b",".join(payloads) + b"]"
    chunks = orjson.loads(joined)
    n = len(events)

    def strip_and_serialise() -> None:
        relay = StreamRelay("chat", recorder(), stream_request.asked)
        relay.recorder.record = lambda extracted: None  # type: ignore[method-assign]
        relay._relayed(payloads)

    extracted = extract_stream("chat", chunks)

    def record_read() -> None:
        rec = recorder()
        rec.record(extracted)
        run(rec.drain())

    def t(call: Callable[[], Any]) -> float:
        return least(call, repeat)

    loads = t(lambda: orjson.loads(joined))
    engine_json = lambda: orjson.dumps(engine_body("chat", request.chat))  # noqa: E731
    out: list[tuple[str, str, float]] = [
        ("request", "routing and the key check", t(route_and_auth)),
        ("request", "the body parsed and checked", t(lambda: as_chat("chat", raw))),
        ("request", "request_received: built, encoded, queued", t(lambda: received(recorder()))),
        ("request", "the engine's body", t(engine_json)),
        ("request", "the answer parsed", t(lambda: orjson.loads(whole))),
        ("request", "the answer recorded (prompt, chunk, finished)", t(record_whole)),
        ("request", "the agent's answer (stripped, serialised)", t(lambda: reply.answer(data))),
        ("request", "metrics", t(lambda: outcomes.observe("chat", recorder(), usage))),
        ("stream", f"the whole stream relayed and recorded ({n} events)", t(relay_stream)),
        ("event", "parsed (one orjson.loads per read)", loads / n),
        ("event", "ids, logprobs, text taken out", t(lambda: extract_stream("chat", chunks)) / n),
        ("event", "recorded (prompt, chunk events built, encoded, queued)", t(record_read) / n),
        ("event", "stripped and serialised for the agent", (t(strip_and_serialise) - loads) / n),
    ]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds; the least is kept [7]")
    parser.add_argument(
        "--tracing", action="store_true", help="also the call's OpenTelemetry span (proxy.tracing)"
    )
    args = parser.parse_args()
    rows = stages(args.repeat)
    if args.tracing:
        rows += tracing_stages(args.repeat)
    print(f"{'part':<8} {'stage':<66} {'µs':>8}")
    for part, stage, micros in rows:
        print(f"{part:<8} {stage:<66} {micros:8.1f}")
    if args.tracing:
        request = sum(micros for part, _, micros in rows if part == "request")
        stream = next(micros for part, _, micros in rows if part == "stream")
        span = sum(micros for part, _, micros in rows if part == "tracing")
        print(
            f"a span: {span:.1f} µs = {span / request:.1%} of a whole answer's stages "
            f"({request:.1f} µs), {span / stream:.1%} of a stream's ({stream:.1f} µs)"
        )


if __name__ == "__main__":
    main()
