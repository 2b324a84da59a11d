"""What the weight-switch tests share (`test_switching.py`, `test_switch_failures.py`): the
versioned fake engine's turn length and pace, the admin calls of a switch, the switch events read
back, and the check that a choice's version spans name the version that wrote each token."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import content_text, version_logprob
from tests.proxy.fixtures import RunningProxy
from trajstore.store import EventStore

N = 120  # tokens of each turn
DELAY = 0.01  # seconds per token: a turn streams for about a second


async def switch_events(database_url: str) -> list[Any]:
    """The switches' events in log order: each one's type, its reason (a failure's) and the
    turns it cut (a beginning's `interrupted`)."""
    async with await EventStore.open(database_url) as store:
        return await store.fetch(
            "SELECT event_type, payload ->> 'reason' AS reason, "
            "(payload ->> 'interrupted')::int AS interrupted FROM events "
            "WHERE stream_id LIKE 'switch-%' ORDER BY position"
        )


async def begin(proxy: RunningProxy, version: str, engines: list[str] | None = None) -> str:
    """Begin a switch; return its id once the proxy answered (its engines' turns are cut)."""
    body: dict[str, Any] = {"version": version, "checkpoint": f"/ckpt/v{version}"}
    if engines is not None:
        body["engines"] = engines
    answer = await proxy.http.post(f"{proxy.url}/admin/switches", json=body)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["switch_id"])


async def live(proxy: RunningProxy, switch_id: str) -> None:
    answer = await proxy.http.post(f"{proxy.url}/admin/switches/{switch_id}/live")
    assert answer.status_code == 200, answer.text


async def switch(proxy: RunningProxy, engine: FakeEngine, version: str) -> None:
    """A whole switch of `engine`, as a trainer does it: begin, load, live."""
    switch_id = await begin(proxy, version, [engine.url])
    engine.version = version
    await live(proxy, switch_id)


def exact(choice: dict[str, Any], n: int = N) -> list[str]:
    """Check that the choice has its `n` tokens, and spans that cover them in order and name
    the version that generated each; return the spans' versions."""
    spans = choice["version_spans"]
    assert len(choice["token_ids"]) == n
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n
    for before, after in itertools.pairwise(spans):
        assert before["end"] == after["start"] and before["version"] != after["version"]
    for span in spans:
        wrote = set(choice["logprobs"][span["start"] : span["end"]])
        assert wrote == {version_logprob(span["version"])}, span
    return [span["version"] for span in spans]


def text_of(ids: list[int]) -> str:
    return "".join(content_text(t) for t in ids)


async def streamed_chat(
    proxy: RunningProxy, session: dict[str, Any], after: int, action: Callable[[], Awaitable[None]]
) -> tuple[str, asyncio.Task[None]]:
    """Stream a chat turn of N tokens; `after` tokens in, start `action`. Return the text the
    agent read, and the action's task."""
    agent = proxy.agent(session)
    stream = await agent.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=N, stream=True
    )
    text, started = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
        if started is None and len(text) > after:
            started = asyncio.create_task(action())
    assert started is not None
    await started
    return "".join(text), started
