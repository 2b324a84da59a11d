"""The continuation check as a conversation grows: the whole conversation rendered every turn
(the check as it was) against the sampled audit (`proxy.continuation`), in one run.

Used by benchmarks/continuation.py (`--only length`). One lineage (a system prompt, a task, then
a reply and about `TOKENS_PER_TURN` tokens of tool output a turn) is continued turn after turn by
the proxy's own `Continuer`, in this process, each prompt the one before + its completion + the
new output, as the proxy builds them. At 16, 64 and 128 turns (25 k, 100 k, 200 k tokens): the
engine's `/tokenize` wall time (what the engine's API server spends on checks) and this process's
CPU (building the requests, reading the ids back, comparing, assembling the prompt), each per
continued turn over all turns so far: the audit is sampled, so its cost is what it adds to every
turn on average.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from proxy_overhead import ROOT, Server, Servers, free_port

from trajstore.proxy.continuation import Continuer
from trajstore.proxy.engines import Engine, EnginePool
from trajstore.proxy.lineages import Chain, Ending, Turn, messages_key, render_key
from trajstore.store.tokens import encode_token_ids

TOKENS_PER_TURN = 1_600
AUDIT_EVERY, AUDIT_GROWTH = 16, 0.5  # the proxy's defaults
FAKE_ENGINE = """
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(), int(sys.argv[2])))
"""


async def long_engine(servers: Servers, *, vllm: bool, python: str) -> Server:
    """The fake engine, or a real vLLM (CPU) on the generated tiny model with its context
    raised to 220 k tokens (a copy of its config with `max_position_embeddings` raised)."""
    async with aiohttp.ClientSession() as http:
        if not vllm:
            engine = servers.start("engine", [python, "-c", FAKE_ENGINE, str(ROOT), "{port}"])
            await servers.wait_ready(engine, http, "/health")
            return engine
        from trajstore.tiny_model import build_tiny_model
        from trajstore.vllm_server import VllmServer

        model = build_tiny_model(Path(servers.logs.name) / "model")
        config = json.loads((model / "config.json").read_text())
        config["max_position_embeddings"] = 262_144
        (model / "config.json").write_text(json.dumps(config))
        log = Path(servers.logs.name) / "engine.log"
        server = VllmServer(model, free_port(), log_file=log,
                            extra_args=("--max-model-len", "220000"))  # fmt: skip
        server.start()
        assert server.process is not None
        engine = Server("engine", server.process, server.url, log)
        servers.started.append(engine)
        return engine


def conversation(turns: int, words: int) -> list[dict[str, Any]]:
    """A lineage `turns` turns deep: its history, the last reply, and new tool output."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful coding agent. " * 20},
        {"role": "user", "content": "Fix the failing test in tests/test_io.py."},
    ]
    for turn in range(turns):
        messages.append({"role": "assistant", "content": f"I will run step {turn} now."})
        output = " ".join(f"r{(turn * 31 + i) % 997:03d}" for i in range(words))
        messages.append({"role": "tool", "content": output})
    return messages


class _Timed(Continuer):
    """A `Continuer` that adds up the wall time of its `/tokenize` calls."""

    tokenize_s = 0.0
    renders = 0

    async def _render(self, engine: Engine, body: dict[str, Any], messages: list[Any],
                      *, generation: bool) -> list[int]:  # fmt: skip
        started = time.perf_counter()
        try:
            return await super()._render(engine, body, messages, generation=generation)
        finally:
            self.tokenize_s += time.perf_counter() - started
            self.renders += 1


async def _tokens(http: aiohttp.ClientSession, url: str, messages: list[Any]) -> list[int]:
    body = {"model": "tiny", "messages": messages, "add_generation_prompt": True}
    async with http.post(url + "/tokenize", json=body) as resp:
        answer = await resp.json()
    if resp.status != 200:
        raise RuntimeError(f"/tokenize answered {resp.status}: {str(answer)[:300]}")
    return list(answer["tokens"])


async def grow(
    engine: Engine,
    http: aiohttp.ClientSession,
    words: int,
    lengths: list[int],
    *,
    audit_every: int,
    audit_growth: float,
) -> list[tuple[int, int, float, float]]:
    """Continue one lineage turn by turn up to the longest of `lengths`, as the proxy would
    (each prompt the previous one + its completion + the new tool output); at each length:
    (turns, prompt tokens, CPU s and /tokenize s spent on the checks so far)."""
    continuer = _Timed(audit_every=audit_every, audit_growth=audit_growth)
    messages = conversation(0, words)
    _, reply_end = await continuer._base(engine, {"model": "tiny", "messages": messages})
    prompt = encode_token_ids(await _tokens(http, engine.url, messages))
    reply = {"role": "assistant", "content": "I will run the next step now."}
    sampled = [*(await _tokens(http, engine.url, [reply]))[-8:], reply_end[0]]
    ending = Ending(encode_token_ids(sampled), "stop", None, reply)
    chain: Chain | None = None  # the lineage's audit state, as the proxy keeps it
    rows, cpu = [], 0.0
    for k in range(1, max(lengths) + 1):
        history, serialised = messages, orjson.dumps(messages)
        messages = [*history, reply, conversation(k, words)[-1]]
        body: dict[str, Any] = {"model": "tiny", "messages": messages}
        turn = Turn(f"t{k}", len(prompt) // 4, len(history), len(serialised),
                    messages_key(serialised), render_key(body), (ending,), held_prompt=prompt,
                    chain=chain)  # fmt: skip
        if chain is None:
            chain = turn.chain = Chain(turn, deque([turn]))
        else:
            chain.append(turn)
        started = time.process_time()
        plan = await continuer.plan(engine, body, [turn], turn, _nothing)
        cpu += time.process_time() - started
        if plan.source != "continued":
            raise RuntimeError(f"turn {k} was not continued: {plan.fallback}")
        prompt = plan.packed  # what the engine echoes
        if k in lengths:
            rows.append((k, len(prompt) // 4, cpu, continuer.tokenize_s))
    return rows


async def _nothing() -> None:
    return None


async def report_lengths(engine_server: Server, lengths: list[int]) -> int:
    """Measure and print the check at each length; non-zero when the sampled audit's cost per
    turn grows more than 2x from the shortest to the longest."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
        pool = EnginePool([engine_server.url])
        await pool.start(http)
        try:
            engine = pool.engines[0]
            one = await _tokens(http, engine.url, conversation(1, 100))
            none = await _tokens(http, engine.url, conversation(0, 100))
            words = max(1, int(100 * TOKENS_PER_TURN / max(1, len(one) - len(none))))
            whole = await grow(engine, http, words, lengths, audit_every=1, audit_growth=0)
            sampled = await grow(engine, http, words, lengths, audit_every=AUDIT_EVERY,
                                 audit_growth=AUDIT_GROWTH)  # fmt: skip
        finally:
            await pool.close()
    print(f"\ncontinuation check at length ({engine_server.name} at {engine_server.url}): per "
          f"continued turn, over all of a lineage's turns so far; the whole conversation "
          f"rendered every turn against the sampled audit (every {AUDIT_EVERY} turns once "
          f"grown by {AUDIT_GROWTH:.0%})")  # fmt: skip
    columns = f"{'whole':>9}{'sampled':>10}{'ratio':>9}"
    print(
        f"{'turns':>6}{'tokens':>9}  {'/tokenize ms per turn':^28}  {'proxy CPU ms per turn':^28}"
    )
    print(f"{'':15}  {columns}  {columns}")
    per_turn = []
    for (turns, context, cpu_w, tok_w), (_, _, cpu_s, tok_s) in zip(whole, sampled, strict=True):
        w, s_ = (cpu_w / turns, tok_w / turns), (cpu_s / turns, tok_s / turns)
        per_turn.append(s_)
        print(f"{turns:6d}{context:9d}  {1e3 * w[1]:9.2f}{1e3 * s_[1]:10.2f}{w[1] / s_[1]:8.1f}x"
              f"  {1e3 * w[0]:9.2f}{1e3 * s_[0]:10.2f}{w[0] / s_[0]:8.1f}x")  # fmt: skip
    growth_engine = per_turn[-1][1] / per_turn[0][1]
    growth_cpu = per_turn[-1][0] / per_turn[0][0]
    print(f"from {lengths[0]} to {lengths[-1]} turns the sampled check's cost per turn grows "
          f"{growth_engine:.2f}x in the engine and {growth_cpu:.2f}x in the proxy "
          f"(target <= 2x)")  # fmt: skip
    return 0 if growth_engine <= 2.0 else 1
