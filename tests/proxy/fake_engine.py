"""An in-process fake of vLLM 0.32's OpenAI server, for the proxy's tests and benchmark.

Its tokeniser is `fake_tokens` (the ids a test compares with, importable from here too); its
answers, shaped as the captures in docs/engine-vllm-cpu.md, are `fake_answers`'. Its options:

- ``/tokenize`` renders chat messages as the tokeniser does (the generation prompt only when
  asked), and a chat request's ``kv_transfer_params.prompt_token_ids`` is its prompt, as in vLLM
  (``ignore_token_prompts=True``: an engine that renders the messages anyway;
  ``rewrite_replies=True``: a template that is not append-only, see ``chat_prompt_ids``).
- ``vision=True``: a vision-language model's prompt, as vLLM reports it for Qwen2-VL: each
  ``image_url`` part becomes ``<|vision_start|>``, ``<|image_pad|>`` repeated
  ``image_token_count(url)`` times (vLLM: once per image feature, from the image's size), and
  ``<|vision_end|>``, with Qwen2-VL's ids. Without it, image parts add nothing, as before.
- ``model_root``: the path ``/v1/models`` reports as the model's ``root`` (vLLM: the directory
  it loaded; default the model name), e.g. a generated tiny model whose tokenizer a reader loads.
- ``routed_experts=(layers, top_k, n_experts)``: as vLLM with ``--enable-return-routed-experts``
  (its ``ChatCompletionResponseChoice`` / ``CompletionResponseChoice.routed_experts``), each
  choice of a whole answer carries ``routed_experts``: base64 of an ``.npy`` array (uint8 up to
  256 experts, as vLLM narrows) of shape (prompt + completion - 1 - routed_experts_prompt_start,
  layers, top_k), row p routing position p (``expert_ids``); vLLM 0.32 streams none, the fake
  puts it on each choice's last stream chunk, so that the proxy's streaming path is exercised.
- ``detokenize=True``: ``POST /detokenize`` answers ``{"model"?, "tokens": [...]}`` with
  ``{"prompt": text}``, as vLLM does, each id rendered by ``token_text``; without it, a 404.

- ``versioned=True``: weights that change (a weight switch's tests). ``version`` is the policy
  the engine serves, a number as text; ``POST /collective_rpc`` with ``reload_weights`` loads
  the version its ``weights_path`` ends with (``.../v3``: "3"; ``fail_reload=True``: a 500),
  ``/pause`` and ``/resume`` answer as vLLM's dev endpoints do. Every generated token's logprob
  says which version wrote it to the stream (``version_logprob``, at the moment it is written,
  as a real engine's weights produce each token then), so a test reads the truth back from the
  record. A client leaving aborts the request (``handler_cancellation``), as vLLM does.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
import zlib
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

import orjson
from aiohttp import web

from tests.proxy.fake_answers import Payload, render, sse_event
from tests.proxy.fake_tokens import (
    EOS,
    chat_prompt_ids,
    token_text,
    version_logprob,
)

MAX_MODEL_LEN = 2048
FAULTS = frozenset({"error-400", "error-500", "slow", "stall-mid-stream", "drop-mid-stream"})
# What an instant-mode answer is cached by, besides the api and include_usage.
_SHAPE = ("stream", "n", "max_tokens", "return_token_ids", "logprobs", "top_logprobs")

JSON = dict[str, Any]


def _error(status: int, message: str) -> web.Response:
    """vLLM's error answer: the status, and the same code inside the JSON."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    err = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(err), content_type="application/json")


class FakeEngine:
    """A fake vLLM OpenAI server on aiohttp.web with deterministic output and fault injection.

    ``fault`` (or per request the ``model`` name or an ``X-Fake-Fault`` header) is one of
    FAULTS. ``instant=True`` serves bytes cached per request shape, to benchmark the proxy.
    """

    def __init__(
        self,
        *,
        model_name: str = "tiny",
        completion_tokens: int | None = None,
        finish_with_eos: bool = True,
        token_delay: float = 0.0,
        delay: float = 1.0,
        fault: str | None = None,
        instant: bool = False,
        ignore_token_prompts: bool = False,
        rewrite_replies: bool = False,
        call_tools: bool = False,
        vision: bool = False,
        model_root: str | None = None,
        detokenize: bool = False,
        max_model_len: int = MAX_MODEL_LEN,
        tool_policy: Callable[[JSON], JSON | None] | None = None,
        versioned: bool = False,
        fail_reload: bool = False,
        routed_experts: tuple[int, int, int] | None = None,
    ) -> None:
        self.model_name = model_name
        self.versioned = versioned
        self.version = "0"
        self.fail_reload = fail_reload
        self.reloads: list[str] = []  # weights_path of each reload
        self.routed_experts = routed_experts  # (layers, top_k, n_experts): see the docstring
        self.completion_tokens = completion_tokens  # caps max_tokens; below it the answer stops
        self.finish_with_eos = finish_with_eos
        self.token_delay = token_delay
        self.delay = delay
        self.fault = fault
        self.instant = instant
        self.ignore_token_prompts = ignore_token_prompts
        self.rewrite_replies = rewrite_replies  # see chat_prompt_ids
        # With tools in a chat request, answer with a call of the first tool, as vLLM's tool
        # parser gives it: no content, the call streamed as its name then its arguments in
        # pieces, finish_reason tool_calls.
        self.call_tools = call_tools
        # With call_tools: given the chat request, the function to call ({"name", "arguments"}),
        # or None for a text answer; unset, the first tool with made-up arguments. Real agent
        # CLIs (benchmarks/agents.py) need calls their tools accept, and an end.
        self.tool_policy = tool_policy
        # Only reported (/v1/models, /tokenize): real agent CLIs size their context by it.
        self.max_model_len = max_model_len
        self.vision = vision  # image parts become placeholder ids (see chat_prompt_ids)
        self.model_root = model_root  # /v1/models' root (see the module docstring)
        self.detokenize = detokenize
        self.tokenized: list[JSON] = []  # the /tokenize requests
        self.detokenized: list[JSON] = []  # the /detokenize requests
        self.healthy = True
        self.url = ""
        self.requests: list[JSON] = []
        self.requests_headers: list[dict[str, str]] = []
        self.disconnects: list[str] = []  # response ids whose client went away mid-answer
        self.in_flight = 0
        self._cache: dict[tuple[object, ...], Payload] = {}
        self._runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen and return the base URL (``http://host:port``, without ``/v1``)."""
        app = web.Application(client_max_size=256 << 20)  # vLLM takes 200 k-token prompts
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", partial(self._serve, api="chat"))
        app.router.add_post("/v1/completions", partial(self._serve, api="completions"))
        app.router.add_post("/tokenize", self._tokenize)
        if self.versioned:
            app.router.add_post("/collective_rpc", self._collective_rpc)
            app.router.add_post("/pause", self._paused)
            app.router.add_post("/resume", self._paused)
        if self.detokenize:
            app.router.add_post("/detokenize", self._detokenize)
        # Cancel handlers when the client leaves, as vLLM aborts the request.
        self._runner = web.AppRunner(
            app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        bound_host, bound_port = self._runner.addresses[0][:2]
        self.url = f"http://{bound_host}:{bound_port}"
        return self.url

    async def stop(self) -> None:
        """Close the listener and every open connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeEngine:
        await self.start()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": int(time.time())}
        card |= {"owned_by": "vllm", "root": self.model_root or self.model_name, "parent": None}
        card |= {"max_model_len": self.max_model_len, "permission": []}
        return web.json_response({"object": "list", "data": [card]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body: JSON = orjson.loads(await request.read())
        self.tokenized.append(body)
        generation = body.get("add_generation_prompt", True)
        ids = chat_prompt_ids(
            body["messages"], generation, rewrite_replies=self.rewrite_replies, vision=self.vision
        )
        answer = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _detokenize(self, request: web.Request) -> web.Response:
        body: JSON = orjson.loads(await request.read())
        self.detokenized.append(body)
        answer = {"prompt": "".join(map(token_text, body["tokens"]))}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        path = str((body.get("kwargs") or {}).get("weights_path", ""))
        self.reloads.append(path)
        if self.fail_reload:
            return _error(500, f"fake engine: cannot load {path}")
        self.version = path.rstrip("/").rsplit("/v", 1)[-1]
        return web.json_response({"results": [None]})

    async def _paused(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _stamped(self, chunk: bytes) -> bytes:
        """A stream chunk whose tokens' logprobs say the version serving now."""
        if not chunk.startswith(b"data: {"):
            return chunk
        data = orjson.loads(chunk[6:])
        value = version_logprob(self.version)
        for choice in data.get("choices") or ():
            logprobs = choice.get("logprobs")
            if not logprobs or not choice.get("token_ids"):
                continue
            if "content" in logprobs:
                for entry in logprobs["content"]:
                    entry["logprob"] = value
            else:
                logprobs["token_logprobs"] = [value] * len(logprobs["token_logprobs"])
        return sse_event(data)

    async def _serve(self, request: web.Request, api: str) -> web.StreamResponse:
        body: JSON = orjson.loads(await request.read())
        self.requests.append(body)
        self.requests_headers.append(dict(request.headers))
        self.in_flight += 1
        try:
            fault = request.headers.get("X-Fake-Fault") or (
                body.get("model") if body.get("model") in FAULTS else self.fault
            )
            if fault in ("error-400", "error-500"):
                status = int(fault[-3:])
                return _error(status, f"fake engine fault {fault}")
            if fault == "slow":
                await asyncio.sleep(self.delay)
            opts = body.get("stream_options") or {}
            key = (api, *(body.get(f) for f in _SHAPE), opts.get("include_usage"))
            payload = self._cache.get(key) if self.instant else None
            if payload is None:
                payload = self._render(api, body)
                if self.instant:
                    self._cache[key] = payload
            if isinstance(payload, bytes):
                payload = [payload]  # faults below treat a whole answer as one chunk
                if fault not in ("stall-mid-stream", "drop-mid-stream"):
                    whole = payload[0]
                    if self.versioned:  # generated in the time a stream takes, then stamped
                        n = int(orjson.loads(whole)["usage"]["completion_tokens"])
                        await asyncio.sleep(self.token_delay * n)
                        whole = self._stamped(b"data: " + whole)[6:].strip()
                    return web.Response(body=whole, content_type="application/json")
                return await self._write(request, payload, fault, web.StreamResponse())
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            return await self._write(request, payload, fault, resp)
        finally:
            self.in_flight -= 1

    async def _write(
        self, request: web.Request, chunks: list[bytes], fault: str | None, resp: web.StreamResponse
    ) -> web.StreamResponse:
        """Send the chunks, honouring token_delay and the mid-stream faults."""
        half = len(chunks) // 2
        try:
            for k, chunk in enumerate(chunks):
                if k == half and fault == "drop-mid-stream":
                    # Closing the socket ends the chunked body without its terminator.
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                if k == half and fault == "stall-mid-stream":
                    # Hang: handler_cancellation cancels us when the client goes (or at stop()).
                    await asyncio.Event().wait()
                if not resp.prepared:  # lazily, so a whole-answer fault precedes the headers
                    await resp.prepare(request)
                await resp.write(self._stamped(chunk) if self.versioned else chunk)
                if self.token_delay:
                    await asyncio.sleep(self.token_delay)
            await resp.write_eof()
        except asyncio.CancelledError:
            self.disconnects.append(self._rid(chunks))
            raise
        except ConnectionResetError:
            self.disconnects.append(self._rid(chunks))
        return resp

    @staticmethod
    def _rid(chunks: list[bytes]) -> str:
        first = chunks[0].removeprefix(b"data: ")
        return str(orjson.loads(first).get("id", ""))

    def _generate(self, prompt: list[int], body: JSON, index: int) -> tuple[list[int], str]:
        """One choice's ids and finish reason, a function of the prompt, seed and index."""
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        length = min(max_tokens, self.completion_tokens or max_tokens)
        rng = random.Random(zlib.crc32(orjson.dumps([prompt, body.get("seed"), index])))
        ids = [rng.randrange(5, 500) for _ in range(length)]
        if length == max_tokens:
            return ids, "length"
        if self.finish_with_eos:
            ids[-1] = EOS
        return ids, "stop"

    def _function_to_call(self, body: JSON) -> JSON | None:
        """The function a chat answer calls (`tool_policy`), or None for a text answer."""
        if not (self.call_tools and body.get("tools")):
            return None
        if self.tool_policy is not None:
            return self.tool_policy(body)
        first: JSON = body["tools"][0].get("function") or {}
        return {"name": first.get("name"), "arguments": None}

    def _render(self, api: str, body: JSON) -> Payload:
        """The answer as JSON bytes, or as the SSE lines of a stream (`fake_answers.render`)."""
        return render(self, api, body)


async def serve_forever(engine: FakeEngine, port: int) -> None:
    """Serve `engine` on `port` until the process ends (the benchmarks' engine process). It
    keeps only the last request it saw: a benchmark's hundred thousand would fill memory."""
    engine.requests = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.requests_headers = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.tokenized = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.detokenized = collections.deque(maxlen=1)  # type: ignore[assignment]
    await engine.start(port=port)
    await asyncio.Event().wait()
