"""The long sessions' agents (benchmarks/long_sessions.py runs them): opencode-shaped, a 2,000-word
system prompt and tools, then turn after turn the model's tool call and the tool's output sent back
with the whole conversation, every `SIDE_EVERY`-th call a title call; and the fake engine they talk
to, which answers every request that has tools with a tool call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import aiohttp
import orjson

SYSTEM_WORDS = 2_000
COMPLETION = 8  #: tokens of each tool call the model makes (ending with end-of-turn)
MAX_TOKENS = 2 * COMPLETION  #: asked for: the engine stops before, on its end-of-turn token
SIDE_EVERY = 50  #: every 50th call is a title call: a lineage of its own
ENGINE_MAIN = f"""
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(call_tools=True, completion_tokens={COMPLETION}),
                         int(sys.argv[2])))
"""
PATH = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "read", "description": "Read a file",
                                           "parameters": PATH}}]  # fmt: skip


def tool_output(turn: int) -> str:
    """What the tool sends back after `turn`: 12 words, growing by one every 250 turns."""
    return " ".join(f"out{turn}_{j}" for j in range(12 + turn // 250))


@dataclass
class Tally:
    """What the agents were told (usage), to reconcile with the log."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    calls: int = 0
    longest_prompt: int = 0


class Agent:
    """One opencode-shaped session: its conversation kept serialised, a message appended a turn
    (re-serialising 100 k tokens of history every turn would make the agent the benchmark)."""

    def __init__(self, http: aiohttp.ClientSession, proxy: str, session_id: str, run: str) -> None:
        self.http, self.proxy, self.session_id, self.run = http, proxy, session_id, run
        system = {"role": "system", "content": " ".join(f"sys{j}" for j in range(SYSTEM_WORDS))}
        task = {"role": "user", "content": "The test in tests/test_io.py fails; fix it."}
        self.messages = b"[" + orjson.dumps(system) + b"," + orjson.dumps(task)
        self.head = b'{"model":"tiny","max_tokens":%d,"tools":%s,"messages":' % (
            MAX_TOKENS, orjson.dumps(TOOLS))  # fmt: skip
        self.headers: dict[str, str] = {}
        self.url = ""

    async def run_turns(self, turns: int, tally: Tally) -> None:
        create = {"run_id": self.run, "session_id": self.session_id}
        created = await self._post(f"{self.proxy}/sessions", orjson.dumps(create))
        self.headers = {"Authorization": f"Bearer {created['api_key']}"}
        self.url = created["base_url"] + "/chat/completions"
        started = time.perf_counter()
        for turn in range(turns):
            if turn and turn % 1000 == 0 and self.session_id == "long-0":
                print(f"  {self.session_id}: {turn} turns, {time.perf_counter() - started:.0f} s, "
                      f"prompt {tally.longest_prompt:,} tokens", flush=True)  # fmt: skip
            if turn % SIDE_EVERY == SIDE_EVERY - 1:
                title = [{"role": "user", "content": f"A title for this session, call {turn}"}]
                body = orjson.dumps({"model": "tiny", "max_tokens": MAX_TOKENS, "messages": title})
                self._count(await self._post(self.url, body, self.headers), tally)
                continue
            answer = await self._post(self.url, self.head + self.messages + b"]}", self.headers)
            self._count(answer, tally)
            reply = {k: v for k, v in answer["choices"][0]["message"].items() if v is not None}
            result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"],
                      "content": tool_output(turn)}  # fmt: skip
            self.messages += b"," + orjson.dumps(reply) + b"," + orjson.dumps(result)
        orchestrator = {"Authorization": f"Bearer {created['orchestrator_key']}"}
        finish = f"{self.proxy}/sessions/{self.session_id}/finish"
        await self._post(finish, b'{"status":"completed"}', orchestrator)

    @staticmethod
    def _count(answer: dict[str, object], tally: Tally) -> None:
        usage = answer["usage"]
        assert isinstance(usage, dict)
        tally.prompt_tokens += usage["prompt_tokens"]
        tally.completion_tokens += usage["completion_tokens"]
        tally.longest_prompt = max(tally.longest_prompt, usage["prompt_tokens"])
        tally.calls += 1

    async def _post(self, url: str, body: bytes, headers: dict[str, str] | None = None) -> dict:
        headers = {"Content-Type": "application/json", **(headers or {})}
        async with self.http.post(url, data=body, headers=headers) as resp:
            if resp.status not in (200, 201):
                raise RuntimeError(f"{url}: {resp.status} {(await resp.text())[:500]}")
            answer: dict = await resp.json(loads=orjson.loads)
            return answer
