"""The proxy's OpenTelemetry spans, received by real OTLP receivers (HTTP and gRPC), checked
against what the log recorded; and a collector that is down costs the agents nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson
import pytest
from openai import AsyncOpenAI

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from tests.proxy.otlp_receiver import ReceivedSpan, grpc_receiver, http_receiver
from trajstore.proxy.errors import TracingUnavailable
from trajstore.proxy.settings import ProxySettings
from trajstore.proxy.tracing import session_span_id, start_tracing, trace_id_of
from trajstore.store import EventStore
from trajstore.store.records import SessionRecord
from trajstore.store.sessions import rebuild_session
from trajstore.viewer import ViewerSettings, create_app

VIEWER = "http://viewer.test:8401"
SPAN_KIND_CLIENT = 3
STATUS_ERROR = 2


def _collector(monkeypatch: pytest.MonkeyPatch, endpoint: str, protocol: str) -> None:
    """Point the SDK at a collector through the standard variables; batches leave every 50 ms."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "2")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "proxy-under-test")


def _agent(proxy: RunningProxy, session: dict[str, Any]) -> AsyncOpenAI:
    """The session's agent, talking to `proxy` (any replica serves any session)."""
    base_url = f"{proxy.url}/sessions/{session['session_id']}/v1"
    return AsyncOpenAI(base_url=base_url, api_key=session["api_key"], max_retries=0)


async def _converse(
    proxies: list[RunningProxy], session: dict[str, Any], *, stream_at: int = 1
) -> list[dict[str, Any]]:
    """One conversation, a turn through each proxy in turn (turn `stream_at` streamed); the
    messages of its last call."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You count apples."},
        {"role": "user", "content": "How many apples are there?"},
    ]
    for n, proxy in enumerate(proxies):
        async with _agent(proxy, session) as agent:
            content = await _call(agent, messages, n, stream=n == stream_at)
        if n < len(proxies) - 1:
            messages = [*messages, {"role": "assistant", "content": content},
                        {"role": "user", "content": f"And then {n}?"}]  # fmt: skip
    return messages


async def _call(agent: AsyncOpenAI, messages: list[dict[str, Any]], n: int, *, stream: bool
                ) -> str:  # fmt: skip
    """One call; the reply's text."""
    if stream:
        stream = await agent.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=7,
            stream=True,  # type: ignore[arg-type]
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    answer = await agent.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5 + n,
        temperature=0.5,  # type: ignore[arg-type]
    )
    return answer.choices[0].message.content or ""


async def _recorded(database_url: str, session_id: str) -> SessionRecord:
    async with await EventStore.open(database_url) as store:
        return rebuild_session(session_id, await store.read_session(session_id))


def _by_request(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    calls = [s for s in spans if "trajstore.request.id" in s.attributes]
    by_request = {s.attributes["trajstore.request.id"]: s for s in calls}
    assert len(by_request) == len(calls), "one span per call"
    return by_request


async def test_a_sessions_calls_are_one_trace_of_genai_spans_equal_to_the_log(
    start_proxy: ProxyFactory,
    engine: FakeEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        # Two replicas serve the session: their spans still make one trace.
        options = {"tracing": "otlp", "viewer_url": VIEWER, "session_secret": "shared"}
        a = await start_proxy([engine.url], **options)
        b = await start_proxy([engine.url], **options)
        session = await a.new_session(run_id="run-traced", task_id="task-7", group_id="g-1")
        session_id = session["session_id"]
        await _converse([a, b, a], session)
        assert (await a.finish(session_id)).status_code == 200
        spans = received.wait_for(4)  # three calls and the session

    record = await _recorded(database_url, session_id)
    assert [t.status for t in record.turns] == ["completed"] * 3
    assert {s.trace_id for s in spans} == {trace_id_of(session_id)}  # one trace
    calls = _by_request(spans)
    assert set(calls) == {t.request_id for t in record.turns}  # a span per call, no other
    (root,) = [s for s in spans if s not in calls.values()]
    assert root.span_id == session_span_id(session_id) and root.parent_span_id is None
    assert root.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert root.attributes["trajstore.session.status"] == "completed"
    assert root.attributes["trajstore.task.id"] == "task-7"
    for index, turn in enumerate(record.turns):
        span = calls[turn.request_id]
        attributes = span.attributes
        assert span.name == "chat tiny" and span.kind == SPAN_KIND_CLIENT
        assert span.parent_span_id == root.span_id
        assert span.resource["service.name"] == "proxy-under-test"
        assert attributes["gen_ai.operation.name"] == "chat"
        assert attributes["gen_ai.request.model"] == "tiny"
        assert attributes["gen_ai.response.model"] == "tiny"
        assert attributes["gen_ai.conversation.id"] == session_id
        # Token counts and endings are those the log holds.
        assert attributes["gen_ai.usage.input_tokens"] == turn.n_prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"] == len(turn.choices[0].token_ids)
        assert attributes["gen_ai.response.finish_reasons"] == [turn.choices[0].finish_reason]
        assert attributes["trajstore.session.id"] == session_id
        assert attributes["trajstore.run.id"] == "run-traced"
        assert attributes["trajstore.task.id"] == "task-7"
        assert attributes["trajstore.group.id"] == "g-1"
        assert attributes["trajstore.policy.version"] == turn.policy_version
        # The latency is the span's duration.
        assert (span.end_ns - span.start_ns) / 1e9 == pytest.approx(turn.latency_s, abs=1e-6)
        assert attributes["trajstore.time_to_first_token_s"] == pytest.approx(turn.ttft_s)
        assert [name for name, _ in span.events] == ["gen_ai.first_token"]
        assert "gen_ai.input.messages" not in attributes  # no prompt text unless asked
        assert attributes["trajstore.viewer.url"] == (
            f"{VIEWER}/sessions/{session_id}/requests/{turn.request_id}"
        )
        if index:  # the lineage: this turn extends the one before, and links to its span
            extended = record.turns[index - 1].request_id
            assert attributes["trajstore.lineage.extends"] == extended
            assert span.links == [(span.trace_id, calls[extended].span_id)]
        else:
            assert "trajstore.lineage.extends" not in attributes and not span.links
    assert calls[record.turns[1].request_id].attributes["gen_ai.request.max_tokens"] == 7
    assert calls[record.turns[2].request_id].attributes["gen_ai.request.temperature"] == 0.5
    replicas = [calls[t.request_id].resource["service.instance.id"] for t in record.turns]
    assert replicas[0] == replicas[2] != replicas[1]

    # Each span's link opens its turn in the viewer.
    viewer = create_app(database_url, ViewerSettings(poll_interval=0.1))
    async with (
        viewer.router.lifespan_context(viewer),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=viewer), base_url=VIEWER) as http,
    ):
        for index, turn in enumerate(record.turns):
            link = calls[turn.request_id].attributes["trajstore.viewer.url"]
            answer = await http.get(link)
            assert answer.status_code == 307
            assert answer.headers["location"] == f"/sessions/{session_id}?page=1#turn-{index}"
            page = await http.get(answer.headers["location"])
            assert f'id="turn-{index}"' in page.text
        missing = await http.get(f"/sessions/{session_id}/requests/no-such-request")
        assert missing.status_code == 404


async def test_spans_reach_a_grpc_collector_with_content_when_asked(
    start_proxy: ProxyFactory,
    engine: FakeEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with grpc_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "grpc")
        proxy = await start_proxy([engine.url], tracing="otlp", tracing_content=True)
        session = await proxy.new_session(run_id="run-grpc")
        messages = await _converse([proxy, proxy], session)
        assert (await proxy.finish(session["session_id"])).status_code == 200
        spans = received.wait_for(3)

    record = await _recorded(database_url, session["session_id"])
    calls = _by_request(spans)
    assert set(calls) == {t.request_id for t in record.turns}
    assert {s.trace_id for s in spans} == {trace_id_of(session["session_id"])}
    assert len(spans) == 3  # and the session's own
    last = calls[record.turns[1].request_id].attributes
    assert last["gen_ai.usage.input_tokens"] == record.turns[1].n_prompt_tokens
    assert orjson.loads(last["gen_ai.input.messages"]) == messages
    replies = orjson.loads(last["gen_ai.output.messages"])
    assert replies == [record.turns[1].choices[0].message]
    assert "trajstore.viewer.url" not in last  # no viewer named, no link


async def test_every_agent_api_gives_its_call_a_span_with_the_logs_counts(
    start_proxy: ProxyFactory,
    engine: FakeEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Completions, Anthropic Messages (streamed) and OpenAI Responses through their official
    clients: a span each, its operation named for the API, the log's token counts."""
    import anthropic

    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        proxy = await start_proxy([engine.url], tracing="otlp")
        session = await proxy.new_session(run_id="run-apis")
        async with _agent(proxy, session) as agent:
            await agent.completions.create(model="tiny", prompt="Count apples:", max_tokens=4)
            await agent.responses.create(model="tiny", input="How many?", max_output_tokens=5)
        claude = anthropic.AsyncAnthropic(base_url=session["anthropic_base_url"],
                                          api_key=session["api_key"], max_retries=0)  # fmt: skip
        async with claude.messages.stream(
            model="tiny", max_tokens=6, messages=[{"role": "user", "content": "Apples?"}]
        ) as stream:
            await stream.get_final_message()
        assert (await proxy.finish(session["session_id"])).status_code == 200  # all durable
        spans = received.wait_for(4)  # and the session's

    record = await _recorded(database_url, session["session_id"])
    calls = _by_request(spans)
    assert set(calls) == {t.request_id for t in record.turns} and len(calls) == 3
    operations = {}
    for turn in record.turns:
        attributes = calls[turn.request_id].attributes
        operations[turn.api] = attributes["gen_ai.operation.name"]
        assert attributes["trajstore.api"] == turn.api
        assert attributes["gen_ai.usage.input_tokens"] == turn.n_prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"] == len(turn.choices[0].token_ids) > 0
        assert attributes["gen_ai.response.finish_reasons"] == [turn.choices[0].finish_reason]
    assert operations == {"completions": "text_completion", "responses": "chat", "messages": "chat"}


async def test_a_collector_that_is_down_costs_the_agent_nothing_and_loses_no_recording(
    start_proxy: ProxyFactory,
    engine: FakeEngine,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _collector(monkeypatch, f"http://127.0.0.1:{free_port()}", "http/protobuf")  # nobody there
    proxy = await start_proxy([engine.url], tracing="otlp")
    session = await proxy.new_session(run_id="run-dark")
    await _converse([proxy, proxy, proxy], session)
    assert (await proxy.finish(session["session_id"])).status_code == 200
    record = await _recorded(database_url, session["session_id"])
    assert record.status == "completed"
    assert [t.status for t in record.turns] == ["completed"] * 3
    assert all(t.choices[0].token_ids and t.n_prompt_tokens for t in record.turns)


async def test_each_session_ending_gives_its_root_span_once(
    start_proxy: ProxyFactory, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A retried finish (an orchestrator's retry after a lost answer) gives no second root; a
    session the proxy times out at its deadline gets one too, saying so."""
    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        proxy = await start_proxy([engine.url], tracing="otlp")
        finished = (await proxy.new_session(run_id="run-retried"))["session_id"]
        assert (await proxy.finish(finished)).status_code == 200
        assert (await proxy.finish(finished)).status_code == 200  # the retry: same answer
        late = await proxy.new_session(run_id="run-late", deadline_s=0.2)
        await asyncio.sleep(0.4)
        async with _agent(proxy, late) as agent:
            with pytest.raises(Exception, match="deadline"):
                await agent.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}]
                )
        # The timeout's root was queued last: once it is in, a second root of the retried
        # finish, queued before it, would be in too (the exporter sends in order).
        for _ in range(1000):
            spans = list(received.spans)
            if any(s.attributes["trajstore.session.status"] == "timeout" for s in spans):
                break
            await asyncio.sleep(0.02)
    statuses = {trace_id_of(finished): "completed", trace_id_of(late["session_id"]): "timeout"}
    assert sorted((s.trace_id, s.attributes["trajstore.session.status"]) for s in spans) == sorted(
        statuses.items()
    )


async def test_a_failed_call_is_an_error_span(
    start_proxy: ProxyFactory, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        proxy = await start_proxy([engine.url], tracing="otlp")
        session = await proxy.new_session(run_id="run-failing")
        async with _agent(proxy, session) as agent:
            with pytest.raises(Exception, match="400"):
                await agent.chat.completions.create(
                    model="error-400", messages=[{"role": "user", "content": "hi"}]
                )
        (span,) = received.wait_for(1)
    assert span.status_code == STATUS_ERROR
    assert span.attributes["error.type"] == "engine_error"
    assert span.attributes["gen_ai.request.model"] == "error-400"


async def test_a_call_refused_by_admission_is_an_error_span_too(
    start_proxy: ProxyFactory, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine.delay = 1.0
    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        proxy = await start_proxy([engine.url], tracing="otlp")
        limit = {"max_in_flight": 1, "max_queued": 0}
        session = await proxy.new_session(run_id="run-full", rate_limit=limit)
        url = f"{session['base_url']}/chat/completions"
        headers = {"Authorization": f"Bearer {session['api_key']}"}
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "m"}]}
        slow = asyncio.create_task(
            proxy.http.post(url, json=body, headers={**headers, "X-Fake-Fault": "slow"})
        )
        while proxy.app.state.proxy.admission.describe("run-full")["in_flight"] < 1:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        refused = await proxy.http.post(url, json=body, headers=headers)
        assert refused.status_code == 429
        assert (await slow).status_code == 200
        spans = received.wait_for(2)
    (span,) = [s for s in spans if s.status_code == STATUS_ERROR]
    assert span.attributes["error.type"] == "rate_limited"
    assert span.attributes["trajstore.run.id"] == "run-full"


def test_an_unknown_protocol_stops_the_proxy_with_what_to_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(TracingUnavailable, match="'http/protobuf' or 'grpc'"):
        start_tracing(ProxySettings(tracing="otlp"))
    assert start_tracing(ProxySettings()) is None  # off by default


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_real_vllm_sessions_spans_hold_what_the_log_recorded(
    start_proxy: ProxyFactory, vllm: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with http_receiver() as (endpoint, received):
        _collector(monkeypatch, endpoint, "http/protobuf")
        proxy = await start_proxy([vllm], tracing="otlp")
        session = await proxy.new_session(run_id="run-vllm")
        await _converse([proxy, proxy, proxy], session)
        assert (await proxy.finish(session["session_id"])).status_code == 200
        spans = received.wait_for(4)

    record = await _recorded(database_url, session["session_id"])
    calls = _by_request(spans)
    assert set(calls) == {t.request_id for t in record.turns}
    for turn in record.turns:
        attributes = calls[turn.request_id].attributes
        assert attributes["gen_ai.response.model"] == "tiny"  # vLLM's served name
        assert attributes["gen_ai.usage.input_tokens"] == turn.n_prompt_tokens
        assert attributes["gen_ai.usage.output_tokens"] == len(turn.choices[0].token_ids)
        if turn.usage:  # the engine's own count, where it gave one
            assert attributes["gen_ai.usage.output_tokens"] == turn.usage["completion_tokens"]
        assert attributes["gen_ai.response.finish_reasons"] == [turn.choices[0].finish_reason]
