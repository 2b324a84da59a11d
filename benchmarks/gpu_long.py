"""`benchmarks/gpu.py --long`: the recipe's memory per token, before and after, in one run.

    python benchmarks/gpu.py --long --out results.json      on a GPU: about six minutes
    python benchmarks/gpu.py --long --dry-run               the same cases, tiny, on the CPU

Cases, in this order (each a fresh model with the same weights; each written to `--out` as soon
as it is done, so a run cut short still leaves its figures; a case that runs out of GPU memory
is a result, `"status": "oom"`, not a failure):

  today's shape   0.5B, batches of 8 samples of 512-1,536 tokens, padded and packed (flex):
                  logprobs full (before: the model's float32 logits, `trainer.loss`), chunked
                  (`trainer.logprobs`), chunked + gradient checkpointing (full; of 2, 3, 4, 8, 12
                  layers of 24; selective: `trainer.activations`), liger (a GPU)
  head            the output layer's logprobs alone on 12,288 tokens, forward + backward with a
                  per-token gradient: full logits, chunked, Liger-Kernel's fused linear
                  cross-entropy (when the package is there), each checked against full
  long samples    0.5B, one sample of 32 k and of 64 k tokens a step: full (before) against
                  chunked + checkpointing, full and selective (after), liger + checkpointing
  longest         the 1.5B shape then the 0.5B shape, samples of growing length (one step
                  each), chunked + checkpointing, until one runs out of memory or time

Figures per case: real tokens/s over the measured steps, the peak GPU memory and the peak per
real token of the largest step, and the model FLOPs utilisation (MFU): useful FLOPs / wall
time / the GPU's bf16 dense peak, useful FLOPs = 6 x non-output-layer parameters x real tokens
+ 6 x vocab x hidden x trained tokens (the output layer is needed at trained tokens only) +
6 x layers x hidden x L^2 per sample of L tokens (causal attention, forward and backward).
Recomputation (checkpointing, the chunked backward) is work done but not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_head import head_case  # benchmarks/gpu_head.py
from replay import GROUP_SIZE, SERVED, write_rows  # benchmarks/replay.py

from trajstore.store import EventStore
from trajstore.trainer.device import peak_memory, resolve_device, synchronize
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.ledger import read_step
from trajstore.trainer.recipe import RecipeConfig, train_steps

#: Qwen2.5-1.5B's shape (its config.json).
QWEN_15B = {
    "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
    "max_position_embeddings": 32768, "rope_theta": 1_000_000.0, "tie_word_embeddings": True,
}  # fmt: skip
#: bf16 dense peak of the GPUs this runs on (H100/H200 SXM: 989.4 TFLOP/s, NVIDIA's sheet).
PEAK_FLOPS = {"H100": 989.4e12, "H200": 989.4e12}


class TimeUp(Exception):
    """A case reached its time cap: its figures are over the steps done so far."""


class Recorder:
    """The run's results as one JSON file, rewritten after every case."""

    def __init__(self, path: Path | None, meta: dict[str, Any]) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": meta, "cases": []}

    def add(self, case: dict[str, Any]) -> None:
        self.data["cases"].append(case)
        shown = {k: round(v, 4) if isinstance(v, float) else v for k, v in case.items()}
        print(json.dumps(shown), flush=True)
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, indent=1))
            os.replace(tmp, self.path)


def exact_rows(run_id: str, length: int, count: int, vocab: int) -> list[tuple[object, ...]]:
    """`count` samples of exactly `length` tokens (a quarter prompt), as `benchmarks/replay.py`'s
    rows; rewards vary within groups, so advantages are not zero."""
    rng = np.random.default_rng(length)
    rows = []
    for i in range(count):
        prompt = length // 4
        mask = np.zeros(length, np.uint8)
        mask[prompt:] = 1
        logprobs = np.where(mask == 1, -rng.random(length, dtype=np.float32) * 4, 0)
        rows.append((
            uuid.uuid4(), SERVED, f"{run_id}-{i}", run_id, f"{run_id}-g{i // GROUP_SIZE}", 0, True,
            "completed", float(i % 2), rng.integers(0, vocab, length, dtype=np.int32)
            .astype("<i4").tobytes(), mask.tobytes(), logprobs.astype("<f4").tobytes(),
            prompt, length - prompt, 1, 0, ["0"], [], 1,
        ))  # fmt: skip
    return rows


def build_on(shape: dict[str, Any], attention: str, device: torch.device, longest: int) -> Any:
    """A Qwen2 model of `shape` made on `device` (seconds, not a CPU's minute at 1.5B), seed 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    impl = {"sdpa": "sdpa", "flex": "flex_attention"}[attention]
    positions = max(int(shape["max_position_embeddings"]), longest)
    config = Qwen2Config(**(shape | {"max_position_embeddings": positions}),
                         attn_implementation=impl)  # fmt: skip
    torch.manual_seed(0)
    with device:
        return Qwen2ForCausalLM(config)


def useful_flops(shape: dict[str, Any], params: int, lengths: list[int], trained: float) -> float:
    """The module docstring's useful FLOPs of a step over samples of `lengths` tokens."""
    hidden, vocab = int(shape["hidden_size"]), int(shape["vocab_size"])
    layers = int(shape["num_hidden_layers"])
    head = vocab * hidden
    return (6 * (params - head) * sum(lengths) + 6 * head * trained
            + 6 * layers * hidden * sum(n * n for n in lengths))  # fmt: skip


def free(device: torch.device) -> None:
    """Give back what a finished case held (a failed one's tensors included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


async def free_loop(device: torch.device) -> None:
    """`free`, once the loop's left-over prefetch (a generator left by a break or an error,
    whose reading task holds the learner) has been closed by asyncio's finaliser."""
    for _ in range(5):
        gc.collect()
        await asyncio.sleep(0.02)
    free(device)


async def loop_case(
    store: EventStore, run_id: str, case: dict[str, Any], args: argparse.Namespace,
    shape: dict[str, Any], *, pack: bool, batch_size: int, budget: int | None,
    steps: int, warmup: int, cap_s: float, longest: int,
) -> dict[str, Any]:  # fmt: skip
    """One configuration of the recipe's loop; its figures, or how it failed."""
    device = resolve_device(args.device)
    attention = "flex" if pack else "sdpa"
    budget = case.get("row_tokens", budget)  # packed rows of another length
    learner_config = LearnerConfig(
        device=args.device, attention=attention, logprobs=case["logprobs"],
        gradient_checkpointing=case["checkpointing"], checkpoint_mode=case.get("mode", "full"),
        checkpoint_layers=case.get("layers"), micro_token_budget=case.get("micro"),
        pad_multiple=budget if pack and budget else 64,
    )  # fmt: skip
    config = RecipeConfig(batch_size=case.get("rows", 1) if pack else batch_size,
                          token_budget=budget if pack else None, pack=pack, seed=1, prefetch=1,
                          learner=learner_config)  # fmt: skip
    training_run = f"{case['name']}-{uuid.uuid4().hex[:6]}".replace(" ", "-")
    history: list[dict[str, float]] = []
    started = time.perf_counter()

    def on_step(metrics: dict[str, float]) -> None:
        history.append(metrics)
        if len(history) > warmup and time.perf_counter() - started > cap_s:
            raise TimeUp

    result = dict(case)
    try:
        learner = Learner(build_on(shape, attention, device, longest), learner_config)
        params = sum(p.numel() for p in learner.model.parameters())
        with peak_memory(device) as memory:
            try:
                await train_steps(store, run_id, Path("unused"), warmup + steps,
                                  training_run=training_run, config=config, learner=learner,
                                  on_step=on_step)  # fmt: skip
            except TimeUp:
                result["cut_by_time_cap_s"] = cap_s
            synchronize(device)
    except Exception as exc:  # out of memory (or a kernel's failure): this case's result
        oom = isinstance(exc, torch.OutOfMemoryError)
        result |= {"status": "oom" if oom else "error", "steps_done": len(history),
                   "message": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}  # fmt: skip
        learner = None  # type: ignore[assignment]
        del exc  # its traceback holds the failed step's tensors
        await free_loop(device)
        return result
    del learner
    await free_loop(device)
    measured = history[warmup:] or history[-1:]
    wall = sum(m["wait_seconds"] + m["step_seconds"] for m in measured)
    first = len(history) - len(measured) + 1
    lengths = [[s.n_tokens for s in (await read_step(store, training_run, step)).samples]
               for step in range(first, len(history) + 1)]  # fmt: skip
    flops = sum(useful_flops(shape, params, n, m["tokens"])
                for n, m in zip(lengths, measured, strict=True))  # fmt: skip
    real = sum(m["real_tokens"] for m in measured)
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in args.device_name), None)
    return result | {
        "status": "ok",
        "steps": len(measured),
        "tokens_per_s": real / wall,
        "step_s": statistics.median(m["step_seconds"] for m in measured),
        "idle": sum(m["wait_seconds"] for m in measured) / wall,
        "peak_gb": memory["peak_memory_gb"],
        "largest_step_tokens": max(sum(n) for n in lengths),
        "peak_kb_per_token": memory["peak_memory_gb"] * 1e6 / max(sum(n) for n in lengths),
        "mfu": flops / wall / peak_flops if peak_flops else None,
        "longest_sample": max(max(n) for n in lengths),
    }


async def main(args: argparse.Namespace, store: EventStore, url: str, shape: dict[str, Any],
               big: dict[str, Any] | None) -> None:  # fmt: skip
    """The long-context mode's cases, in the module docstring's order, until `--deadline`."""
    from gpu import write_samples  # benchmarks/gpu.py (the mode's entry point)

    device = resolve_device(args.device)
    deadline = time.monotonic() + args.deadline
    vocab = int(shape["vocab_size"])
    scale = 1 if not args.dry_run else 1 / 64  # the dry run's lengths: 64x shorter
    long_lengths = [int(32_768 * scale), int(65_536 * scale)]
    # One step each, up to what a step can do in a case's time cap (256 k at 0.5B: ~30 s).
    ladder = {"1.5B": [int(k * 1024 * scale) for k in (32, 64, 128, 192)],
              "0.5B": [int(k * 1024 * scale) for k in (128, 192, 256)]}  # fmt: skip
    recorder = Recorder(args.out, {"device": args.device_name, "dry_run": args.dry_run})
    await write_samples(url, args.tokens, args.sample_tokens, vocab)
    rows = [r for n in long_lengths for r in exact_rows(f"long-{n}", n, 3, vocab)]
    rows += [r for n in {*ladder["1.5B"], *ladder["0.5B"]} for r in exact_rows(f"one-{n}", n, 2,
             vocab)]  # fmt: skip
    await write_rows(url, rows)
    longest = max(max(ladder["1.5B"]), max(ladder["0.5B"]))

    def left() -> float:
        return float(deadline - time.monotonic())

    def asked(variant: dict[str, Any]) -> bool:  # `--variants`, when given, names the ones to run
        return not args.variants or _tag(variant) in args.variants.split(",")

    full, chunked, ckpt = ({"logprobs": "full", "checkpointing": False},
                           {"logprobs": "chunked", "checkpointing": False},
                           {"logprobs": "chunked", "checkpointing": True})  # fmt: skip
    sac = ckpt | {"mode": "selective"}  # the matmuls' and attention's outputs kept
    # Some of the 24 layers checkpointed: the dial between chunked and chunked + checkpointing.
    partial = tuple(ckpt | {"layers": n} for n in (2, 3, 4, 8, 12))
    liger, liger_ckpt = ({"logprobs": "liger", "checkpointing": False},
                         {"logprobs": "liger", "checkpointing": True})  # fmt: skip
    on_gpu = device.type == "cuda"  # Liger's kernels are Triton's: a GPU's
    # Token-budget micro-batches: a third of a batch's activations alive at a time. Padded:
    # rows grouped longest first up to 4,096 padded tokens; packed: rows of 5,120, two a step
    # (about today's tokens a step), one row per forward pass.
    micro = {"padded": chunked | {"micro": 4096, "tag": "micro 4096"},
             "packed flex": chunked | {"row_tokens": args.budget // 2, "rows": 2,
                                       "micro": args.budget // 2, "tag": "2 rows"}}  # fmt: skip
    variants = (full, chunked, ckpt, *partial, sac, *((liger,) if on_gpu else ()))
    if on_gpu and "today" in args.cases:  # the first case's steps run slower: a case unrecorded
        await loop_case(store, "bench", {"name": "warm-up", **chunked}, args, shape, pack=False,
                        batch_size=args.batch_size, budget=args.budget, steps=3, warmup=0,
                        cap_s=15, longest=longest)  # fmt: skip
    for pack in (False, True) if "today" in args.cases else ():
        layout = "packed flex" if pack else "padded"
        if pack and device.type == "cpu":
            recorder.add({"name": "today packed flex", "status": "skipped",
                          "why": "flex attention has no backward on the CPU"})  # fmt: skip
            continue
        for variant in (*variants, micro[layout]):
            if not asked(variant):
                continue
            case = {"name": f"today {layout} {_tag(variant)}", "model": "0.5B", **variant}
            if left() < 30:
                recorder.add(case | {"status": "skipped", "why": "deadline"})
                continue
            recorder.add(await loop_case(
                store, "bench", case, args, shape, pack=pack, batch_size=args.batch_size,
                budget=args.budget, steps=args.steps, warmup=args.warmup, cap_s=25,
                longest=longest))  # fmt: skip

    head_tokens = int(12_288 * (scale if args.dry_run else 1))
    for kind in ("full", "chunked", "liger") if "head" in args.cases else ():
        case = {"name": f"head {kind}", "tokens": head_tokens}
        try:
            recorder.add(case | {"status": "ok"} | head_case(kind, head_tokens, shape, device))
        except TrainerError as exc:  # liger-kernel not installed
            recorder.add(case | {"status": "unavailable", "why": str(exc)[:200]})
        except torch.OutOfMemoryError as exc:
            recorder.add(case | {"status": "oom", "message": str(exc).splitlines()[0][:300]})
        except Exception as exc:  # a library's failure is a result here, not the run's end
            recorder.add(case | {"status": "error", "why": f"{type(exc).__name__}: {exc}"[:300]})
        free(device)

    for n in long_lengths if "long" in args.cases else ():
        for variant in (full, ckpt, sac, *((liger_ckpt,) if on_gpu else ())):
            case = {"name": f"long {n} {_tag(variant)}", "model": "0.5B", **variant}
            if not asked(variant):
                continue
            if left() < 40:
                recorder.add(case | {"status": "skipped", "why": "deadline"})
                continue
            recorder.add(await loop_case(
                store, f"long-{n}", case, args, shape, pack=False, batch_size=1, budget=None,
                steps=2, warmup=1, cap_s=30, longest=longest))  # fmt: skip

    for model in ("1.5B", "0.5B") if "longest" in args.cases else ():
        model_shape = shape if model == "0.5B" or big is None else big
        for n in ladder[model]:
            case = {"name": f"longest {model} {n}", "model": model, "logprobs": "chunked",
                    "checkpointing": True}  # fmt: skip
            if left() < 45:
                recorder.add(case | {"status": "skipped", "why": "deadline"})
                break
            result = await loop_case(
                store, f"one-{n}", case, args, model_shape, pack=False, batch_size=1,
                budget=None, steps=1, warmup=0, cap_s=40, longest=longest)  # fmt: skip
            recorder.add(result)
            if result["status"] != "ok":
                break
    summarise(recorder.data["cases"])
    failed = [c["name"] for c in recorder.data["cases"] if c.get("status") == "error"]
    if failed and args.dry_run:  # on the CPU every case must run: the dry run guards the script
        raise SystemExit(f"cases failed: {', '.join(failed)}")


def _tag(variant: dict[str, Any]) -> str:
    """A variant's name: its logprobs, checkpointing, micro-batching."""
    ckpt = ""
    if variant["checkpointing"]:
        ckpt = " +sac" if variant.get("mode") == "selective" else " +ckpt"
        ckpt += f" {variant['layers']} layers" if "layers" in variant else ""
    return f"{variant['logprobs']}{ckpt}" + (f" {variant['tag']}" if "tag" in variant else "")


def summarise(cases: list[dict[str, Any]]) -> None:
    """The run's answers in a few lines (the JSON holds every figure)."""
    ok = {c["name"]: c for c in cases if c.get("status") == "ok"}
    for pack in ("padded", "packed flex"):
        before = ok.get(f"today {pack} full")
        for after_name in [n for n in ok if n.startswith(f"today {pack} ") and "full" not in n]:
            after = ok.get(after_name)
            if before and after:
                print(f"{after_name}: {after['tokens_per_s'] / before['tokens_per_s']:.2f}x the "
                      f"full path's tokens/s, peak {after['peak_gb']:.1f} GB against "
                      f"{before['peak_gb']:.1f} GB")  # fmt: skip
    for model in ("0.5B", "1.5B"):
        trained = [
            c["longest_sample"]
            for c in ok.values()
            if c.get("model") == model and c["name"].startswith(("longest", "long "))
        ]
        if trained:
            print(f"longest sample trained, {model}: {max(trained)} tokens")
