"""One model request, end to end: check it, pick an engine, forward, relay, record.

The request path never awaits the database: events go to the store's background writer. A
streamed answer is relayed chunk by chunk as the engine sends it; the recorder coalesces tokens
into chunk events. Every failure is recorded as an event and answered in OpenAI's error shape.
An engine is reached through its transport (`proxy.transport`: HTTP, or a relay that dialled
in), the same way for both; one lost before anything reached the agent leaves a recorded
failure and the request goes to another engine.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from trajstore.proxy.apis import (
    Dropped,
    ImagePart,
    Translation,
    as_chat,
    dropped_header,
    dropped_json,
)
from trajstore.proxy.apis.base import refuse_hosted
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.continuation import RENDERED, Continuer, Plan
from trajstore.proxy.engines import Engine, EnginePool, NoHealthyEngine
from trajstore.proxy.errors import BadRequest, EngineFailed, Overloaded, ProxyError, from_bug
from trajstore.proxy.lineages import PromptContexts, Turn
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.recorder import RequestRecorder, new_request_id
from trajstore.proxy.sessions import Session
from trajstore.proxy.settings import ProxySettings
from trajstore.proxy.streaming import JsonAnswer, RelayResponse, StreamRelay, Write
from trajstore.proxy.switching import Generation, Stitcher, VersionSwitches, continuation_body
from trajstore.proxy.tracing import TurnTracer
from trajstore.proxy.transport import Answer, AnswerBroken, EngineUnreachable, TransportError
from trajstore.proxy.wire import (
    ENGINE_PATHS,
    Api,
    Asked,
    engine_body,
    extract,
    parse_body,
    strip,
)
from trajstore.store import BadEvent, EventWriter

log = logging.getLogger(__name__)

_JSON = "application/json"

#: What a model call is answered with: an ASGI callable (`proxy.streaming`).
Answered = JsonAnswer | RelayResponse


class Forwarder:
    """Serves chat and completion requests of sessions through the engine pool."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        engines: EnginePool,
        writer: EventWriter,
        settings: ProxySettings,
        metrics: ProxyMetrics,
        turn_in_log: Callable[[str, list[Any]], Awaitable[Turn | None]] | None = None,
        replica_id: str | None = None,
        tracer: TurnTracer | None = None,
    ) -> None:
        """`turn_in_log(session_id, messages)`: the session's deepest turn in the log that the
        messages continue, for a request that continues a turn this replica does not remember
        (`proxy.continuation.turn_in_log`); `replica_id`: this replica, recorded with each
        request (`proxy.reaper` fails the requests of replicas that died); `tracer`: makes
        each call's span when tracing is on (`proxy.tracing`)."""
        self.replica_id = replica_id
        self.tracer = tracer
        self.http = http
        self.engines = engines
        self.writer = writer
        self.settings = settings
        self.metrics = metrics
        self.turn_in_log = turn_in_log
        #: Weight switches of the engines: turns in flight cut and continued (`proxy.switching`).
        self.switches = VersionSwitches(engines, writer, hold_timeout=settings.switch_hold_timeout)
        # The turns of each session, by lineage: a prompt can be stored as a reference plus new
        # tokens, and continued from the ids of the turn it continues (proxy.lineages).
        self.contexts = PromptContexts(settings.context_bytes)
        self.continuer = Continuer(
            enabled=settings.continuation == "tokens",
            headers=self._headers(None),
            timeout=settings.request_timeout,
            audit_every=settings.continuation_audit_every,
            audit_growth=settings.continuation_audit_growth,
        )

    async def handle(
        self, api: Api, session: Session, raw: bytes, extra_headers: dict[str, str] | None = None
    ) -> Answered:
        """Answer one request of `session` to `api`: chat or completions, or an API translated
        to chat (`proxy.apis`).

        `extra_headers` (the agent's own `X-*` headers, such as vLLM's X-Request-Id) are passed
        on to the engine; the agent's key never is.
        """
        body, chat, asked, translation, dropped, images = as_chat(
            api, raw, self.settings.hosted_tools
        )
        if self.writer.saturated:
            raise Overloaded(
                "the recorder is behind; retry shortly", retry_after=self.writer.retry_after()
            )
        headers = self._headers(extra_headers)
        call = _Call(api, session, body, chat, asked, translation, headers, dropped, images)
        # An engine lost before anything reached the agent (unreachable, its relay gone, its
        # whole answer broken off) leaves a recorded failure, and the request goes to another
        # engine as a new request of the session; once the agent got a stream's head, a break
        # is the agent's to handle (its stream ends with an error event).
        tried: list[Engine] = []
        failure: ProxyError | None = None
        while len(tried) < _ATTEMPTS:
            try:
                engine = self.engines.choose(session.session_id, exclude=tried)
            except NoHealthyEngine as exc:
                if failure is not None:
                    raise failure from None
                raise Overloaded(str(exc), retry_after=2.0) from None
            tried.append(engine)
            try:
                return await self._attempt(call, engine)
            except _EngineLost as lost:
                failure = lost.error
                log.info("%s; trying another engine", lost.error)
        assert failure is not None
        raise failure

    async def _attempt(self, call: _Call, engine: Engine) -> Answered:
        """Record the request as sent to `engine`, send it, answer the agent; raise
        `_EngineLost` (recorded) when the engine is lost before the agent got anything."""
        api, session, body, chat, asked = call.api, call.session, call.body, call.chat, call.asked
        # A request to an engine that is switching weights waits for the new ones, so that it is
        # recorded with the version that generates it (`proxy.switching`).
        held = await self.switches.ready(engine)
        request_id = new_request_id()
        reply = Reply(asked, call.translation, body, request_id, dropped_header(call.dropped))
        recorder = RequestRecorder(
            self.writer,
            session_id=session.session_id,
            run_id=session.run_id,
            request_id=request_id,
            chunk_tokens=self.settings.chunk_tokens,
            turns=self.contexts.get(session.session_id),
            on_completed=functools.partial(self.contexts.remember, session.session_id),
            on_prompt=functools.partial(self._prompt_sent, engine),
            max_image_bytes=self.settings.max_image_bytes,
            image_token_id=self.settings.image_token_id,
            finish_reason_in_api=(
                None if call.translation is None else call.translation.finish_reason
            ),
            on_ended=None if self.tracer is None else self.tracer.call(
                api=api, session=session, engine=engine.url,
                policy_version=engine.policy_version, body=body,
            ),
        )  # fmt: skip
        try:
            received = recorder.received_event(
                api=api,
                body=body,
                chat=chat,
                engine=engine.url,
                policy_version=engine.policy_version,
                logprobs_mode=self.settings.logprobs_mode,
                asked=asked,
                replica=self.replica_id,
                dropped_tools=dropped_json(call.dropped),
                images=call.images,
            )
        except BadEvent as exc:
            raise BadRequest(f"the request cannot be recorded: {exc}") from None
        await recorder.emit(received)
        if not held:
            message = "the engine's weight switch outlasted the hold; retry shortly"
            await recorder.failed("switch_timeout", message, 503)
            self._count(api, 503)
            raise Overloaded(message, retry_after=2.0)
        self.metrics.requests_started.labels(api=api).inc()
        engine_api: Api = "completions" if api == "completions" else "chat"
        if engine_api == "chat":
            recorder.plan = await self._plan(engine, session.session_id, chat, recorder)
        sent = engine_body(engine_api, chat, recorder.plan.token_ids)
        segment = await self._send(call, engine, sent, recorder)
        if bool(chat.get("stream")):
            return await self._stream(call, segment, recorder, reply, sent)
        return await self._complete(api, segment, recorder, reply, call, sent)

    async def _send(
        self,
        call: _Call,
        engine: Engine,
        body: dict[str, Any],
        recorder: RequestRecorder,
        *,
        resuming: bool = False,
    ) -> _Segment:
        """Send one engine request of the turn, on the version `engine` serves when it goes
        (after any switch it is in); recorded failures raise as `_engine_failure` says."""
        while self.switches.switching(engine) is not None:
            await self.switches.ready(engine)  # a continuation, or a plan that took a while
        # No await from the check to here: a switch that begins after it sees this request.
        continuable = int(body.get("n") or 1) == 1 and not body.get("echo")
        generation = self.switches.register(engine, continuable=continuable)
        recorder.generating_on(engine.policy_version)
        release = self.engines.acquire(engine)
        payload = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
        try:
            answer = await engine.connection().send(
                "POST", ENGINE_PATHS[call.api], payload, call.headers,
                timeout=self.settings.request_timeout, stream=bool(body.get("stream")),
            )  # fmt: skip
        except BaseException as exc:
            release()
            self.switches.unregister(generation)
            if resuming and isinstance(exc, EngineUnreachable):
                self.engines.mark_failed(engine, str(exc))  # another engine may continue it
                raise _EngineLost(EngineFailed(f"the engine at {engine.url}: {exc}")) from None
            raise await self._engine_failure(call.api, engine, recorder, exc) from None
        generation.close = answer.close
        if generation.cut.is_set():
            generation.cut_now()  # the switch began while the request was on its way
        return _Segment(engine, answer, generation, release, self.switches.unregister)

    async def _resume(
        self, call: _Call, cut: _Segment, recorder: RequestRecorder, body: dict[str, Any]
    ) -> _Segment | None:
        """Continue a turn that a switch cut, on the version its engine serves once the switch
        ended (another engine's, when its own is lost); None when nothing is left to generate."""
        switch = self.switches.switching(cut.engine)
        if switch is not None:
            await self.switches.resumed(switch, self.settings.request_timeout)
        prompt = recorder.prompt_ids
        engine_api = "completions" if call.api == "completions" else "chat"
        if prompt is None:
            resumed: dict[str, Any] | None = body  # no token came back: the request again, whole
        else:
            resumed = continuation_body(engine_api, body, prompt, recorder.generated(0))
        if resumed is None:
            return None
        tried = [cut.engine]
        engine = cut.engine
        while True:
            try:
                return await self._send(call, engine, resumed, recorder, resuming=True)
            except _EngineLost as lost:
                try:
                    if len(tried) >= _ATTEMPTS:
                        raise NoHealthyEngine(str(lost.error)) from None
                    engine = self.engines.choose(call.session.session_id, exclude=tried)
                except NoHealthyEngine:
                    await recorder.failed("engine_unreachable", f"no engine continues it: {lost}")
                    self._count(call.api, 502)
                    raise lost.error from None
                tried.append(engine)
                log.info("%s; continuing the turn on %s", lost.error, engine.url)

    async def count_tokens(self, session: Session, raw: bytes) -> Answered:
        """Anthropic's `count_tokens`: the prompt a Messages request would be, counted by the
        engine's own chat template (its `/tokenize`). Nothing is generated, so nothing recorded."""
        request, dropped, _ = Messages().count_tokens_request(parse_body("messages", raw))
        if self.settings.hosted_tools == "refuse":
            refuse_hosted(dropped, "Anthropic")
        try:
            engine = self.engines.choose(session.session_id)
        except NoHealthyEngine as exc:
            raise Overloaded(str(exc), retry_after=2.0) from None
        try:
            answer = await engine.connection().send(
                "POST", "/tokenize", orjson.dumps(request), self._headers(None),
                timeout=self.settings.request_timeout,
            )  # fmt: skip
            status, answer_body = answer.status, await answer.read()
        except (TransportError, TimeoutError) as exc:
            raise EngineFailed(f"the engine at {engine.url} cannot count tokens: {exc}") from None
        if status != 200:
            message = (
                "the engine could not render the messages: "
                f"{answer_body[:500].decode(errors='replace')}"
            )
            error = BadRequest(message) if status == 400 else EngineFailed(message, status=status)
            raise error
        count = orjson.loads(answer_body).get("count")
        return JsonAnswer(orjson.dumps({"input_tokens": count}), headers=dropped_header(dropped))

    # -- non-streaming --------------------------------------------------------------------------

    async def _complete(
        self,
        api: Api,
        segment: _Segment,
        recorder: RequestRecorder,
        reply: Reply,
        call: _Call,
        body: dict[str, Any],
    ) -> Answered:
        while True:
            try:
                status, raw = segment.answer.status, await segment.answer.read()
            except BaseException as exc:
                segment.close()
                if not segment.generation.was_cut or isinstance(exc, asyncio.CancelledError):
                    raise await self._engine_failure(api, segment.engine, recorder, exc) from None
            else:
                segment.close()
                if not segment.generation.was_cut:
                    break
            # A switch cut it before its answer came: nothing reached the agent, nothing was
            # recorded, so the whole request goes again on the new version.
            resumed = await self._resume(call, segment, recorder, body)
            assert resumed is not None  # no token came back: something is left
            segment = resumed
        if status != 200:
            return await self._engine_refusal(api, recorder, status, raw, reply)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await recorder.failed("bad_engine_response", "the engine answered invalid JSON", status)
            self._count(api, 502)
            raise EngineFailed("the engine answered invalid JSON") from None
        extracted = extract(api, data)
        recorder.record(extracted)
        await recorder.finished(extracted.usage)
        self._observe(api, recorder, extracted.usage)
        return JsonAnswer(reply.answer(data), headers=reply.headers)

    # -- streaming ------------------------------------------------------------------------------

    async def _stream(
        self,
        call: _Call,
        segment: _Segment,
        recorder: RequestRecorder,
        reply: Reply,
        body: dict[str, Any],
    ) -> Answered:
        api = call.api
        if segment.answer.status != 200:
            try:
                raw = await segment.answer.read()
            except BaseException as exc:
                segment.answer.close()
                raise await self._engine_failure(api, segment.engine, recorder, exc) from None
            finally:
                segment.close()
            return await self._engine_refusal(api, recorder, segment.answer.status, raw, reply)

        current = [segment]  # the engine request now streaming (a switch may continue it)
        closed = False

        async def close() -> None:
            nonlocal closed
            if closed:
                return
            closed = True
            current[0].answer.close()  # the engine stops generating (vLLM aborts: client left)
            current[0].close()
            if not recorder.ended:
                await recorder.failed("client_disconnected", "the agent left before the stream")

        relay = functools.partial(self._relay, call, current, recorder, reply, body)
        return RelayResponse(relay, on_close=close, headers=reply.headers)

    async def _relay(
        self,
        call: _Call,
        current: list[_Segment],
        recorder: RequestRecorder,
        reply: Reply,
        body: dict[str, Any],
        write: Write,
    ) -> None:
        # Events are relayed as they arrive, but everything that arrived in one read is parsed,
        # recorded and written to the agent at once (`proxy.streaming`).
        api = call.api
        translation = reply.translation
        translator = (
            None if translation is None else translation.stream(reply.body, reply.request_id)
        )
        relay = StreamRelay(api, recorder, reply.asked, translator)
        stitcher: Stitcher | None = None
        while True:
            segment = current[0]
            relay.generation = segment.generation
            try:
                async for data in segment.answer.chunks():
                    out = relay.read(data if stitcher is None else stitcher.feed(data))
                    await recorder.drain()
                    if relay.engine_error is not None:
                        await recorder.failed("engine_error", relay.engine_error)
                        relay.engine_error = None
                    if out:
                        await write(out)
                    if relay.done:
                        break
                    if segment.generation.should_cut():
                        segment.generation.cut_now()
                        break
            except asyncio.CancelledError:
                await recorder.failed("client_disconnected", "the agent closed the connection")
                self._count(api, 499)
                raise
            except (AnswerBroken, TimeoutError, orjson.JSONDecodeError) as exc:
                if not segment.generation.was_cut:
                    await self._broke_off(api, segment.engine, recorder, relay, write, exc)
                    return
            except Exception as exc:
                # A bug of ours, mid-stream: the status line is sent, so the agent learns of it
                # in the stream, and the log keeps the failure instead of a silently cut one.
                log.exception("relaying a stream failed")
                await recorder.failed("proxy_error", f"{type(exc).__name__}: {exc}")
                self._count(api, 500)
                await write(relay.error(from_bug(exc)))
                return
            segment.close()
            if relay.done or not segment.generation.was_cut:
                break
            # A weight switch cut it: the rest comes from the new version, in the same answer.
            stitcher = Stitcher(relay.first_chunk, len(recorder.prompt_ids or ()),
                                recorder.tokens_of(0))  # fmt: skip
            try:
                resumed = await self._resume(call, segment, recorder, body)
            except (ProxyError, TimeoutError) as exc:
                await self._broke_off(api, segment.engine, recorder, relay, write, exc)
                return
            if resumed is None:  # cut at its last token: the turn is whole
                relay.done = True
                await write(relay.read(b"data: [DONE]\n\n"))
                break
            current[0] = resumed
        if relay.done and not recorder.ended:
            await recorder.finished(relay.usage)
            self._observe(api, recorder, relay.usage)
        elif not relay.done:
            await recorder.failed("engine_error", "the engine closed the stream before [DONE]")
            self._count(api, 502)
            failure = EngineFailed("the engine closed the stream before it was complete")
            await write(relay.error(failure))

    async def _broke_off(
        self,
        api: Api,
        engine: Engine,
        recorder: RequestRecorder,
        relay: StreamRelay,
        write: Write,
        exc: BaseException,
    ) -> None:
        """The engine's stream broke off (or could not be continued after a switch): record
        it, and end the agent's stream with an error event."""
        reason = "engine_timeout" if isinstance(exc, TimeoutError) else "engine_error"
        message = f"the engine stream broke off: {type(exc).__name__}: {exc}"
        if isinstance(exc, AnswerBroken):
            # The connection broke (an engine killed mid-stream): the session's next
            # requests go elsewhere unless the engine still answers its health check.
            self.engines.suspect(engine, message)
        await recorder.failed(reason, message)
        self._count(api, 502)
        await write(relay.error(EngineFailed(message)))

    # -- continuation ---------------------------------------------------------------------------

    async def _plan(
        self, engine: Engine, session_id: str, body: dict[str, Any], recorder: RequestRecorder
    ) -> Plan:
        """How the prompt reaches the engine; a failure here renders it, as without continuation."""

        async def in_log() -> Turn | None:
            if self.turn_in_log is None:
                return None
            return await self.turn_in_log(session_id, body["messages"])

        try:
            turns = recorder.turns
            return await self.continuer.plan(
                engine, body, recorder.candidates, turns.latest, in_log
            )
        except Exception:
            log.exception("continuing a prompt failed; the engine renders it from the messages")
            return RENDERED._replace(fallback="proxy_error")

    def _prompt_sent(self, engine: Engine, plan: Plan) -> None:
        """Count how a chat prompt reached the engine; stop continuing where it was ignored."""
        self.metrics.prompts.labels(source=plan.source, fallback=plan.fallback or "").inc()
        if plan.drift_at is not None:
            self.metrics.drift_avoided.inc()
        if plan.fallback == "engine_ignored_token_prompt" and engine.token_prompts:
            log.warning("the engine at %s ignored a token prompt: prompts are rendered from "
                        "text there from now on", engine.url)  # fmt: skip
            engine.token_prompts = False

    # -- failures and bookkeeping ---------------------------------------------------------------

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = {"Content-Type": _JSON, **(extra or {})}
        if self.settings.engine_api_key:
            headers["Authorization"] = f"Bearer {self.settings.engine_api_key}"
        return headers

    async def _engine_failure(
        self, api: Api, engine: Engine, recorder: RequestRecorder, exc: BaseException
    ) -> BaseException:
        """Record why the engine gave no (whole) answer; return the error to raise: a lost
        engine is `_EngineLost`, which sends the request to another engine."""
        if isinstance(exc, asyncio.CancelledError):
            await recorder.failed("client_disconnected", "the agent closed the connection")
            return exc
        if isinstance(exc, TimeoutError):
            await recorder.failed("engine_timeout", "the engine did not answer in time")
            self._count(api, 504)
            return EngineFailed("the engine did not answer in time", status=504)
        if isinstance(exc, EngineUnreachable):
            self.engines.mark_failed(engine, str(exc))
            await recorder.failed("engine_unreachable", f"{type(exc).__name__}: {exc}")
            self._count(api, 502)
            return _EngineLost(EngineFailed(f"the engine at {engine.url} cannot be reached: {exc}"))
        if isinstance(exc, AnswerBroken):
            message = f"the engine's answer broke off: {exc}"
            self.engines.suspect(engine, message)
            await recorder.failed("engine_error", message)
            self._count(api, 502)
            return _EngineLost(EngineFailed(f"the engine at {engine.url} broke off: {exc}"))
        await recorder.failed("proxy_error", f"{type(exc).__name__}: {exc}")
        return exc

    async def _engine_refusal(
        self, api: Api, recorder: RequestRecorder, status: int, raw: bytes, reply: Reply
    ) -> Answered:
        """The engine refused the request: record it, pass its (OpenAI-shaped) error on, in the
        agent's API's shape."""
        try:
            message = str(orjson.loads(raw).get("error", {}).get("message"))
        except (orjson.JSONDecodeError, AttributeError):
            message = raw[:500].decode(errors="replace")
        await recorder.failed("engine_error", message, status)
        self._count(api, status)
        if reply.translation is not None:
            error = BadRequest(message) if status == 400 else EngineFailed(message, status=status)
            error.status = status
            raw = orjson.dumps(reply.translation.error_body(error))
        return JsonAnswer(raw, status)

    def _count(self, api: Api, status: int) -> None:
        self.metrics.requests.labels(api=api, status=str(status)).inc()

    def _observe(self, api: Api, recorder: RequestRecorder, usage: dict[str, Any] | None) -> None:
        self._count(api, 200)
        latency = time.monotonic() - recorder.started
        self.metrics.latency.labels(api=api).observe(latency)
        if recorder.first_token_at is not None:
            self.metrics.ttft.labels(api=api).observe(recorder.first_token_at - recorder.started)
        if usage:
            self.metrics.tokens.labels(kind="prompt").inc(usage.get("prompt_tokens") or 0)
            self.metrics.tokens.labels(kind="completion").inc(usage.get("completion_tokens") or 0)


_ATTEMPTS = 3  # engines one request may be sent to, when the first ones are lost


class _EngineLost(Exception):
    """The engine was lost before the agent got anything: try another (recorded already)."""

    def __init__(self, error: ProxyError) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class _Segment:
    """One engine request of a turn: the first, or a continuation after a weight switch."""

    engine: Engine
    answer: Answer
    generation: Generation
    release: Callable[[], None]
    unregister: Callable[[Generation], None]

    def close(self) -> None:
        """It is over: the engine's slot and the switch's watch are released (again: no-op)."""
        self.release()
        self.generation.close = None
        self.unregister(self.generation)


@dataclass
class _Call:
    """What every attempt at one agent request shares."""

    api: Api
    session: Session
    body: dict[str, Any]  #: the agent's request
    chat: dict[str, Any]  #: what the engine is asked (chat, or the agent's completions body)
    asked: Asked
    translation: Translation | None
    headers: dict[str, str]
    dropped: list[Dropped]  #: of the agent's tools, those the engine does not get
    images: list[ImagePart]  #: a translated request's images (`proxy.apis.ImagePart`)


@dataclass
class Reply:
    """How the engine's answers go back to the agent: as the engine gave them, less what the
    agent did not ask for (chat, completions), or translated into its API (`proxy.apis`)."""

    asked: Asked
    translation: Translation | None
    body: dict[str, Any]  #: the agent's request
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)  #: said with the answer

    def answer(self, data: dict[str, Any]) -> bytes:
        """A whole answer, as the agent's API gives it."""
        if self.translation is None:
            return orjson.dumps(strip(data, self.asked, streaming=False))
        return orjson.dumps(self.translation.answer(data, self.body, self.request_id))
