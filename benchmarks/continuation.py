"""What token-in continuation costs a turn, against the same turn rendered from text, same run;
and what its check costs as a conversation grows, the sampled audit against rendering the whole
conversation every turn.

    python benchmarks/continuation.py [--quick] [--context-tokens 16000] [--sessions 40]
                                      [--runs 3] [--vllm] [--lengths 16,64,128]

Two `trajstore proxy` processes record into scratch databases in front of one engine: one with
TRAJSTORE_CONTINUATION=tokens, one with `text`. Both take the same agent turns: a session's first
turn carries N tokens of earlier context (rendered by the engine either way), its second turn
sends back the reply and a tool result, which the first proxy continues from the sampled ids
(its `/tokenize` calls included) and the second leaves to the engine's rendering. The second
turns of all sessions go one after another (one agent at a time), and the proxy's CPU time over
them (/proc, utime + stime) divided by their count is its CPU per turn; their latency is taken
at the client. Runs alternate which proxy goes first, so both meet the same machine.

The engine is the fake engine (tests/proxy/fake_engine.py: it answers at once, and renders and
tokenises a ChatML template for real, one id per word), or with `--vllm` the real vLLM (CPU) on
the generated tiny model, whose 2,048-token window caps the context (250 words). The run fails
when a second turn of the `tokens` proxy was not continued.

The check at length (`continuation_at_length.py`): one lineage of 16, 64 and 128 turns (about
1,600 tokens of tool output a turn: 25 k, 100 k and 200 k tokens), its next turn continued by the
proxy's own `Continuer` in this process, again and again: the engine's `/tokenize` time per turn
and this process's CPU per turn, with the whole conversation rendered every turn (the check as it
was) against the sampled audit (every 16th continued turn).

The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import aiohttp
import orjson
import uvloop
from continuation_at_length import long_engine, report_lengths
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from overhead_report import print_sequential
from proxy_overhead import ROOT, Server, Servers, cpu_seconds, start_vllm

from trajstore.client import AsyncClient, SessionInfo
from trajstore.store.embedded import database_url

ENGINE_MAIN = """
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

# Ends its turns with eos, as a model does.
uvloop.run(serve_forever(FakeEngine(completion_tokens=16), int(sys.argv[2])))
"""


PROMPT_TOKENS: list[int] = []  # the engine's count, per turn


def first_messages(tokens: int, session: int) -> list[dict[str, str]]:
    """An agent deep into an episode: about `tokens` tokens of earlier tool output (about four
    characters a token, one fake-engine id a word), then the question."""
    words = " ".join(f"r{(session * 7 + i) % 997:03d}" for i in range(tokens))
    return [
        {"role": "system", "content": "You are a careful coding agent."},
        {"role": "tool", "content": words},
        {"role": "user", "content": f"Fix test {session} in tests/test_io.py."},
    ]


async def turn(
    http: aiohttp.ClientSession, session: SessionInfo, messages: list[dict[str, str]], k: int
) -> tuple[dict[str, object], float]:
    """One chat turn as an agent sends it; the reply to send back, and the latency."""
    body = {
        "model": "tiny", "messages": messages, "max_tokens": 48, "temperature": 1.0, "seed": k,
        # The tiny random model ends a turn with <|im_end|>, as a model does, after at least 16
        # tokens (an agent's turns are longer than the few tokens the bias alone would leave).
        "logit_bias": {"2": 5}, "min_tokens": 16,
    }  # fmt: skip
    headers = {"Authorization": f"Bearer {session.api_key}"}
    started = time.perf_counter()
    async with http.post(
        session.base_url + "/chat/completions", data=orjson.dumps(body), headers=headers
    ) as resp:
        raw = await resp.read()
    latency = time.perf_counter() - started
    if resp.status != 200:
        raise RuntimeError(f"the proxy answered {resp.status}: {raw[:300]!r}")
    answer = orjson.loads(raw)
    PROMPT_TOKENS.append(answer["usage"]["prompt_tokens"])
    return {"role": "assistant", "content": answer["choices"][0]["message"]["content"]}, latency


async def measure(
    http: aiohttp.ClientSession, proxy: Server, n: int, tokens: int, run: int
) -> tuple[float, list[float]]:
    """CPU seconds per second turn, and the second turns' latencies, for `n` sessions."""
    sessions: list[SessionInfo] = []
    histories = []
    for i in range(n):
        async with AsyncClient(proxy.url) as client:
            sessions.append((await client.create_session(f"r{run}")).info)
        messages = first_messages(tokens, i)
        reply, _ = await turn(http, sessions[-1], messages, i)
        histories.append([*messages, reply, {"role": "tool", "content": "1 passed"}])
    await asyncio.sleep(0.5)  # the first turns' events written: not charged to the second
    before = cpu_seconds([proxy.process.pid])
    latencies = []
    for i, (session, messages) in enumerate(zip(sessions, histories, strict=True)):
        latencies.append((await turn(http, session, messages, i))[1])
    cpu = cpu_seconds([proxy.process.pid]) - before
    return cpu / n, latencies


async def render_time(http: aiohttp.ClientSession, engine: Server, messages: list[Any]) -> float:
    """Seconds the engine takes to render and tokenise `messages` (`/tokenize`), client side:
    what a continued turn waits for before it is sent."""
    body = orjson.dumps({"model": "tiny", "messages": messages, "add_generation_prompt": True})
    started = time.perf_counter()
    async with http.post(engine.url + "/tokenize", data=body) as resp:
        await resp.read()
    return time.perf_counter() - started


async def continued_turns(http: aiohttp.ClientSession, proxy: Server) -> float:
    async with http.get(proxy.url + "/metrics") as resp:
        text = await resp.text()
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("trajstore_chat_prompts_total") and 'source="continued"' in line
    )


async def main(args: argparse.Namespace) -> int:
    dbs = Databases(await asyncio.to_thread(database_url))
    servers = Servers()
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        await dbs.setup()
        python = sys.executable
        if args.vllm:
            engine = await asyncio.to_thread(start_vllm, servers)
        else:
            engine = servers.start("engine", [python, "-c", ENGINE_MAIN, str(ROOT), "{port}"])
        await servers.wait_ready(engine, http, "/health")
        proxies = {}
        for mode in ("tokens", "text"):
            env = {**os.environ, "TRAJSTORE_DATABASE_URL": await dbs.fresh()}
            env["TRAJSTORE_CONTINUATION"] = mode
            argv = [python, "-m", "trajstore", "proxy", "--engine", engine.url, "--port", "{port}"]
            proxies[mode] = servers.start(f"trajstore-{mode}", argv, env=env)
        for proxy in proxies.values():
            await servers.wait_ready(proxy, http, "/health")

        cpu: dict[str, list[float]] = {mode: [] for mode in proxies}
        latency: dict[str, list[float]] = {mode: [] for mode in proxies}
        await measure(http, proxies["tokens"], 2, args.context_tokens, -1)  # warm up
        await measure(http, proxies["text"], 2, args.context_tokens, -1)
        for run in range(args.runs):
            order = ["tokens", "text"] if run % 2 == 0 else ["text", "tokens"]
            for mode in order:
                per_turn, times = await measure(
                    http, proxies[mode], args.sessions, args.context_tokens, run
                )
                cpu[mode].append(per_turn)
                latency[mode] += times
        continued = await continued_turns(http, proxies["tokens"])
        conversation = [*first_messages(args.context_tokens, 0)]
        conversation += [{"role": "assistant", "content": "ok"}, {"role": "tool", "content": "1"}]
        renders = [await render_time(http, engine, conversation) for _ in range(50)]
        expected = args.sessions * args.runs + 2
    finally:
        await http.close()
        servers.stop()
        await dbs.drop_all()

    engine_name = "vLLM (CPU), tiny model" if args.vllm else "fake engine"
    print(f"continuation: {engine_name}, contexts of {args.context_tokens} words "
          f"(second turns' prompts: median {statistics.median(PROMPT_TOKENS[1::2])} tokens), "
          f"{args.sessions} second turns x {args.runs} runs, one at a time")  # fmt: skip
    print_sequential(cpu, latency, ("text", "tokens"), "turn", widths=(10, 30))
    extra_cpu = statistics.median(cpu["tokens"]) - statistics.median(cpu["text"])
    p50 = {mode: statistics.median(latency[mode]) for mode in latency}
    print(f"the engine renders and tokenises a second turn's conversation (/tokenize) in "
          f"{1e3 * statistics.median(renders):.2f} ms p50, client side: a continued turn "
          "waits for that (its renders run concurrently) before it is sent")  # fmt: skip
    added = p50["tokens"] - p50["text"]
    print(f"a continued turn costs the proxy {1e3 * extra_cpu:+.3f} ms CPU (target <= +1 ms) "
          f"and adds {1e3 * added:+.2f} ms = {added / p50['text']:+.1%} to the turn's p50 "
          "(target <= +5%)")  # fmt: skip
    if continued < expected:
        print(f"FAILED: only {continued:g} of {expected} second turns were continued")
        return 1
    return 0


async def at_length(args: argparse.Namespace) -> int:
    """The check's cost as a conversation grows (`continuation_at_length.py`)."""
    servers = Servers()
    try:
        engine = await long_engine(servers, vllm=args.vllm, python=sys.executable)
        return await report_lengths(engine, args.lengths)
    finally:
        servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run, for CI")
    parser.add_argument(
        "--context-tokens", type=int, help="words of context per turn [16000; vllm 250]"
    )
    parser.add_argument("--sessions", type=int, help="second turns per run [40; quick 15]")
    parser.add_argument("--runs", type=int, help="runs per proxy [3; quick 2]")
    parser.add_argument("--vllm", action="store_true", help="against a real vLLM (CPU)")
    parser.add_argument(
        "--lengths", help="turns of the conversations whose check is measured [16,64,128]"
    )
    parser.add_argument(
        "--only", choices=("turns", "length"), help="only one of the two measurements"
    )
    args = parser.parse_args()
    lengths = args.lengths or ("8,16" if args.quick else "16,64,128")
    args.lengths = [int(n) for n in lengths.split(",")]
    args.context_tokens = min(
        args.context_tokens or (250 if args.vllm else 16000), 250 if args.vllm else 10**9
    )
    args.sessions = args.sessions or (15 if args.quick else 40)
    args.runs = args.runs or (2 if args.quick else 3)
    code = 0 if args.only == "length" else uvloop.run(main(args))
    if args.only != "turns":
        code = code or uvloop.run(at_length(args))
    sys.exit(code)
