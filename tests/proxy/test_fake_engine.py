"""The fake vLLM engine answers in the shapes captured from vLLM 0.32 (docs/engine-vllm-cpu.md)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import EOS, chat_prompt_ids
from tests.support import eventually

MSGS = [{"role": "user", "content": "What is 3 plus 4?"}]


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine() as fake:
        yield fake


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, engine: FakeEngine, path: str, **body: Any
) -> tuple[int, Any]:
    """POST a JSON body to the fake; the status and the decoded JSON answer."""
    async with http.post(f"{engine.url}/v1/{path}", json={"model": "tiny", **body}) as r:
        return r.status, await r.json()


async def sse(http: aiohttp.ClientSession, engine: FakeEngine, **body: Any) -> list[str]:
    """A streamed chat answer as its `data:` payloads, checking the SSE framing on the way."""
    url = f"{engine.url}/v1/chat/completions"
    async with http.post(url, json={"model": "tiny", "stream": True, **body}) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = (await r.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event ends with a blank line
    assert all(e.startswith("data: ") for e in events[:-1])
    return [e.removeprefix("data: ") for e in events[:-1]]


async def test_chat_with_token_ids_and_logprobs(
    engine: FakeEngine, http: aiohttp.ClientSession
) -> None:
    status, body = await post(
        http,
        engine,
        "chat/completions",
        messages=MSGS,
        max_tokens=8,
        logprobs=True,
        top_logprobs=2,
        return_token_ids=True,
    )
    assert status == 200
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["prompt_token_ids"] == chat_prompt_ids(MSGS)
    assert "kv_transfer_params" in body and body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    ids = choice["token_ids"]
    assert len(ids) == 8 and choice["finish_reason"] == "length"
    assert choice["message"]["content"] == "".join(f"t{t} " for t in ids)
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"t{t} " for t in ids]
    for e in content:
        assert -5 <= e["logprob"] < 0 and e["bytes"] == list(e["token"].encode())
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
    assert body["usage"]["prompt_tokens"] == len(body["prompt_token_ids"])
    assert body["usage"]["total_tokens"] == len(body["prompt_token_ids"]) + 8
    # Without the flags: null fields, as vLLM sends them, and the same ids (deterministic).
    _, plain = await post(http, engine, "chat/completions", messages=MSGS, max_tokens=8)
    assert plain["prompt_token_ids"] is None and plain["choices"][0]["token_ids"] is None
    assert plain["choices"][0]["logprobs"] is None
    assert plain["choices"][0]["message"]["content"] == choice["message"]["content"]
    assert engine.requests[0]["top_logprobs"] == 2 and engine.in_flight == 0


async def test_streaming_chat_chunks(engine: FakeEngine, http: aiohttp.ClientSession) -> None:
    events = await sse(
        http,
        engine,
        messages=MSGS,
        max_tokens=5,
        logprobs=True,
        return_token_ids=True,
        stream_options={"include_usage": True},
    )
    assert events[-1] == "[DONE]"
    role, *tokens, usage = [orjson.loads(e) for e in events[:-1]]
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert role["prompt_token_ids"] == chat_prompt_ids(MSGS)
    assert len(tokens) == 5 and len({c["id"] for c in [role, *tokens, usage]}) == 1
    for k, chunk in enumerate(tokens):
        assert chunk["object"] == "chat.completion.chunk" and "prompt_token_ids" not in chunk
        (c,) = chunk["choices"]
        assert len(c["token_ids"]) == 1 and c["delta"]["content"] == f"t{c['token_ids'][0]} "
        assert len(c["logprobs"]["content"]) == 1
        assert c["finish_reason"] == ("length" if k == 4 else None)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    # Without the flags no token id field appears in any chunk.
    plain = await sse(http, engine, messages=MSGS, max_tokens=3)
    assert not any("token_ids" in e for e in plain) and plain[-1] == "[DONE]"


async def test_eos_ends_with_an_empty_delta(http: aiohttp.ClientSession) -> None:
    async with FakeEngine(completion_tokens=3) as engine:
        events = await sse(http, engine, messages=MSGS, max_tokens=16, return_token_ids=True)
    *_, last = [orjson.loads(e) for e in events[:-1]]
    (c,) = last["choices"]
    assert c["token_ids"] == [EOS] and c["delta"] == {} and c["finish_reason"] == "stop"


async def test_completions_with_a_token_id_prompt(
    engine: FakeEngine, http: aiohttp.ClientSession
) -> None:
    prompt = [1, 443, 203, 17, 2]
    status, body = await post(
        http,
        engine,
        "completions",
        prompt=prompt,
        max_tokens=4,
        logprobs=2,
        return_token_ids=True,
    )
    assert status == 200 and body["id"].startswith("cmpl-")
    assert body["object"] == "text_completion"
    (c,) = body["choices"]
    assert c["prompt_token_ids"] == prompt and len(c["token_ids"]) == 4
    assert c["text"] == "".join(c["logprobs"]["tokens"])
    tokens = c["logprobs"]["tokens"]
    assert c["logprobs"]["text_offset"] == [len("".join(tokens[:i])) for i in range(4)]
    assert [next(iter(d)) for d in c["logprobs"]["top_logprobs"]] == c["logprobs"]["tokens"]
    assert all(len(d) == 2 for d in c["logprobs"]["top_logprobs"])
    assert body["usage"] == {
        "prompt_tokens": 5,
        "total_tokens": 9,
        "completion_tokens": 4,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


async def test_n_2_gives_independent_choices(
    engine: FakeEngine, http: aiohttp.ClientSession
) -> None:
    _, body = await post(
        http, engine, "chat/completions", messages=MSGS, max_tokens=4, n=2, return_token_ids=True
    )
    first, second = body["choices"]
    assert (first["index"], second["index"]) == (0, 1)
    assert first["token_ids"] != second["token_ids"]
    assert body["usage"]["completion_tokens"] == 8
    events = await sse(http, engine, messages=MSGS, max_tokens=2, n=2, return_token_ids=True)
    indices = [orjson.loads(e)["choices"][0]["index"] for e in events[:-1]]
    assert indices == [0, 1, 0, 1, 0, 1]  # a role chunk per choice, then interleaved tokens


@pytest.mark.parametrize("completion_tokens", [None, 3])  # cut by length, ended by eos
async def test_next_turn_prompt_extends_previous_prompt_and_completion(
    http: aiohttp.ClientSession, completion_tokens: int | None
) -> None:
    async with FakeEngine(completion_tokens=completion_tokens) as engine:
        kw: dict[str, Any] = {"max_tokens": 6, "return_token_ids": True}
        _, t1 = await post(http, engine, "chat/completions", messages=MSGS, **kw)
        reply = t1["choices"][0]["message"]["content"]
        turn2 = [*MSGS, {"role": "assistant", "content": reply}, {"role": "user", "content": "x2"}]
        _, t2 = await post(http, engine, "chat/completions", messages=turn2, **kw)
    want = t1["prompt_token_ids"] + t1["choices"][0]["token_ids"]
    assert t2["prompt_token_ids"][: len(want)] == want
    assert t2["prompt_token_ids"][len(want)] == (203 if completion_tokens else EOS)


async def test_error_400_shape(engine: FakeEngine, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, engine, "chat/completions", messages=MSGS, model="error-400")
    assert status == 400
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == 400 and body["error"]["type"] == "BadRequestError"


async def test_mid_stream_faults(engine: FakeEngine, http: aiohttp.ClientSession) -> None:
    url, body = f"{engine.url}/v1/chat/completions", {"messages": MSGS, "stream": True}
    headers = {"X-Fake-Fault": "drop-mid-stream"}
    async with http.post(url, json=body, headers=headers) as r:
        with pytest.raises(aiohttp.ClientPayloadError):
            await r.read()
    headers = {"X-Fake-Fault": "stall-mid-stream"}
    async with http.post(url, json=body, headers=headers) as r:
        first = await r.content.readuntil(b"\n\n")  # the half that was sent
        assert first.startswith(b"data: ") and engine.disconnects == []
    # Leaving the block without reading on closes the connection: the fake sees it go.
    await eventually(lambda: engine.disconnects == [orjson.loads(first[6:])["id"]])


async def test_instant_mode_serves_cached_chunks(http: aiohttp.ClientSession) -> None:
    async with FakeEngine(instant=True) as engine:
        a = await sse(http, engine, messages=MSGS, max_tokens=64)
        b = await sse(http, engine, messages=[{"role": "user", "content": "other"}], max_tokens=64)
    assert a == b and len(a) == 1 + 64 + 1  # role chunk, 64 token chunks, [DONE]
