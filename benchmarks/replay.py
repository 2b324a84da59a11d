"""Replay throughput: samples -> TensorDict batches, against a raw asyncpg read in the same run.

    python benchmarks/replay.py [--tokens 4000000] [--runs 5] [--batch-size 64]

Writes synthetic samples (lengths spread over 0.5x to 1.5x `--sample-tokens`, groups of 8,
random rewards) straight into the `samples` table of a fresh, migrated database, then measures:

- raw:     one SELECT of the same rows (the three arrays, reward and group id), each array
           turned into numpy with np.frombuffer: the least any reader must do;
- padded:  `trainer.replay.replay(..., batch_size=N)`: index query, seeded shuffle, group
           advantages, per-batch array reads, padded int64/bool/float32 tensors;
- packed:  the same with `pack=True` into rows of `--budget` tokens;
- verl:    `trainer.verl_batch.verl_batches(..., batch_size=N)`: the same samples as verl's
           DataProto (left-padded prompts, right-padded responses, masks, position ids,
           behaviour logprobs, token-level rewards), what a verl actor update consumes.

Tokens/s counts real (non-padding) tokens. The database is TRAJSTORE_DATABASE_URL's server, else
the embedded one; it needs the right to create databases. Prints medians and ratios (raw time /
replay time: 1.00x is as fast as the raw read; the target is >= 0.5x and >= 1 M tokens/s).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import uuid
from collections.abc import Awaitable, Callable

import asyncpg
import numpy as np
from ingest import Databases, line, timed  # benchmarks/ingest.py, next to this file

from trajstore.store import EventStore
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.embedded import database_url
from trajstore.trainer.replay import replay
from trajstore.trainer.selection import Selection

SERVED = 1  # the projection version readers are served first (`projection_serving`)
RUN_ID = "bench"
GROUP_SIZE = 8
COLUMNS = (
    "sample_id", "projection_version", "session_id", "run_id", "group_id", "branch", "is_final",
    "status", "reward", "token_ids", "loss_mask", "logprobs", "prompt_len", "response_len",
    "n_turns", "tool_turns", "policy_versions", "engines", "last_position",
)  # fmt: skip


def make_rows(n_tokens: int, sample_tokens: int, seed: int = 0) -> list[tuple[object, ...]]:
    """Sample rows holding about `n_tokens` tokens in all, a quarter of each one prompt."""
    rng = np.random.default_rng(seed)
    rows, total, i = [], 0, 0
    while total < n_tokens:
        length = int(rng.integers(sample_tokens // 2, sample_tokens * 3 // 2 + 1))
        prompt = length // 4
        mask = np.zeros(length, np.uint8)
        mask[prompt:] = 1
        logprobs = np.where(mask == 1, -rng.random(length, dtype=np.float32) * 4, 0)
        rows.append(
            (
                uuid.uuid4(),
                SERVED,
                f"session-{i}",
                RUN_ID,
                f"g-{i // GROUP_SIZE}",
                0,
                True,
                "completed",
                float(rng.random()),
                rng.integers(0, 151_000, length, dtype=np.int32).astype("<i4").tobytes(),
                mask.tobytes(),
                logprobs.astype("<f4").tobytes(),
                prompt,
                length - prompt,
                1,
                0,
                ["0"],
                [],
                1,
            )
        )
        total += length
        i += 1
    return rows


async def write_rows(url: str, rows: list[tuple[object, ...]]) -> None:
    """Rows of COLUMNS into `url`'s `samples` table, analysed (the planner sees them)."""
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        await conn.copy_records_to_table("samples", records=rows, columns=COLUMNS)
        await conn.execute("VACUUM ANALYZE samples")
    finally:
        await conn.close()


async def raw_read(conn: asyncpg.Connection) -> int:
    """The same rows and arrays, one SELECT, np.frombuffer: tokens read."""
    rows = await conn.fetch(
        "SELECT sample_id, group_id, reward, token_ids, loss_mask, logprobs FROM samples "
        "WHERE projection_version = $1 AND run_id = $2",
        SERVED,
        RUN_ID,
    )
    tokens = 0
    for row in rows:
        tokens += len(np.frombuffer(row["token_ids"], dtype="<i4"))
        np.frombuffer(row["loss_mask"], dtype=np.uint8)
        np.frombuffer(row["logprobs"], dtype="<f4")
    return tokens


async def replayed(store: EventStore, **layout: object) -> int:
    """Every batch of a replay of the run: real tokens batched."""
    tokens = 0
    async for batch in replay(store, Selection(runs=(RUN_ID,)), seed=1, **layout):  # type: ignore[arg-type]
        tokens += sum(s["n_tokens"] for s in batch.get_non_tensor("samples"))
    return tokens


async def verl_batched(store: EventStore, batch_size: int) -> int:
    """Every verl batch of the run: real tokens batched (the attention mask's ones)."""
    from trajstore.trainer.verl_batch import verl_batches  # imports verl: only when measured

    tokens = 0
    async for batch in verl_batches(store, Selection(runs=(RUN_ID,)), batch_size=batch_size,
                                    seed=1):  # fmt: skip
        tokens += int(batch.batch["attention_mask"].sum())
    return tokens


async def main(n_tokens: int, sample_tokens: int, runs: int, batch_size: int, budget: int) -> None:
    databases = Databases(await asyncio.to_thread(database_url))
    await databases.setup()  # one fresh, migrated database is all this needs
    url = databases.url_of(databases.template)
    try:
        rows = make_rows(n_tokens, sample_tokens)
        await write_rows(url, rows)
        conn = await asyncpg.connect(asyncpg_dsn(url))
        store = await EventStore.open(url, max_size=2)  # open once, like the raw connection
        try:
            total = sum(len(r[9]) // 4 for r in rows)  # type: ignore[arg-type]
            print(f"workload: {len(rows)} samples, {total} tokens, batches of {batch_size}, "
                  f"packed rows of {budget} tokens")  # fmt: skip
            times: dict[str, list[float]] = {"raw": [], "padded": [], "packed": [], "verl": []}
            work: dict[str, Callable[[], Awaitable[int]]] = {
                "raw": lambda: raw_read(conn),
                "padded": lambda: replayed(store, batch_size=batch_size),
                "packed": lambda: replayed(store, token_budget=budget, pack=True),
                "verl": lambda: verl_batched(store, batch_size),
            }
            for run in range(runs):
                # Alternate the order, so no side always gets the warmer cache.
                for key in list(work) if run % 2 == 0 else list(work)[::-1]:
                    gc.collect()  # no side pays for the garbage the other left
                    seconds, tokens = await timed(work[key])
                    assert tokens == total, (key, tokens, total)
                    times[key].append(seconds)
        finally:
            await conn.close()
            await store.close()
    finally:
        await databases.drop_all()
    print(f"medians of {runs} runs; ratio = raw time / replay time (1.00x = as fast as raw)")
    print(line("padded", times["padded"], times["raw"], total, label="replay", width=8))
    print(line("packed", times["packed"], times["raw"], total, label="replay", width=8))
    print(line("verl", times["verl"], times["raw"], total, label="replay", width=8))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4_000_000, help="tokens in all samples")
    parser.add_argument("--sample-tokens", type=int, default=1024, help="mean tokens per sample")
    parser.add_argument("--runs", type=int, default=5, help="runs per measurement")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per padded batch")
    parser.add_argument("--budget", type=int, default=8192, help="tokens per packed row")
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.sample_tokens, args.runs, args.batch_size, args.budget))
