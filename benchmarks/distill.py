"""On-policy distillation against GRPO alone, from the same start, on the learning benchmark's toy
task: reward and per-token reverse KL to the teacher, step by step, in the same run.

    python benchmarks/distill.py [--quick] [--teacher-steps 8] [--steps 8] [--png FILE]
                                 [--teacher-dir DIR]

1. The teacher: v0 (the generated tiny model) trained by the live loop (`trajstore train`'s:
   toy agents through the proxy on a real vLLM, lag 0, batches of 16) for `--teacher-steps`
   policies on the toy task (answer with digits); with `--teacher-from recipe`, by the same
   on-policy GRPO steps the students take, in this process (no agents: what a loaded machine
   can finish); or a policy given with `--teacher-dir`. Served by a real vLLM (CPU build) for
   scoring.
2. Two students from the same v0, `--steps` steps each, the same samples per step (sessions
   sampled from the student itself, recorded as the proxy records them, projected):
     GRPO     the recipe's loss on the session rewards;
     distill  every sample scored by the teacher engine (`trajstore.teacher.score_run`, the
              `trajstore score` path), the loss on the per-token reverse KL alone
              (`trainer.distill`, grpo = 0; the rewards are not used).
   Both runs' samples are scored, so the reverse KL per token is measured alike for both: the
   mean of behaviour logprob - teacher logprob over generated tokens (the scorer stores it with
   each score: `side_data.mean_reverse_kl`).

Printed per step: mean reward and mean reverse KL of the samples each student generated, the
teacher's training rewards by policy version, the wall time. The PNG shows the reward curves.
The students sample and train in this process (transformers, CPU); the teacher's logprobs come
from the vLLM engine. The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ingest import Databases  # benchmarks/ingest.py, next to this file
from learning import plot  # benchmarks/learning.py

from trajstore.live import LiveConfig
from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.store.sample_reads import rewards_by_version
from trajstore.teacher import Teacher, score_run
from trajstore.tiny_model import build_tiny_model
from trajstore.train_cli import live_services, run_config
from trajstore.trainer import toy_task
from trajstore.trainer.distill import DistillConfig
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.replay import replay
from trajstore.trainer.selection import Selection
from trajstore.vllm_server import VllmServer

TEACHER = "teacher"


def free_port() -> int:
    """A TCP port free on this machine now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def save_policy(learner: Learner, base: Path, out: Path) -> Path:
    """The learner's weights with the base model's tokenizer and config files, in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for path in base.iterdir():
        if path.is_file() and path.suffix != ".safetensors":
            shutil.copy2(path, out / path.name)
    learner.model.save_pretrained(out)
    return out


async def one_step(
    store: EventStore,
    learner: Learner,
    policy_dir: Path,
    run_id: str,
    args: argparse.Namespace,
    step: int,
    teacher: Teacher | None,
) -> dict[str, float]:
    """Sample the step's sessions from the policy in `policy_dir`, score them (with a teacher),
    train one learner step on them; their mean reward and reverse KL. Each step is a run of its
    own (`<run>-<step>`): the toy task names its sessions after their run."""
    run_id = f"{run_id}-{step}"
    rewards = await toy_task.record_toy_run(
        store, policy_dir, run_id, subjects=toy_task.SUBJECTS[: args.subjects],
        group_size=args.group_size, seed=1000 * step + 7, policy_version=step,
    )  # fmt: skip
    kl = float("nan")
    if teacher is not None:
        report = await score_run(store, teacher, [run_id])
        assert not report.failed, report
        kl = float(
            await store.pool.fetchval(
                "SELECT avg(mean_reverse_kl) FROM side_data "
                "WHERE run_id = $1 AND name = 'logprobs'",
                run_id,
            )
        )
    distilling = learner.config.distill is not None
    selection = Selection(runs=(run_id,))
    batches = replay(store, selection, batch_size=len(rewards), shuffle=False,
                     teacher=TEACHER if distilling else None)  # fmt: skip
    async for batch in batches:
        await asyncio.to_thread(learner.step, learner.prepare(batch))
    return {"reward": statistics.fmean(rewards), "reverse_kl": kl}


async def train(
    store: EventStore,
    base: Path,
    work: Path,
    run_id: str,
    steps: int,
    args: argparse.Namespace,
    *,
    teacher: Teacher | None = None,
    distill: bool = False,
    on_step: Any = None,
) -> tuple[list[dict[str, float]], Path]:
    """`steps` on-policy steps from `base`; each step's figures, and the last policy's dir."""
    config = LearnerConfig(
        lr=args.lr, distill=DistillConfig(TEACHER, coef=1.0, grpo=0.0) if distill else None
    )
    learner = await asyncio.to_thread(Learner.load, base, config)
    policy = base
    history = []
    for step in range(steps):
        figures = await one_step(store, learner, policy, run_id, args, step, teacher)
        history.append(figures)
        policy = await asyncio.to_thread(save_policy, learner, base, work / run_id / f"v{step + 1}")
        if on_step is not None:
            on_step(step, figures)
    return history, policy


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    databases = Databases(await asyncio.to_thread(database_url))
    await databases.setup()
    try:
        with tempfile.TemporaryDirectory(prefix="trajstore-distill-") as tmp:
            work = Path(tmp)
            base = await asyncio.to_thread(build_tiny_model, work / "v0", seed=0)
            results, teacher_rewards = await compare(await databases.fresh(), base, work, args)
    finally:
        await databases.drop_all()
    report(results, teacher_rewards, args, time.perf_counter() - started)


async def live_teacher(
    url: str, base: Path, work: Path, args: argparse.Namespace
) -> tuple[Path, Path, list[float], tuple[float, float]]:
    """Train the teacher with the live loop (`trajstore train`'s: agents through the proxy on a
    real vLLM, lag 0); its directory, v0's (the untied copy the loop serves, the students'
    start), the rewards of its training sessions by version, and v0 / v_k eval means."""
    config = LiveConfig(policies=args.teacher_steps, batch_size=16, group_size=8, max_lag=0)
    learner = LearnerConfig(device="cpu", lr=args.lr)
    port = free_port()  # not 8700: tests of the live loop may hold it on a shared machine
    async with live_services(
        url, base, work / "served", work / "vllm-live.log", proxy_port=port
    ) as services:
        result = await run_config(services, config, learner, run_id="teacher",
                                  eval_sessions=args.eval_sessions)  # fmt: skip
        v0 = services.model_dir
    teacher = work / "teacher"
    shutil.copytree(services.publish_dir / "teacher" / f"v{args.teacher_steps}", teacher)
    for path in v0.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and not (teacher / path.name).exists():
            shutil.copy2(path, teacher / path.name)
    async with await EventStore.open(url) as store:
        curve = [r for _, _, r in await rewards_by_version(store, "teacher")]
    means = (statistics.fmean(result["before"]), statistics.fmean(result["after"]))  # type: ignore[arg-type]
    return teacher, v0, curve, means


async def compare(
    url: str, base: Path, work: Path, args: argparse.Namespace
) -> tuple[dict[str, list[dict[str, float]]], list[float]]:
    """Train (or take) the teacher, serve it, run both students; their figures."""
    if args.teacher_dir is not None:
        teacher_dir, teacher_rewards = args.teacher_dir, list[float]()
    elif args.teacher_from == "recipe":
        print(f"teacher: the recipe's on-policy GRPO, {args.teacher_steps} steps from v0")
        async with await EventStore.open(url) as store:
            history, teacher_dir = await train(
                store, base, work, "teacher", args.teacher_steps, args,
                on_step=lambda s, f: print(f"  teacher v{s}: reward {f['reward']:.3f}", flush=True),
            )  # fmt: skip
        teacher_rewards = [h["reward"] for h in history]
    else:
        print(f"teacher: the live loop, {args.teacher_steps} policies from v0", flush=True)
        teacher_dir, base, teacher_rewards, (before, after) = await live_teacher(
            url, base, work, args
        )
        print(f"  teacher eval: v0 {before:.3f}, v{args.teacher_steps} {after:.3f}", flush=True)
    server = VllmServer(teacher_dir, args.port or free_port(), served_model_name=TEACHER,
                        log_file=work / "vllm.log", max_model_len=1024)  # fmt: skip
    await asyncio.to_thread(server.start)
    results = {}
    try:
        async with await EventStore.open(url) as store:
            teacher = Teacher(TEACHER, server.url, TEACHER, batch_size=16, concurrency=2)
            for name, distill in (("GRPO", False), ("distill", True)):
                print(f"student ({name}): {args.steps} steps from v0", flush=True)
                results[name], _ = await train(
                    store, base, work, f"student-{name}", args.steps, args,
                    teacher=teacher, distill=distill,
                    on_step=lambda s, f: print(
                        f"  v{s}: reward {f['reward']:.3f}  reverse KL {f['reverse_kl']:.3f}",
                        flush=True,
                    ),
                )  # fmt: skip
    finally:
        await asyncio.to_thread(server.stop)
    return results, teacher_rewards


def report(
    results: dict[str, list[dict[str, float]]],
    teacher_rewards: list[float],
    args: argparse.Namespace,
    seconds: float,
) -> None:
    """The per-step table, the last steps' means, and the PNG."""
    samples = args.subjects * args.group_size
    print(f"\n{samples} samples per step; reward and reverse KL of each step's own samples")
    print("| step | GRPO reward | GRPO reverse KL | distill reward | distill reverse KL |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for step, (g, d) in enumerate(zip(results["GRPO"], results["distill"], strict=True)):
        print(f"| {step} | {g['reward']:.3f} | {g['reverse_kl']:.3f} | {d['reward']:.3f} | "
              f"{d['reverse_kl']:.3f} |")  # fmt: skip
    if teacher_rewards:
        print(f"teacher's training rewards: {' '.join(f'{r:.3f}' for r in teacher_rewards)}")
    print(f"wall time {seconds:.0f} s")
    if args.png is not None:
        curves = {
            name: [(float(s), h["reward"]) for s, h in enumerate(history)]
            for name, history in results.items()
        }
        if teacher_rewards:
            curves["teacher (GRPO)"] = [(float(s), r) for s, r in enumerate(teacher_rewards)]
        plot(curves, "toy task: reward of each step's samples", args.png)
        print(f"wrote {args.png}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes (CI, 2 cores)")
    parser.add_argument("--teacher-steps", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps of each student")
    parser.add_argument("--subjects", type=int, default=12, help="GRPO groups per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--teacher-from", choices=("live", "recipe"), default="live",
                        help="train the teacher by the live loop (vLLM, proxy, agents) or by "
                        "the same on-policy GRPO steps in this process")  # fmt: skip
    parser.add_argument("--teacher-dir", type=Path, default=None,
                        help="a trained policy as the teacher (skips training one)")  # fmt: skip
    parser.add_argument("--eval-sessions", type=int, default=32,
                        help="the teacher's sessions on v0 and on its last policy")  # fmt: skip
    parser.add_argument("--port", type=int, default=None, help="the teacher engine's port")
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.teacher_steps, args.steps, args.subjects, args.group_size = 4, 4, 4, 4
        args.eval_sessions = 8
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
