"""The recipe on a GPU: replay-to-GPU idle fraction, padded against packed tokens/s, step time,
peak memory, on a Qwen2.5-0.5B-shaped model (random weights built from its config, no download).

    python benchmarks/gpu.py                 on a GPU: a few minutes
    python benchmarks/gpu.py --dry-run       the same script, a tiny model, on the CPU (CI)
    python benchmarks/gpu.py --long          memory per token: today's shape before/after, 32 k
                                             and 64 k-token samples, the longest that trains
                                             for 0.5B and 1.5B (`benchmarks/gpu_long.py`)

`--logprobs full` is the path before issue 40 (the model's float32 logits and a log_softmax),
`chunked` the learner's default now (`trainer.logprobs`); `--gradient-checkpointing` as named.

Writes synthetic samples (lengths 0.5x to 1.5x `--sample-tokens`, a quarter of each a prompt;
`benchmarks/replay.py`'s rows) into a fresh database, then measures, in one run:

- replay alone: `trainer.replay` over the samples in padded batches, nothing trained (the
  store's side of the loop);
- the recipe's loop (`trainer.recipe.train_steps`: replay -> learner step -> ledger event) with
    padded, serial     batches of `--batch-size`, padded to their longest, no prefetch
    padded            the same, the next batch read and copied while a step runs
    packed sdpa       rows of `--budget` tokens, several samples each, dense block mask
    packed flex       the same rows, flex attention's BlockMask (per-sample cost)
  each on a fresh model with the same weights, over `--steps` steps after `--warmup` (kernel
  autotuning, flex's compilation) that are left out of the figures.

Figures: real (non-padding) tokens/s over the measured steps' wall time (waits + steps), the
median step time, the idle fraction (time the loop waited for its batch / wall time: the GPU
idles then), peak GPU memory, and packed tokens/s / padded tokens/s on the same samples.
The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import gpu_long  # benchmarks/gpu_long.py, next to this file
import numpy as np
import torch
from ingest import Databases  # benchmarks/ingest.py, next to this file
from replay import RUN_ID, make_rows, write_rows  # benchmarks/replay.py

from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.trainer.device import peak_memory, resolve_device
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.recipe import RecipeConfig, train_steps
from trajstore.trainer.replay import replay
from trajstore.trainer.selection import Selection

#: Qwen2.5-0.5B's shape (its config.json), and a tiny one for the dry run.
QWEN_05B = {
    "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
}  # fmt: skip
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
}  # fmt: skip


@dataclass(frozen=True)
class Case:
    """One configuration of the loop."""

    name: str
    pack: bool
    attention: str
    prefetch: int


CASES = (
    Case("padded, serial", False, "sdpa", 0),
    Case("padded", False, "sdpa", 1),
    Case("packed sdpa", True, "sdpa", 1),
    Case("packed flex", True, "flex", 1),
)


def build_model(shape: dict[str, object], attention: str) -> torch.nn.Module:
    """A Qwen2 model of `shape`, random weights from seed 0 (the same for every case)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    impl = {"sdpa": "sdpa", "flex": "flex_attention"}[attention]
    config = Qwen2Config(**shape, attn_implementation=impl)  # type: ignore[arg-type]
    return Qwen2ForCausalLM(config)


async def write_samples(url: str, n_tokens: int, sample_tokens: int, vocab: int) -> int:
    """The benchmark's samples, written into `url`'s `samples` table; their token count."""
    rows = make_rows(n_tokens, sample_tokens)
    for i, row in enumerate(rows):
        tokens = np.frombuffer(row[9], dtype="<i4") % vocab  # type: ignore[call-overload]
        rows[i] = (*row[:9], tokens.astype("<i4").tobytes(), *row[10:])
    await write_rows(url, rows)
    return sum(len(r[9]) // 4 for r in rows)  # type: ignore[arg-type]


async def replay_alone(store: EventStore, batch_size: int) -> float:
    """Tokens/s of a padded replay of every sample, nothing trained."""
    started, tokens = time.perf_counter(), 0
    async for batch in replay(store, Selection(runs=(RUN_ID,)), batch_size=batch_size, seed=1):
        tokens += sum(s["n_tokens"] for s in batch.get_non_tensor("samples"))
    return tokens / (time.perf_counter() - started)


async def run_case(
    store: EventStore, case: Case, args: argparse.Namespace, shape: dict[str, object]
) -> dict[str, float]:
    """The loop of one case; its figures over the measured steps."""
    device = resolve_device(args.device)
    learner_config = LearnerConfig(
        device=args.device,
        attention=case.attention,
        micro_token_budget=args.micro_token_budget,
        logprobs=args.logprobs,
        gradient_checkpointing=args.gradient_checkpointing,
        # Packed rows padded to the full budget: one shape, one compilation of flex's kernel.
        pad_multiple=args.budget if case.pack else 64,
    )
    config = RecipeConfig(
        batch_size=1 if case.pack else args.batch_size,
        token_budget=args.budget if case.pack else None,
        pack=case.pack,
        seed=1,
        prefetch=case.prefetch,
        learner=learner_config,
    )
    learner = Learner(build_model(shape, case.attention), learner_config)
    with peak_memory(device) as memory:
        history = await train_steps(
            store, RUN_ID, Path("unused"), args.warmup + args.steps,
            training_run=case.name.replace(" ", "-").replace(",", ""),
            config=config, learner=learner,
        )  # fmt: skip
    measured = history[args.warmup :]
    waits = sum(m["wait_seconds"] for m in measured)
    wall = waits + sum(m["step_seconds"] for m in measured)
    del learner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "tokens_per_s": sum(m["real_tokens"] for m in measured) / wall,
        "step_s": statistics.median(m["step_seconds"] for m in measured),
        "idle": waits / wall,
        "peak_gb": memory["peak_memory_gb"],
        "rows": statistics.median(m["micro_batches"] for m in measured),
    }


async def main(args: argparse.Namespace) -> None:
    shape = TINY if args.dry_run else QWEN_05B
    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    args.device_name = name
    databases = Databases(await asyncio.to_thread(database_url))
    await databases.setup()
    url = databases.url_of(databases.template)
    if args.long:
        print(f"device: {name}; long-context mode ({'tiny, dry run' if args.dry_run else 'real'})")
        try:
            async with await EventStore.open(url, max_size=4) as store:
                big = None if args.dry_run else gpu_long.QWEN_15B
                await gpu_long.main(args, store, url, shape, big)
        finally:
            await databases.drop_all()
        return
    try:
        vocab = int(shape["vocab_size"])  # type: ignore[call-overload]
        total = await write_samples(url, args.tokens, args.sample_tokens, vocab)
        model = "tiny (dry run)" if args.dry_run else "Qwen2.5-0.5B shape"
        print(f"device: {name}; model: {model}; "
              f"{total} tokens of samples, {args.sample_tokens // 2}-{args.sample_tokens * 3 // 2} "
              f"tokens each; padded batches of {args.batch_size}, packed rows of {args.budget}; "
              f"{args.steps} steps measured after {args.warmup}")  # fmt: skip
        async with await EventStore.open(url, max_size=4) as store:
            alone = await replay_alone(store, args.batch_size)
            print(f"replay alone: {alone / 1e6:.2f} M tokens/s")
            figures = {}
            for case in CASES:
                if case.attention == "flex" and device.type == "cpu":
                    print(f"  {case.name:15s} not on the CPU: flex attention has no backward there")
                    continue
                figures[case.name] = await run_case(store, case, args, shape)
                f = figures[case.name]
                print(f"  {case.name:15s} {f['tokens_per_s'] / 1e3:8.2f} k tokens/s  "
                      f"step {f['step_s'] * 1e3:8.1f} ms (median)  idle {f['idle']:6.2%}  "
                      f"peak {f['peak_gb']:5.1f} GB", flush=True)  # fmt: skip
    finally:
        await databases.drop_all()
    padded = figures["padded"]["tokens_per_s"]
    print(f"replay alone / loop (padded): the store is {alone / padded:.0f}x faster than the loop")
    print(f"prefetch: padded {padded / figures['padded, serial']['tokens_per_s']:.2f}x serial")
    for packed in ("packed sdpa", "packed flex"):
        if packed in figures:
            print(f"{packed} / padded tokens/s: {figures[packed]['tokens_per_s'] / padded:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, few samples (CPU)")
    parser.add_argument("--device", default="auto", help="auto | cuda | cpu")
    parser.add_argument("--tokens", type=int, help="tokens of samples written")
    parser.add_argument("--sample-tokens", type=int, help="mean tokens per sample")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per padded batch")
    parser.add_argument("--budget", type=int, help="tokens per packed row (one row a step)")
    parser.add_argument("--micro-token-budget", type=int, help="padded tokens per forward pass")
    parser.add_argument("--steps", type=int, help="steps measured per case")
    parser.add_argument("--warmup", type=int, help="steps left out first")
    parser.add_argument("--logprobs", default="chunked", help="chunked | full (before issue 40)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--long", action="store_true", help="the long-context mode (gpu_long.py)")
    parser.add_argument("--out", type=Path, help="--long: the results' JSON, rewritten per case")
    parser.add_argument(
        "--cases",
        default="today,head,long,longest",
        help="--long: which groups of cases run (gpu_long.py)",
    )
    parser.add_argument("--variants",
                        help="--long: only these (full,chunked,chunked +sac,...)")  # fmt: skip
    parser.add_argument("--deadline", type=float, default=360.0,
                        help="--long: seconds after which no case starts")  # fmt: skip
    args = parser.parse_args()
    dry = {"tokens": 30_000, "sample_tokens": 256, "budget": 1024, "steps": 6, "warmup": 2}
    full = {"tokens": 1_000_000, "sample_tokens": 1024, "budget": 10_240, "steps": 40,
            "warmup": 4}  # fmt: skip
    if args.long:  # several cases more: fewer steps each (8 x ~11 k tokens measured)
        dry |= {"steps": 3, "warmup": 1}
        full |= {"steps": 8, "warmup": 3}
    for key, value in (dry if args.dry_run else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    asyncio.run(main(args))
