"""Projection throughput: rebuilding samples from the log, against a raw read of the same events.

    python benchmarks/projection.py [--shape short|agent|both] [--sessions N] [--runs 5]

Records multi-turn sessions as the proxy does (each turn's prompt extends the previous turn's
prompt and completion by a tool result, so every session is one sample, and is stored as a
reference to that turn plus the new tokens; each request's body holds the conversation so far
as text, about four characters per token, stored as a reference to the previous request's
messages plus the new ones; completion chunks of 16 tokens with float32 logprobs), a reward and
a finish each, in one of two shapes:

- short: 4 turns, a 256-token first prompt, 64-token completions, 32-token tool results, 1,000
  sessions: small events, so the per-event and per-session costs decide;
- agent: 16 turns, a 4,096-token first prompt (system prompt, task, files), 256-token completions
  (a thought and a tool call), 1,024-token tool results, 50 sessions: the shape of a
  SWE-agent-style episode, whose context grows to 23 k tokens, so the bytes decide.

Then, on a fresh clone of that database per run:

- trajstore: `Projector.run_once()` from event 0 — read every finished session's events, rebuild
  it, build its samples, write them and the checkpoint;
- raw: the same events read with plain asyncpg SELECTs, as many sessions per query as one
  projector batch reads, token ids and logprobs turned into numpy arrays, nothing built or
  written.

Tokens are the prompt and completion tokens of the events read. The target is trajstore ≥ 0.5×
raw. Prints medians, the ratio, and sessions/s per shape. TRAJSTORE_DATABASE_URL's server, else
the embedded one (it needs the right to create databases).

Then the cost of finding lineages (`benchmarks/lineage_matching.py`): samples built in memory
with lineages against the rule before them, on single-line sessions (target <= 1.1x), forests
(8 lineages, 200 turns) and 2,000 one-call lineages.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import statistics
import time
from dataclasses import dataclass, replace

import asyncpg
import lineage_matching  # benchmarks/, next to this file
import numpy as np
from ingest import Databases  # benchmarks/ingest.py, next to this file

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream
from trajstore.store.connection import connect
from trajstore.store.embedded import database_url
from trajstore.store.projection import Projector

CHUNK = 16
#: Sessions per raw read: what one projector batch (500 facts, 2 per session) reads.
RAW_BATCH = 250


@dataclass(frozen=True)
class Shape:
    """What one session of a shape holds (token counts), and how many sessions it records."""

    turns: int
    first_prompt: int
    completion: int
    tool_result: int
    sessions: int


SHAPES = {
    "short": Shape(turns=4, first_prompt=256, completion=64, tool_result=32, sessions=1000),
    "agent": Shape(turns=16, first_prompt=4096, completion=256, tool_result=1024, sessions=50),
}


#: Words to write messages with: the request bodies hold the conversation as text, about four
#: characters per token, as an agent sends it.
WORDS = np.array(
    ["the", "of", "and", "to", "in", "is", "for", "that", "with", "on", "as", "def", "return"]
)


def text(rng: np.random.Generator, tokens: int) -> str:
    """About `tokens` tokens' worth of text."""
    return " ".join(rng.choice(WORDS, max(1, tokens)))


def prompt_event(
    event: functools.partial[NewEvent], prompt: np.ndarray, previous: tuple[str, int] | None
) -> NewEvent:
    """A turn's prompt as the proxy stores it: whole on the first turn, then as a reference to
    the previous turn's prompt and completion plus the new tokens (`store.sessions`)."""
    if previous is None:
        return event(EventType.PROMPT_TOKENS, payload={"choice": None}, token_ids=prompt)
    request_id, shared = previous
    payload = {
        "choice": None,
        "prefix": {"request_id": request_id, "n_tokens": shared},
        "n_tokens": len(prompt),
    }
    return event(EventType.PROMPT_TOKENS, payload=payload, token_ids=prompt[shared:])


def received_event(
    event: functools.partial[NewEvent],
    request_id: str,
    messages: list[dict[str, str]],
    previous: tuple[str, int] | None,
    sent: int,
) -> NewEvent:
    """A request as the proxy stores it: its body whole on the first turn, then with only the
    messages after the previous request's and a reference to those (`store.sessions`)."""
    payload: dict[str, object] = {
        "request_id": request_id,
        "api": "chat",
        "body": {"model": "m", "messages": messages[sent:], "temperature": 1.0},
        "sampling": {"model": "m", "temperature": 1.0},
        "engine": "http://engine",
        "policy_version": "0",
        "stream": True,
    }
    if previous is not None:
        payload["messages_prefix"] = {"request_id": previous[0], "n_messages": sent}
    return event(EventType.REQUEST_RECEIVED, payload=payload)


async def record(url: str, shape: Shape) -> int:
    """Write the sessions; return how many prompt + completion tokens their events hold."""
    rng = np.random.default_rng(0)
    tokens = 0
    async with await EventStore.open(url) as store:
        writer = store.writer(max_pending=1_000_000)
        await writer.start()
        for s in range(shape.sessions):
            session = f"s{s}"
            event = functools.partial(NewEvent, session_id=session, run_id="bench")
            writer.append_many(
                session_stream(session),
                1,
                [event(EventType.SESSION_CREATED, payload={"task_id": "t"})],
            )
            prompt = rng.integers(5, 150_000, shape.first_prompt, dtype=np.int32)
            previous: tuple[str, int] | None = None
            messages = [{"role": "system", "content": text(rng, shape.first_prompt)}]
            sent = 0  # messages the previous request sent
            for t in range(shape.turns):
                completion = rng.integers(5, 150_000, shape.completion, dtype=np.int32)
                answer = text(rng, shape.completion)
                request_id = f"{session}-{t}"
                events = [
                    received_event(event, request_id, messages, previous, sent),
                    prompt_event(event, prompt, previous),
                ]
                sent = len(messages)
                for c in range(0, shape.completion, CHUNK):
                    events.append(
                        event(
                            EventType.COMPLETION_CHUNK,
                            payload={"choice": 0, "text": "lorem ipsum " * 4},
                            token_ids=completion[c : c + CHUNK],
                            logprobs=-rng.random(CHUNK, dtype=np.float32),
                        )
                    )
                events.append(
                    event(
                        EventType.COMPLETION_FINISHED,
                        payload={
                            "choices": [
                                {
                                    "index": 0,
                                    "finish_reason": "stop",
                                    "message": {"role": "assistant", "content": answer},
                                }
                            ]
                        },
                    )
                )
                writer.append_many(request_stream(request_id), 1, events)
                tokens += len(prompt) + shape.completion
                previous = (request_id, len(prompt) + shape.completion)
                tool_result = rng.integers(5, 150_000, shape.tool_result, dtype=np.int32)
                prompt = np.concatenate([prompt, completion, tool_result])
                messages = [
                    *messages,
                    {"role": "assistant", "content": answer},
                    {"role": "tool", "content": text(rng, shape.tool_result)},
                ]
            writer.append_many(
                session_stream(session),
                2,
                [
                    event(EventType.REWARD_ASSIGNED, payload={"value": float(s % 2)}),
                    event(EventType.SESSION_FINISHED, payload={"status": "completed"}),
                ],
            )
        await writer.flush()
        await writer.close()
    return tokens


async def stored_bytes(url: str) -> int:
    """What the recorded events take on disk: the table, its TOAST and its indexes."""
    conn: asyncpg.Connection = await connect(url)
    try:
        await conn.execute("VACUUM events")  # the free space map and visibility, as in steady use
        return int(await conn.fetchval("SELECT pg_total_relation_size('events')"))
    finally:
        await conn.close()


async def rebuild(url: str) -> float:
    async with await EventStore.open(url) as store:
        started = time.perf_counter()
        await Projector(store).run_once()
        elapsed = time.perf_counter() - started
        assert await store.pool.fetchval("SELECT count(*) FROM samples") > 0
    return elapsed


async def read_raw(url: str, sessions: int) -> float:
    """The same events, read as the projector reads them: many sessions per round trip."""
    conn: asyncpg.Connection = await connect(url)
    try:
        started = time.perf_counter()
        for first in range(0, sessions, RAW_BATCH):
            rows = await conn.fetch(
                "SELECT position, tx_id, event_id, stream_id, stream_version, session_id, run_id,"
                " event_type, recorded_at, payload, token_ids, logprobs FROM events"
                " WHERE session_id = ANY($1::text[]) ORDER BY session_id, tx_id, position",
                [f"s{s}" for s in range(first, min(first + RAW_BATCH, sessions))],
            )
            for row in rows:
                if row["token_ids"] is not None:
                    np.frombuffer(row["token_ids"], "<i4")
                if row["logprobs"] is not None:
                    np.frombuffer(row["logprobs"], "<f4")
        return time.perf_counter() - started
    finally:
        await conn.close()


async def measure(name: str, shape: Shape, runs: int) -> None:
    databases = Databases(database_url())
    await databases.setup()
    try:
        loaded = await databases.fresh()
        tokens = await record(loaded, shape)
        stored = await stored_bytes(loaded)
        databases.template = loaded.partition("?")[0].rpartition("/")[2]  # clone the loaded one
        ours, raw = [], []
        for _ in range(runs):
            gc.collect()
            raw.append(await read_raw(await databases.fresh(), shape.sessions))
            gc.collect()
            ours.append(await rebuild(await databases.fresh()))
    finally:
        await databases.drop_all()
    ours_s, raw_s = statistics.median(ours), statistics.median(raw)
    print(
        f"{name}: {shape.sessions} sessions x {shape.turns} turns, {tokens:,} tokens, "
        f"medians of {runs} runs"
    )
    print(f"{'':24}{'trajstore':>14}{'raw asyncpg':>14}{'ratio':>8}")
    print(
        f"{'rebuild tokens/s':24}{tokens / ours_s:>14,.0f}{tokens / raw_s:>14,.0f}"
        f"{raw_s / ours_s:>7.2f}x"
    )
    print(f"{'sessions/s':24}{shape.sessions / ours_s:>14,.0f}{shape.sessions / raw_s:>14,.0f}")
    context = shape.first_prompt + shape.turns * shape.completion
    context += (shape.turns - 1) * shape.tool_result
    print(
        f"stored: {stored / shape.sessions / 1024:,.1f} KiB per session in the events table "
        f"(indexes and TOAST included): {stored / shape.sessions / context:,.0f} bytes per token "
        f"of a session's final {context:,}-token context (its sample stores 9)"
    )


async def main(shapes: list[str], sessions: int | None, runs: int) -> None:
    for name in shapes:
        shape = SHAPES[name]
        if sessions is not None:
            shape = replace(shape, sessions=sessions)
        await measure(name, shape, runs)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=[*SHAPES, "both"], default="both")
    parser.add_argument("--sessions", type=int, help="instead of the shape's own count")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="fewer sessions for lineage matching")
    args = parser.parse_args()
    chosen = list(SHAPES) if args.shape == "both" else [args.shape]
    asyncio.run(main(chosen, args.sessions, args.runs))
    lineage_matching.report(args.runs, args.quick)
