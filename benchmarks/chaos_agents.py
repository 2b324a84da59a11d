"""The chaos suite's agents: sessions created through the proxy, streamed chat turns read as
they arrive, finishes retried after a 503, and the tokens received compared with the store's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

# benchmarks/ is on sys.path when chaos.py runs as a script
from chaos_world import Result


@dataclass
class Answer:
    """One model call as the agent saw it."""

    status: int | None = None
    tokens: int = 0  # content tokens received (the fake engine sends one per chunk)
    text: str = ""
    done: bool = False
    error: str | None = None
    retry_after: str | None = None
    started: float = 0.0  # time.monotonic()
    ended: float = 0.0


@dataclass
class Agent:
    """A session, as its orchestrator and its agent hold it."""

    sid: str
    key: dict[str, str]  # the agent's Authorization header
    orchestrator: dict[str, str]
    messages: list[dict[str, str]]
    answers: list[Answer] = field(default_factory=list)

    @property
    def received(self) -> int:
        return sum(a.tokens for a in self.answers)

    def went_on(self, answer: Answer) -> None:
        """The next turn continues the conversation after a whole answer (else it retries)."""
        if answer.error is None:
            self.messages = [
                *self.messages,
                {"role": "assistant", "content": answer.text},
                {"role": "user", "content": f"go on ({len(self.answers)})"},
            ]


async def create_agents(http: aiohttp.ClientSession, proxy_url: str, ids: list[str]) -> list[Agent]:
    async def create(sid: str) -> Agent:
        body = {"run_id": "chaos", "session_id": sid}
        async with http.post(f"{proxy_url}/sessions", json=body) as resp:
            if resp.status not in (200, 201):
                raise RuntimeError(f"POST /sessions: {resp.status} {await resp.text()}")
            created = await resp.json()
        return Agent(
            sid,
            {"Authorization": f"Bearer {created['api_key']}"},
            {"Authorization": f"Bearer {created['orchestrator_key']}"},
            [{"role": "user", "content": f"task {sid}: count to a hundred"}],
        )

    return list(await asyncio.gather(*(create(i) for i in ids)))


async def stream_chat(
    http: aiohttp.ClientSession, proxy_url: str, agent: Agent, max_tokens: int, answer: Answer
) -> Answer:
    """One streamed chat turn of `agent` through the proxy at `proxy_url`, read into `answer`
    as it arrives (so that a scenario can watch its progress), and kept in `agent.answers`."""
    agent.answers.append(answer)
    body = {"model": "tiny", "messages": agent.messages, "max_tokens": max_tokens, "stream": True}
    url = f"{proxy_url}/sessions/{agent.sid}/v1/chat/completions"
    answer.started = time.monotonic()
    try:
        async with http.post(url, json=body, headers=agent.key) as resp:
            answer.status = resp.status
            if resp.status != 200:
                answer.retry_after = resp.headers.get("Retry-After")
                answer.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
                return answer
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    answer.done = True
                    continue
                chunk = orjson.loads(data)
                if "error" in chunk:
                    answer.error = f"error in stream: {str(chunk['error'])[:140]}"
                    continue
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        answer.tokens += 1
                        answer.text += content
        if not answer.done and answer.error is None:
            answer.error = "stream ended before [DONE]"
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        answer.error = f"{type(exc).__name__}: {exc}"[:160]
    finally:
        answer.ended = time.monotonic()
    return answer


async def finish(
    http: aiohttp.ClientSession, proxy_url: str, agent: Agent, patience: float = 90.0
) -> tuple[int, int, str]:
    """Finish the session, retrying a 503 after its Retry-After: (status, retries, body)."""
    retries = 0
    deadline = time.monotonic() + patience
    url = f"{proxy_url}/sessions/{agent.sid}/finish"
    while True:
        try:
            async with http.post(
                url, json={"status": "completed"}, headers=agent.orchestrator
            ) as r:
                text = await r.text()
                if r.status == 503 and time.monotonic() < deadline:
                    retries += 1
                    await asyncio.sleep(min(float(r.headers.get("Retry-After") or 1), 5.0))
                    continue
                return r.status, retries, text[:200]
        except (aiohttp.ClientError, TimeoutError) as exc:
            return 0, retries, f"{type(exc).__name__}: {exc}"


async def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:.0f} s for {what}")
        await asyncio.sleep(0.01)


def compare_tokens(result: Result, agents: list[Agent], stored: dict[str, int]) -> None:
    """Per session: every token an agent received is stored, and no more."""
    missing = {a.sid: (a.received, stored.get(a.sid, 0)) for a in agents
               if stored.get(a.sid, 0) < a.received}  # fmt: skip
    extra = {a.sid: (a.received, stored.get(a.sid, 0)) for a in agents
             if stored.get(a.sid, 0) > a.received}  # fmt: skip
    result.figure("tokens received by agents", sum(a.received for a in agents))
    result.figure("tokens stored", sum(stored.get(a.sid, 0) for a in agents))
    result.expect(
        not missing,
        f"tokens received by agents and missing from the store (received, stored): {missing}",
    )
    if extra:
        result.note(f"more tokens stored than the agents received (received, stored): {extra}")
