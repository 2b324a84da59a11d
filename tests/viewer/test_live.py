"""What a live page and the token text rest on, over real HTTP: the event stream of an active
session, and the strips' text from a tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
from markupsafe import escape

from tests.support import RecordedSession
from trajstore.store import EventStore


async def test_an_active_session_s_stream_says_when_its_log_grows_and_when_it_ends(
    store: EventStore, serve_viewer: Any
) -> None:
    log = RecordedSession(store, "live-1", "run-live")
    await log.created(task_id="t")
    received = {"request_id": "live-1-0", "api": "chat", "body": {}, "sampling": {}}
    await log.turn(received, [1, 2], [3, 4])
    url = await serve_viewer()
    seen: list[str] = []
    async with (
        httpx.AsyncClient(timeout=20) as http,
        http.stream("GET", f"{url}/sessions/live-1/live") as stream,
    ):
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.aiter_lines()

        async def next_event() -> str:
            async for line in lines:
                if line.startswith("event: "):
                    return line.removeprefix("event: ")
            raise AssertionError("the stream ended")

        await log.turn({**received, "request_id": "live-1-1"}, [1, 2, 3, 4, 5], [6])
        seen.append(await asyncio.wait_for(next_event(), 10))
        await log.finished(reward=1.0)
        seen.append(await asyncio.wait_for(next_event(), 10))
        seen.append(await asyncio.wait_for(next_event(), 10))
    assert seen == ["changed", "changed", "finished"]


async def test_with_a_tokenizer_the_strip_shows_each_token_s_text_and_says_whose(
    store: EventStore, serve_viewer: Any, tiny_model: Path
) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    ids = tokenizer.encode("What is 17 plus 25?").ids
    log = RecordedSession(store, "text-1", "run-text")
    await log.created()
    await log.turn({"request_id": "text-1-0", "api": "chat", "body": {}, "sampling": {}}, ids, ids)
    url = await serve_viewer(tokenizer=tiny_model)
    async with httpx.AsyncClient() as http:
        body = (await http.get(f"{url}/sessions/text-1/turns/0")).text
    assert f"text: tokenizer {tiny_model / 'tokenizer.json'}" in body
    pieces = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(pieces) == "What is 17 plus 25?"
    for piece in pieces:
        assert f'title="{escape(repr(piece))} · id' in body  # each token's hover names its text
