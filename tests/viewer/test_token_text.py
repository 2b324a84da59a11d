"""Where a strip's text comes from when the viewer is given no tokenizer, over HTTP: the
tokenizer of the model the session's engine reports, else the engine's /detokenize, else ids
(trajstore/viewer/tokens.py). The engine is the fake vLLM of tests/proxy/fake_engine.py."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from markupsafe import escape

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import token_text
from tests.support import RecordedSession
from trajstore.store import EventStore


async def record_turn(store: EventStore, session_id: str, engine: str, ids: list[int]) -> None:
    """A session whose one turn, served by `engine`, has `ids` as its prompt and completion."""
    log = RecordedSession(store, session_id, "run-text")
    await log.created()
    received = {"request_id": f"{session_id}-0", "api": "chat", "body": {}, "sampling": {}}
    await log.turn({**received, "engine": engine}, ids, ids)


def hover_texts(body: str) -> list[tuple[int, str]]:
    """(id, the title's text part) of every token of a turn's strips."""
    found = re.findall(r'data-id="(\d+)"[^>]*title="([^"]*) · id', body)
    return [(int(token), about) for token, about in found]


async def test_without_a_tokenizer_the_strip_uses_the_tokenizer_of_the_engine_s_model(
    store: EventStore, client: httpx.AsyncClient, tiny_model: Path
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode("What is 17 plus 25?").ids
    # It also has /detokenize: the model's own tokenizer comes first.
    async with FakeEngine(model_root=str(tiny_model), detokenize=True) as engine:
        await record_turn(store, "model-1", engine.url, ids)
        body = (await client.get("/sessions/model-1/turns/0")).text
    assert f"text: tokenizer of {tiny_model} (the model {engine.url} serves)" in body
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == "What is 17 plus 25?"
    assert hover_texts(body) == [
        (i, escape(repr(p))) for i, p in zip(ids * 2, pieces * 2, strict=True)
    ]
    assert engine.detokenized == []


async def test_with_an_engine_whose_model_is_not_here_the_strip_uses_its_detokenize(
    store: EventStore, client: httpx.AsyncClient
) -> None:
    ids = [1, 10, 20, 2, 10]  # the fake renders id N as "tN ", eos 2 as <|im_end|>
    async with FakeEngine(detokenize=True) as engine:  # its model's root is the name "tiny"
        await record_turn(store, "detok-1", engine.url, ids)
        body = (await client.get("/sessions/detok-1/turns/0")).text
        again = (await client.get("/sessions/detok-1/turns/0")).text
    assert f'data-source="{engine.url}/detokenize"' in body
    texts = [token_text(i) for i in ids]
    assert texts[:4] == ["t1 ", "t10 ", "t20 ", "<|im_end|>"]
    assert hover_texts(body) == [
        (i, escape(repr(t))) for i, t in zip(ids * 2, texts * 2, strict=True)
    ]
    # One call per distinct id, each alone; a page shown again asks nothing more.
    assert sorted(r["tokens"][0] for r in engine.detokenized) == [1, 2, 10, 20]
    assert all(len(r["tokens"]) == 1 for r in engine.detokenized)
    assert again == body


async def test_with_no_engine_that_can_give_text_the_strip_shows_ids_and_says_so(
    store: EventStore, client: httpx.AsyncClient
) -> None:
    ids = [1, 10, 20, 2]
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    # This one answers, but its model is no directory here and it has no /detokenize.
    async with FakeEngine() as engine:
        await record_turn(store, "ids-1", nowhere, ids)
        await record_turn(store, "ids-2", engine.url, ids)
        for session, url in (("ids-1", nowhere), ("ids-2", engine.url)):
            body = (await client.get(f"/sessions/{session}/turns/0")).text
            assert f'data-source="token ids (the engine {url} did not answer)"' in body
            assert hover_texts(body) == [(i, "(no text)") for i in ids * 2]
            assert ">⟨20⟩</span>" in body
