"""One model request, end to end: check it, pick an engine, forward, relay, record.

The request path never awaits the database: events go to the store's background writer. A
streamed answer is relayed chunk by chunk as the engine sends it; the recorder coalesces tokens
into chunk events. Every failure is recorded as an event and answered in OpenAI's error shape.
An engine is reached through its transport (`proxy.transport`: HTTP, or a relay that dialled
in), the same way for both; one lost before anything reached the agent leaves a recorded
failure and the request goes to another engine.

A streamed answer's relay is `proxy.streamed_turn`; how a call ended is recorded and counted by
`proxy.outcomes`; what the attempts at one request share is in `proxy.attempts`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson

from trajstore.proxy.apis import as_chat, dropped_header, dropped_json
from trajstore.proxy.apis.base import refuse_hosted
from trajstore.proxy.apis.messages import Messages
from trajstore.proxy.attempts import ATTEMPTS, Call, EngineLost, Reply, Segment
from trajstore.proxy.continuation import RENDERED, Continuer, Plan
from trajstore.proxy.engines import Engine, EnginePool, NoHealthyEngine
from trajstore.proxy.errors import BadRequest, EngineFailed, Overloaded, ProxyError
from trajstore.proxy.lineages import PromptContexts, Turn
from trajstore.proxy.metrics import ProxyMetrics
from trajstore.proxy.outcomes import Outcomes
from trajstore.proxy.recorder import RequestRecorder, new_request_id
from trajstore.proxy.sessions import Session
from trajstore.proxy.settings import ProxySettings
from trajstore.proxy.streamed_turn import StreamedTurn
from trajstore.proxy.streaming import JsonAnswer, RelayResponse
from trajstore.proxy.switching import VersionSwitches, continuation_body
from trajstore.proxy.tracing import TurnTracer
from trajstore.proxy.transport import EngineUnreachable, TransportError
from trajstore.proxy.wire import ENGINE_PATHS, Api, engine_body, extract, parse_body
from trajstore.store import BadEvent, EventWriter

__all__ = ["Answered", "Forwarder"]

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
        #: How calls ended, recorded and counted (`proxy.outcomes`).
        self.outcomes = Outcomes(engines, metrics)
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
        call = Call(api, session, body, chat, asked, translation, headers, dropped, images)
        # An engine lost before anything reached the agent (unreachable, its relay gone, its
        # whole answer broken off) leaves a recorded failure, and the request goes to another
        # engine as a new request of the session; once the agent got a stream's head, a break
        # is the agent's to handle (its stream ends with an error event).
        tried: list[Engine] = []
        failure: ProxyError | None = None
        while len(tried) < ATTEMPTS:
            try:
                engine = self.engines.choose(session.session_id, exclude=tried)
            except NoHealthyEngine as exc:
                if failure is not None:
                    raise failure from None
                raise Overloaded(str(exc), retry_after=2.0) from None
            tried.append(engine)
            try:
                return await self._attempt(call, engine)
            except EngineLost as lost:
                failure = lost.error
                log.info("%s; trying another engine", lost.error)
        assert failure is not None
        raise failure

    async def _attempt(self, call: Call, engine: Engine) -> Answered:
        """Record the request as sent to `engine`, send it, answer the agent; raise
        `EngineLost` (recorded) when the engine is lost before the agent got anything."""
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
            self.outcomes.count(api, 503)
            raise Overloaded(message, retry_after=2.0)
        self.metrics.requests_started.labels(api=api).inc()
        engine_api: Api = "completions" if api == "completions" else "chat"
        if engine_api == "chat":
            recorder.plan = await self._plan(engine, session.session_id, chat, recorder)
        sent = engine_body(engine_api, chat, recorder.plan.token_ids)
        segment = await self._send(call, engine, sent, recorder)
        if bool(chat.get("stream")):
            turn = StreamedTurn(call, segment, recorder, reply, sent, self.outcomes, self._resume)
            return await turn.answer()
        return await self._complete(api, segment, recorder, reply, call, sent)

    async def _send(
        self,
        call: Call,
        engine: Engine,
        body: dict[str, Any],
        recorder: RequestRecorder,
        *,
        resuming: bool = False,
    ) -> Segment:
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
                raise EngineLost(EngineFailed(f"the engine at {engine.url}: {exc}")) from None
            raise await self.outcomes.engine_failure(call.api, engine, recorder, exc) from None
        generation.close = answer.close
        if generation.cut.is_set():
            generation.cut_now()  # the switch began while the request was on its way
        return Segment(engine, answer, generation, release, self.switches.unregister)

    async def _resume(
        self, call: Call, cut: Segment, recorder: RequestRecorder, body: dict[str, Any]
    ) -> Segment | None:
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
            except EngineLost as lost:
                try:
                    if len(tried) >= ATTEMPTS:
                        raise NoHealthyEngine(str(lost.error)) from None
                    engine = self.engines.choose(call.session.session_id, exclude=tried)
                except NoHealthyEngine:
                    await recorder.failed("engine_unreachable", f"no engine continues it: {lost}")
                    self.outcomes.count(call.api, 502)
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
        segment: Segment,
        recorder: RequestRecorder,
        reply: Reply,
        call: Call,
        body: dict[str, Any],
    ) -> Answered:
        while True:
            try:
                status, raw = segment.answer.status, await segment.answer.read()
            except BaseException as exc:
                segment.close()
                if not segment.generation.was_cut or isinstance(exc, asyncio.CancelledError):
                    raise await self.outcomes.engine_failure(
                        api, segment.engine, recorder, exc
                    ) from None
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
            return await self.outcomes.engine_refusal(api, recorder, status, raw, reply)
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await recorder.failed("bad_engine_response", "the engine answered invalid JSON", status)
            self.outcomes.count(api, 502)
            raise EngineFailed("the engine answered invalid JSON") from None
        extracted = extract(api, data)
        recorder.record(extracted)
        await recorder.finished(extracted.usage)
        self.outcomes.observe(api, recorder, extracted.usage)
        return JsonAnswer(reply.answer(data), headers=reply.headers)

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

    def _headers(self, extra: dict[str, str] | None) -> dict[str, str]:
        headers = {"Content-Type": _JSON, **(extra or {})}
        if self.settings.engine_api_key:
            headers["Authorization"] = f"Bearer {self.settings.engine_api_key}"
        return headers
