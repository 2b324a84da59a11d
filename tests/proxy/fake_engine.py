"""An in-process fake of vLLM 0.32's OpenAI server, for the proxy's tests and benchmark.

The response shapes copy the captures in docs/engine-vllm-cpu.md (key order included); the
completions *stream* was not captured, so its shape follows vLLM's serving code.

Tokenisation is fake but keeps the property the recorder relies on:

- ``word_id(w)``: a word ``t<N>`` with 5 <= N < 500 is id N (the inverse of the detokeniser,
  which renders id N as ``"t<N> "``); any other word is ``5 + crc32(w) % 495``.
- a chat message is ``[1 <|im_start|>, word_id(role), 203 "\\n", *word_ids(content),
  2 <|im_end|>, 203]``; the prompt is the messages followed by ``[1, word_id("assistant"), 203]``.
- a completions prompt that is a list of ints is used as-is; a string is ``word_ids(prompt)``.
- ``/tokenize`` renders chat messages the same way (the generation prompt only when asked), and
  a chat request's ``kv_transfer_params.prompt_token_ids`` is used as its prompt, as vLLM does
  (``ignore_token_prompts=True``: an engine that renders the messages anyway;
  ``rewrite_replies=True``: a template that is not append-only, see ``chat_prompt_ids``).
- generated ids lie in [5, 500); eos is id 2 with text ``<|im_end|>`` and no content.
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

So, as with vLLM, when the assistant reply is replayed unchanged turn k+1's prompt starts with
turn k's prompt + completion ids: a reply cut by ``length`` is followed by the template's
``[2, 203]``, a reply ending with eos 2 by ``203``.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import io
import random
import re
import time
import uuid
import zlib
from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

import numpy as np
import orjson
from aiohttp import web

IM_START, EOS, NEWLINE = 1, 2, 203
#: Qwen2-VL's <|vision_start|>, <|vision_end|> and <|image_pad|> (its config's image_token_id).
VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
MAX_MODEL_LEN = 2048
FINGERPRINT = "vllm-0.32.0-fake"
FAULTS = frozenset({"error-400", "error-500", "slow", "stall-mid-stream", "drop-mid-stream"})
# What an instant-mode answer is cached by, besides the api and include_usage.
_SHAPE = ("stream", "n", "max_tokens", "return_token_ids", "logprobs", "top_logprobs")
_WORD_ID = re.compile(r"t(\d+)")

# vLLM's fields beyond OpenAI's, null here as in the captures; a proxy must pass them through.
_MESSAGE_NULLS = dict.fromkeys(["refusal", "annotations", "audio", "function_call", "reasoning"])
_TAIL_NULLS = dict.fromkeys(["kv_transfer_params", "ec_transfer_params", "metrics"])
_USAGE_NULLS = dict.fromkeys(["prompt_tokens_details", "completion_tokens_details"])

JSON = dict[str, Any]
Payload = bytes | list[bytes]  # a whole JSON body, or the SSE lines of a stream


def word_id(word: str) -> int:
    """The fake token id of one whitespace-separated word (see the module docstring)."""
    m = _WORD_ID.fullmatch(word)
    if m and 5 <= int(m[1]) < 500:
        return int(m[1])
    return 5 + zlib.crc32(word.encode()) % 495


def token_text(tid: int) -> str:
    """The text of a generated token, as it appears in logprobs."""
    return "<|im_end|>" if tid == EOS else f"t{tid} "


def _content(tid: int) -> str:
    # vLLM skips special tokens in the text, so eos adds nothing to the content.
    return "" if tid == EOS else token_text(tid)


def image_token_count(url: str) -> int:
    """How many placeholder ids the fake VLM gives the image at `url`: 4 to 8, by its text."""
    return 4 + zlib.crc32(url.encode()) % 5


def _image_ids(part: JSON) -> list[int]:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    return [VISION_START, *[IMAGE_PAD] * image_token_count(str(url)), VISION_END]


def chat_prompt_ids(
    messages: list[JSON],
    generation: bool = True,
    *,
    rewrite_replies: bool = False,
    vision: bool = False,
) -> list[int]:
    """The prompt ids of a chat request: ChatML framing around word ids.

    `rewrite_replies`: a template that is not append-only, as thinking models' are: an earlier
    assistant message is rendered with a word the engine never sampled at its start.
    `vision`: image parts become their placeholder ids (the module docstring).
    """
    ids: list[int] = []
    for m in messages:
        content = m.get("content")
        if vision and isinstance(content, list):
            ids += [IM_START, word_id(str(m.get("role", ""))), NEWLINE]
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_url":
                    ids += _image_ids(p)
                elif isinstance(p, dict):
                    ids += map(word_id, str(p.get("text", "")).split())
            ids += [EOS, NEWLINE]
            continue
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        words = str(content or "").split()
        if m.get("tool_calls"):  # so that tool-call turns tokenise to something distinct
            words += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode().split()
        ids += [IM_START, word_id(str(m.get("role", ""))), NEWLINE]
        if rewrite_replies and m.get("role") == "assistant":
            words.insert(0, "(earlier)")
        ids += [*map(word_id, words), EOS, NEWLINE]
    return [*ids, IM_START, word_id("assistant"), NEWLINE] if generation else ids


def completion_prompt_ids(prompt: Any) -> list[int]:
    """The prompt ids of a completions request: token ids as-is, text by word ids."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):  # a batch of prompts: the fake answers the first only
        prompt = prompt[0] if prompt else ""
    return [word_id(w) for w in str(prompt).split()]


def _error(status: int, message: str) -> web.Response:
    """vLLM's error answer: the status, and the same code inside the JSON."""
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    err = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(err), content_type="application/json")


def expert_ids(
    ids: list[int], start: int, layers: int, top_k: int, n_experts: int
) -> np.ndarray[Any, Any]:
    """The fake's routing of positions start.. of `ids` (all but the last): row p, layer l has
    the top_k consecutive experts from (7 * ids[p] + 3 * l) mod n_experts."""
    rows = np.asarray(ids[start : max(len(ids) - 1, start)], np.int64)
    base = (7 * rows[:, None] + 3 * np.arange(layers)[None, :]) % n_experts
    experts = (base[:, :, None] + np.arange(top_k)[None, None, :]) % n_experts
    return experts.astype(np.uint8 if n_experts <= 256 else np.uint16).reshape(
        len(rows), layers, top_k
    )


def _encoded(array: np.ndarray[Any, Any]) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _sse(obj: JSON) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def version_logprob(version: str) -> float:
    """The logprob a versioned fake engine gives every token it generates on `version`."""
    return -1.0 - int(version)


def _logprob(tid: int, pos: int) -> float:
    # In [-5, 0), the same for the same token at the same position.
    return -5.0 + 5.0 * random.Random(tid * 7919 + pos).random()


def _top(tid: int, lp: float, k: int) -> list[tuple[str, float]]:
    # The sampled token first, then k-1 distinct, less likely alternatives.
    alts = [(5 + (tid - 5 + 7 * j) % 495, lp - 0.5 * j) for j in range(1, k)]
    return [(token_text(t), v) for t, v in [(tid, lp), *alts][:k]]


def _chat_logprobs(ids: list[int], pos: int, k: int) -> JSON:
    """Chat's ``logprobs`` for tokens starting at position ``pos``, top_logprobs=k."""

    def entry(token: str, lp: float) -> JSON:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    content = []
    for j, tid in enumerate(ids):
        lp = _logprob(tid, pos + j)
        top = [entry(s, v) for s, v in _top(tid, lp, k)]
        content.append(entry(token_text(tid), lp) | {"top_logprobs": top})
    return {"content": content}


def _completion_logprobs(ids: list[int], pos: int, offset: int, k: int) -> JSON:
    """Completions' ``logprobs``; ``offset`` is the text length before these tokens."""
    lps = [_logprob(tid, pos + j) for j, tid in enumerate(ids)]
    offsets = [offset + sum(len(_content(t)) for t in ids[:j]) for j in range(len(ids))]
    return {
        "text_offset": offsets,
        "token_logprobs": lps,
        "tokens": [token_text(t) for t in ids],
        "top_logprobs": [dict(_top(t, lp, k)) for t, lp in zip(ids, lps, strict=True)],
    }


def _tool_call(function: JSON, ids: list[int]) -> JSON:
    """A call of `function["name"]` with its `arguments` (an object, or its text as is), or when
    None with arguments that follow from the sampled ids (spaced as vLLM's are)."""
    arguments = function.get("arguments")
    if arguments is None:
        arguments = {"a": ids[0] % 10, "b": ids[-1] % 10}
    if isinstance(arguments, str):
        text = arguments
    else:
        text = orjson.dumps(arguments).decode().replace('":', '": ')
    function = {"name": function.get("name"), "arguments": text}
    return {"id": f"chatcmpl-tool-{ids[0]}", "type": "function", "function": function}


def _tool_call_delta(call: JSON, j: int) -> JSON:
    """Token j's delta of a streamed call: the call's name, then its arguments in two pieces."""
    arguments = call["function"]["arguments"]
    half = len(arguments) // 2
    if j == 0:
        first = {"name": call["function"]["name"], "arguments": ""}
        return {
            "tool_calls": [{"index": 0, "id": call["id"], "type": "function", "function": first}]
        }
    if j in (1, 2):
        piece = arguments[:half] if j == 1 else arguments[half:]
        return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
    return {}


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
        return _sse(data)

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
        """The answer as JSON bytes, or as the SSE lines of a stream."""
        chat = api == "chat"
        token_prompt = (body.get("kv_transfer_params") or {}).get("prompt_token_ids")
        if chat and token_prompt is not None and not self.ignore_token_prompts:
            prompt = list(token_prompt)
        elif chat:
            prompt = chat_prompt_ids(
                body.get("messages") or [], rewrite_replies=self.rewrite_replies, vision=self.vision
            )
        else:
            prompt = completion_prompt_ids(body.get("prompt"))
        n = int(body.get("n") or 1)
        choices = [self._generate(prompt, body, i) for i in range(n)]
        rti = bool(body.get("return_token_ids"))
        # Chat asks with logprobs=true + top_logprobs=k, completions with logprobs=k.
        if chat:
            k = int(body.get("top_logprobs") or 0) if body.get("logprobs") else None
        else:
            k = None if body.get("logprobs") is None else max(int(body["logprobs"]), 1)

        def logprobs(ids: list[int], pos: int = 0, count: int | None = None) -> JSON | None:
            """The logprobs of ids[pos:pos+count] (all by default), or None if not asked."""
            if k is None:
                return None
            part = ids[pos:] if count is None else ids[pos : pos + count]
            if chat:
                return _chat_logprobs(part, pos, k)
            return _completion_logprobs(part, pos, sum(len(_content(t)) for t in ids[:pos]), k)

        call = None
        function = self._function_to_call(body) if chat else None
        if function is not None:
            choices = [(ids, "tool_calls") for ids, _ in choices]
            call = _tool_call(function, choices[0][0])
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:16]
        obj = ("chat.completion" + (".chunk" if stream else "")) if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time())}
        head["model"] = body.get("model") or self.model_name
        p, done = len(prompt), sum(len(ids) for ids, _ in choices)
        usage = {"prompt_tokens": p, "total_tokens": p + done, "completion_tokens": done}
        prompt_ids = prompt if rti else None
        routed: list[str | None] = [None] * n
        if self.routed_experts is not None:
            start = int(body.get("routed_experts_prompt_start") or 0)
            routed = [
                _encoded(expert_ids(prompt + ids, start, *self.routed_experts))
                for ids, _ in choices
            ]

        if not stream:
            out: list[JSON] = []
            for i, (choice_ids, finish) in enumerate(choices):
                text = "".join(map(_content, choice_ids))
                c: JSON = {"index": i}
                if chat and call is not None:
                    c["message"] = {"role": "assistant", "content": None, **_MESSAGE_NULLS}
                    c["message"]["tool_calls"] = [call]
                elif chat:
                    c["message"] = {"role": "assistant", "content": text, **_MESSAGE_NULLS}
                else:
                    c["text"] = text
                c |= {"logprobs": logprobs(choice_ids), "finish_reason": finish}
                c |= {"stop_reason": None, "token_ids": choice_ids if rti else None}
                if not chat:
                    c |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
                out.append(c | {"routed_experts": routed[i]})
            full: JSON = {**head, "choices": out, "service_tier": None}
            full |= {"system_fingerprint": FINGERPRINT, "usage": usage | _USAGE_NULLS}
            if chat:
                full |= {"prompt_logprobs": None, "prompt_token_ids": prompt_ids}
                full["prompt_text"] = None
            return orjson.dumps(full | _TAIL_NULLS)

        lines: list[bytes] = []
        if chat:  # one role chunk per choice, carrying the prompt ids
            for i in range(n):
                delta = {"role": "assistant", "content": ""}
                role = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
                chunk: JSON = {**head, "choices": [role]}
                if rti:
                    chunk |= {"prompt_token_ids": prompt, "prompt_text": None}
                lines.append(_sse(chunk))
        # One token per chunk, the choices interleaved, as vLLM's n=2 capture shows.
        for j in range(max(len(ids) for ids, _ in choices)):
            for i, (choice_ids, finish) in enumerate(choices):
                if j >= len(choice_ids):
                    continue
                tid, last = choice_ids[j], j == len(choice_ids) - 1
                ch: JSON = {"index": i}
                if call is not None:
                    ch["delta"] = _tool_call_delta(call, j)
                elif chat:  # eos shows as an empty delta that still has its token id
                    ch["delta"] = {"content": _content(tid)} if tid != EOS else {}
                else:
                    ch["text"] = _content(tid)
                ch["logprobs"] = logprobs(choice_ids, j, 1)
                ch["finish_reason"] = finish if last else None
                if last:
                    ch["stop_reason"] = None
                    if routed[i] is not None:
                        ch["routed_experts"] = routed[i]
                if rti:
                    ch["token_ids"] = [tid]
                    if not chat and j == 0:  # completions: prompt ids in each choice's first chunk
                        ch["prompt_token_ids"] = prompt
                chunk = {**head, "choices": [ch]}
                if last and not include_usage:  # captured: otherwise it is on the usage chunk
                    chunk["system_fingerprint"] = FINGERPRINT
                lines.append(_sse(chunk))
        if include_usage:
            usage_chunk = {**head, "choices": [], "usage": usage}
            lines.append(_sse(usage_chunk | {"system_fingerprint": FINGERPRINT}))
        return [*lines, b"data: [DONE]\n\n"]


async def serve_forever(engine: FakeEngine, port: int) -> None:
    """Serve `engine` on `port` until the process ends (the benchmarks' engine process). It
    keeps only the last request it saw: a benchmark's hundred thousand would fill memory."""
    engine.requests = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.requests_headers = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.tokenized = collections.deque(maxlen=1)  # type: ignore[assignment]
    engine.detokenized = collections.deque(maxlen=1)  # type: ignore[assignment]
    await engine.start(port=port)
    await asyncio.Event().wait()
