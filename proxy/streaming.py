"""A streamed answer on its way to the agent: each read of the engine's stream parsed, recorded and
relayed at once, and the agent watched for hanging up.

A stream is where the proxy's CPU goes: a 64-token answer is 67 server-sent events, and whatever
the proxy does per event it does 67 times (docs/performance.md, "Proxy overhead"). So the work is
done per *read* of the engine's answer, not per event: the events that one read brought are
parsed by one `orjson.loads` (as one JSON array), recorded by one `record()` (their tokens merged,
`wire.extract_stream`), and sent to the agent in one write. Events still pass through as they
arrive: nothing waits for a later read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from trajstore.proxy.apis import StreamTranslation
from trajstore.proxy.errors import EngineFailed, ProxyError
from trajstore.proxy.recorder import RequestRecorder
from trajstore.proxy.switching import Generation, clean_point
from trajstore.proxy.wire import Api, Asked, extract_stream

#: Writes a piece of the answer's body to the agent.
Write = Callable[[bytes], Awaitable[None]]

_DONE = b"[DONE]"


def sse(data: dict[str, Any]) -> bytes:
    """One server-sent event of JSON data."""
    return b"data: " + orjson.dumps(data) + b"\n\n"


def raw_headers(headers: dict[str, str], content_type: bytes) -> list[tuple[bytes, bytes]]:
    """An answer's headers as ASGI sends them."""
    return [(b"content-type", content_type)] + [
        (name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()
    ]


class JsonAnswer:
    """A whole JSON answer, sent straight over ASGI (two messages, nothing else per request)."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, body: bytes, status: int = 200, headers: dict[str, str] | None = None):
        self.body = body
        self.status = status
        self.headers = raw_headers(headers or {}, b"application/json")
        self.headers.append((b"content-length", b"%d" % len(body)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


class RelayResponse:
    """A streamed answer that notices the agent leaving even while the engine is silent.

    `relay(write)` writes the body. It runs in the request's own task; a watcher task waits for
    the agent's disconnect and cancels it, so the relay records the abort and closes the engine
    connection (which makes vLLM stop generating). `on_close` runs whatever happened, also when
    the relay never started.
    """

    def __init__(
        self,
        relay: Callable[[Write], Awaitable[None]],
        on_close: Callable[[], Awaitable[None]],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.relay = relay
        self.on_close = on_close
        self.headers = raw_headers(headers or {}, b"text/event-stream; charset=utf-8")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        left = False

        async def agent_left() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            task.cancel()

        async def write(body: bytes) -> None:
            await send({"type": "http.response.body", "body": body, "more_body": True})

        watcher = asyncio.ensure_future(agent_left())
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.headers})
            await self.relay(write)
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not left:
                raise  # the server stops
            task.uncancel()  # the agent left: nobody to answer, and nothing failed here
        except OSError:
            pass  # the connection broke under a write: the agent is gone
        finally:
            watcher.cancel()
            await self.on_close()


class StreamRelay:
    """One stream's events, a read at a time: record what they carry, give back what the agent
    asked for (the engine's events less what the proxy added, or the agent's API's events)."""

    def __init__(
        self,
        api: Api,
        recorder: RequestRecorder,
        asked: Asked,
        translator: StreamTranslation | None = None,
    ) -> None:
        """`asked`: what the agent asked for itself; `translator`: its API's, if translated."""
        self.api: Api = "completions" if api == "completions" else "chat"  # what the engine speaks
        self.recorder = recorder
        self.asked = asked
        self.translator = translator
        # When the agent asked for everything the proxy adds, events pass through unchanged.
        self.verbatim = asked.token_ids and asked.logprobs and asked.usage
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.engine_error: str | None = None  # an error event the engine sent mid-stream
        self._pending = b""  # an event cut by the end of a read
        #: The engine request being relayed, kept told where a weight switch may cut it.
        self.generation: Generation | None = None
        self.first_chunk: dict[str, Any] | None = None  #: the answer's first event (its id)

    def read(self, data: bytes) -> bytes:
        """The bytes to send the agent for what one read brought (b"" for none yet).

        Raises `orjson.JSONDecodeError` when an event is not JSON.
        """
        if self._pending:
            data = self._pending + data
        *events, self._pending = data.split(b"\n\n")
        payloads = []
        for event in events:
            if event[:6] != b"data: ":  # the form every engine sends, checked first
                event = event.strip()
                if not event.startswith(b"data:"):
                    continue  # comments, keep-alives
                event = b"data: " + event[5:].strip()
            payload = event[6:]
            if payload.startswith(_DONE):  # no JSON value starts so
                self.done = True
                break
            payloads.append(payload)
        out = self._relayed(payloads) if payloads else b""
        if self.done:
            out += b"data: [DONE]\n\n" if self.translator is None else self.translator.end()
        return out

    def _relayed(self, payloads: list[bytes]) -> bytes:
        chunks = orjson.loads(b"[" + b",".join(payloads) + b"]")
        extracted = extract_stream(self.api, chunks)
        self.recorder.record(extracted)
        if self.first_chunk is None:
            self.first_chunk = {k: chunks[0].get(k) for k in ("id", "created") if k in chunks[0]}
        if (generation := self.generation) is not None:
            generation.clean = clean_point(self.api, chunks, generation.clean)
            generation.tokens = self.recorder.tokens_of(0)
            generation.finishing = generation.finishing or any(
                c.finish_reason for c in extracted.choices if c.index == 0
            )
        self.usage = extracted.usage or self.usage
        if self.translator is not None:
            return b"".join([self._translated(chunk) for chunk in chunks])
        if self.verbatim:
            for chunk in chunks:
                if "error" in chunk and "choices" not in chunk:
                    self._engine_error(chunk)
            return b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n"
        out = []
        asked = self.asked
        for chunk, payload in zip(chunks, payloads, strict=True):
            if "error" in chunk and "choices" not in chunk:
                self._engine_error(chunk)
                out.append(payload)
                continue
            if not asked.usage and "usage" in chunk:
                if not chunk.get("choices") and chunk["usage"]:
                    continue  # the usage chunk the proxy asked for, not the agent
                del chunk["usage"]
            if not asked.token_ids:
                chunk.pop("prompt_token_ids", None)
            for choice in chunk.get("choices") or ():
                if not asked.token_ids:
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
                if not asked.logprobs and "logprobs" in choice:
                    choice["logprobs"] = None
            out.append(orjson.dumps(chunk))
        return b"data: " + b"\n\ndata: ".join(out) + b"\n\n" if out else b""

    def _translated(self, chunk: dict[str, Any]) -> bytes:
        assert self.translator is not None
        if "error" in chunk and "choices" not in chunk:
            return self.translator.error(EngineFailed(self._engine_error(chunk)))
        return self.translator.chunk(chunk)

    def _engine_error(self, chunk: dict[str, Any]) -> str:
        """Note an error event of the engine's (recorded once the read is relayed)."""
        self.engine_error = str((chunk["error"] or {}).get("message"))
        return self.engine_error

    def error(self, error: ProxyError) -> bytes:
        """The event that tells the agent its stream failed, in its API's shape."""
        return sse(error.body()) if self.translator is None else self.translator.error(error)
