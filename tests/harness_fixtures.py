"""Request sequences of real agent CLIs, and their replay through a proxy session.

Each fixture in tests/fixtures/harnesses/ is what one pinned CLI (Codex, Claude Code, opencode,
Qwen Code, mini-swe-agent, smolagents) sent through a trajstore session while it worked on one
small task: NAME.jsonl.gz against the tool-calling fake engine, NAME.vllm.jsonl.gz against the
real vLLM (`python benchmarks/agents.py --save-fixtures tests/fixtures/harnesses`; docs/agents.md
says what each sequence holds). A file
is gzipped JSON lines: a header (`harness`, `package`, `version`, `api`, `task`, `exit`), then
one line per HTTP request, in arrival order:

    seq, t, done          its rank, and seconds from the run's start at arrival and at its end
    method, path, api     e.g. POST /v1/messages?beta=true, api "messages"; api is None for a
                          request that is no model call (Claude Code's HEAD /api/hello)
    status, headers       the proxy's answer, the CLI's headers (no keys)
    body                  the JSON body exactly as the CLI sent it
    recorded              what the proxy recorded for it: status, prompt_token_ids,
                          completion_token_ids, finish_reason, message (the engine's answer in
                          chat's shape), prompt_source, continuation

`ReplayEngine` answers each model call with the completion the original run recorded (its ids
and its tool call), so the proxy returns the replies the CLI saw, and the later bodies, which
carry those replies back, meet the same replies again, as they did live. `replay` sends a
fixture's bodies in order through a session.
"""

from __future__ import annotations

import gzip
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.proxy.fake_engine import FakeEngine

FIXTURES = Path(__file__).parent / "fixtures" / "harnesses"
#: The model calls the proxy records as turns (Anthropic's count_tokens is answered, not one).
TURN_APIS = frozenset({"chat", "completions", "messages", "responses"})

JSON = dict[str, Any]


@dataclass
class Fixture:
    """One CLI's requests, in arrival order, with what was recorded for each."""

    name: str
    header: JSON
    calls: list[JSON]

    @property
    def model_calls(self) -> list[JSON]:
        """The requests that became turns."""
        return [c for c in self.calls if c["api"] in TURN_APIS]


def fixture_names() -> list[str]:
    """The fixtures: `NAME` for a harness on the tool-calling fake engine, `NAME.vllm` on the
    real vLLM (the tiny model's random text ends most CLIs after one call)."""
    return sorted(p.name.removesuffix(".jsonl.gz") for p in FIXTURES.glob("*.jsonl.gz"))


def load_fixture(name: str) -> Fixture:
    """Read tests/fixtures/harnesses/NAME.jsonl.gz (NAME as `fixture_names` gives it)."""
    lines = gzip.decompress((FIXTURES / f"{name}.jsonl.gz").read_bytes()).splitlines()
    header, *calls = (orjson.loads(line) for line in lines if line)
    return Fixture(name, header, calls)


class ReplayEngine(FakeEngine):
    """The fake engine, answering each chat request with the next recorded completion (`expect`
    queues it): the same ids, and the same tool call when it made one."""

    def __init__(self, **options: Any) -> None:
        super().__init__(call_tools=True, max_model_len=131_072, **options)
        self.expected: deque[JSON] = deque()
        self._answer: JSON | None = None

    def expect(self, recorded: JSON) -> None:
        """Answer the next chat request as `recorded` (a fixture call's `recorded`)."""
        self.expected.append(recorded)

    def _render(self, api: str, body: JSON) -> Any:
        self._answer = self.expected.popleft() if api == "chat" and self.expected else None
        return super()._render(api, body)

    def _generate(self, prompt: list[int], body: JSON, index: int) -> tuple[list[int], str]:
        if self._answer is None or index != 0:
            return super()._generate(prompt, body, index)
        ids = list(self._answer["completion_token_ids"])
        return ids, str(self._answer.get("finish_reason") or "stop")

    def _function_to_call(self, body: JSON) -> JSON | None:
        if self._answer is None:
            return super()._function_to_call(body)
        calls = (self._answer.get("message") or {}).get("tool_calls") or []
        if not (calls and body.get("tools")):
            return None
        function = calls[0]["function"]  # its arguments as the engine wrote them, JSON or not
        return {"name": function["name"], "arguments": function["arguments"]}


@dataclass
class Replayed:
    """A call as replayed: the fixture's line and the proxy's answer."""

    call: JSON
    status: int
    body: bytes


async def send(http: httpx.AsyncClient, session: JSON, call: JSON, body: Any = None) -> Replayed:
    """Send one fixture call (its method, path, headers and body, or `body`) through `session`
    (as `POST /sessions` returned it) and read the answer whole."""
    base = session["base_url"].removesuffix("/v1")
    headers = {**call["headers"], "authorization": f"Bearer {session['api_key']}"}
    content = orjson.dumps(call["body"] if body is None else body)
    async with http.stream(call["method"], base + call["path"], content=content,
                           headers=headers) as answer:  # fmt: skip
        return Replayed(call, answer.status_code, await answer.aread())


async def replay(
    fixture: Fixture, session: JSON, engine: ReplayEngine, http: httpx.AsyncClient
) -> list[Replayed]:
    """Send the fixture's model calls (count_tokens included) in order through `session`, each
    answered by `engine` as recorded; each answer is read whole before the next call. Requests
    that are no model call are left out."""
    done = []
    for call in fixture.calls:
        if call["api"] is None:
            continue
        recorded = call.get("recorded")
        if call["api"] in TURN_APIS and recorded and recorded.get("completion_token_ids"):
            engine.expect(recorded)
        done.append(await send(http, session, call))
    return done
