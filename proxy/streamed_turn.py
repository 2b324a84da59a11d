"""A streamed turn relayed to the agent across its engine requests: the engine's stream read by
read (`proxy.streaming`), a weight switch's cut continued in the same answer (`proxy.switching`),
and every way it can end recorded: whole, broken off, the agent gone, a bug of ours.

Once the agent got the stream's head, a failure is told in the stream (an error event), not by
a status: the agent's client handles it as the end of its stream.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson

from trajstore.proxy.attempts import Call, Reply, Segment
from trajstore.proxy.errors import EngineFailed, ProxyError, from_bug
from trajstore.proxy.outcomes import Outcomes
from trajstore.proxy.recorder import RequestRecorder
from trajstore.proxy.streaming import JsonAnswer, RelayResponse, StreamRelay, Write
from trajstore.proxy.switching import Stitcher
from trajstore.proxy.transport import AnswerBroken

log = logging.getLogger(__name__)

#: Continues a turn a switch cut: the next engine request, or None when nothing is left.
Resume = Callable[[Call, Segment, RequestRecorder, dict[str, Any]], Awaitable[Segment | None]]


@dataclass
class StreamedTurn:
    """One streamed turn, from the engine request now streaming to the agent's answer."""

    call: Call
    segment: Segment  #: the engine request now streaming (a switch may continue it)
    recorder: RequestRecorder
    reply: Reply
    body: dict[str, Any]  #: what the turn's first engine request was sent
    outcomes: Outcomes
    resume: Resume  #: continues the turn after a switch cut it (from `body`)
    _closed: bool = False

    async def answer(self) -> JsonAnswer | RelayResponse:
        """The agent's answer: the engine's refusal whole, or the stream, relayed as it comes."""
        segment, recorder, outcomes, api = self.segment, self.recorder, self.outcomes, self.call.api
        if segment.answer.status != 200:
            try:
                raw = await segment.answer.read()
            except BaseException as exc:
                segment.answer.close()
                raise await outcomes.engine_failure(api, segment.engine, recorder, exc) from None
            finally:
                segment.close()
            status = segment.answer.status
            return await outcomes.engine_refusal(api, recorder, status, raw, self.reply)
        return RelayResponse(self.relay, on_close=self.close, headers=self.reply.headers)

    async def close(self) -> None:
        """The answer is over, however it ended: the engine request closed, its end recorded."""
        if self._closed:
            return
        self._closed = True
        self.segment.answer.close()  # the engine stops generating (vLLM aborts: client left)
        self.segment.close()
        if not self.recorder.ended:
            await self.recorder.failed("client_disconnected", "the agent left before the stream")

    async def relay(self, write: Write) -> None:
        """Write the answer to the agent, recording it, until it ends."""
        # Events are relayed as they arrive, but everything that arrived in one read is parsed,
        # recorded and written to the agent at once (`proxy.streaming`).
        call, recorder, reply, outcomes = self.call, self.recorder, self.reply, self.outcomes
        api = call.api
        translation = reply.translation
        translator = (
            None if translation is None else translation.stream(reply.body, reply.request_id)
        )
        relay = StreamRelay(api, recorder, reply.asked, translator)
        stitcher: Stitcher | None = None
        while True:
            segment = self.segment
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
                outcomes.count(api, 499)
                raise
            except (AnswerBroken, TimeoutError, orjson.JSONDecodeError) as exc:
                if not segment.generation.was_cut:
                    await self._broke_off(relay, write, exc)
                    return
            except Exception as exc:
                # A bug of ours, mid-stream: the status line is sent, so the agent learns of it
                # in the stream, and the log keeps the failure instead of a silently cut one.
                log.exception("relaying a stream failed")
                await recorder.failed("proxy_error", f"{type(exc).__name__}: {exc}")
                outcomes.count(api, 500)
                await write(relay.error(from_bug(exc)))
                return
            segment.close()
            if relay.done or not segment.generation.was_cut:
                break
            # A weight switch cut it: the rest comes from the new version, in the same answer.
            stitcher = Stitcher(relay.first_chunk, len(recorder.prompt_ids or ()),
                                recorder.tokens_of(0))  # fmt: skip
            try:
                resumed = await self.resume(call, segment, recorder, self.body)
            except (ProxyError, TimeoutError) as exc:
                await self._broke_off(relay, write, exc)
                return
            if resumed is None:  # cut at its last token: the turn is whole
                relay.done = True
                await write(relay.read(b"data: [DONE]\n\n"))
                break
            self.segment = resumed
        if relay.done and not recorder.ended:
            await recorder.finished(relay.usage)
            outcomes.observe(api, recorder, relay.usage)
        elif not relay.done:
            await recorder.failed("engine_error", "the engine closed the stream before [DONE]")
            outcomes.count(api, 502)
            failure = EngineFailed("the engine closed the stream before it was complete")
            await write(relay.error(failure))

    async def _broke_off(self, relay: StreamRelay, write: Write, exc: BaseException) -> None:
        """The engine's stream broke off (or could not be continued after a switch): record
        it, and end the agent's stream with an error event."""
        reason = "engine_timeout" if isinstance(exc, TimeoutError) else "engine_error"
        message = f"the engine stream broke off: {type(exc).__name__}: {exc}"
        if isinstance(exc, AnswerBroken):
            # The connection broke (an engine killed mid-stream): the session's next
            # requests go elsewhere unless the engine still answers its health check.
            self.outcomes.engines.suspect(self.segment.engine, message)
        await self.recorder.failed(reason, message)
        self.outcomes.count(self.call.api, 502)
        await write(relay.error(EngineFailed(message)))
