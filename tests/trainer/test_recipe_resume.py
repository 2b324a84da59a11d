"""A training run killed mid-way resumes from its checkpoint: the ledger goes on at the next step,
with the same data order and the same weights as a run that was never interrupted.

The run is the recipe's CLI in a subprocess, killed with SIGKILL (no chance to clean up) once it
has printed step 3; real PostgreSQL, the generated tiny model, samples recorded by `toy_task`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trajstore.store import EventStore
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer import toy_task
from trajstore.trainer.checkpoint import latest_checkpoint
from trajstore.trainer.learner import LearnerConfig
from trajstore.trainer.ledger import read_step
from trajstore.trainer.recipe import RecipeConfig, recorded_steps, train_steps

pytestmark = pytest.mark.slow

STEPS = 7  # 32 samples in batches of 8: four a pass, so the run crosses into a second pass


async def ledger(store: EventStore, training_run: str) -> list[list[str]]:
    return [(await read_step(store, training_run, step)).sample_ids for step in range(1, STEPS + 1)]


async def test_a_killed_run_resumes_at_the_next_step_with_the_same_data_order(
    store: EventStore, database_url: str, tmp_path: Path
) -> None:
    model_dir = build_tiny_model(tmp_path / "model")
    await toy_task.record_toy_run(store, model_dir, "toy", subjects=toy_task.SUBJECTS[:4])
    checkpoints = tmp_path / "checkpoints"
    command = [
        sys.executable, "-m", "trajstore.trainer.recipe", database_url, "toy", str(model_dir),
        "--steps", str(STEPS), "--batch-size", "8", "--training-run", "killed",
        "--device", "cpu", "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2",
    ]  # fmt: skip
    process = await asyncio.create_subprocess_exec(
        *command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert process.stdout is not None
    async for line in process.stdout:
        if line.startswith(b"step   3"):
            process.send_signal(signal.SIGKILL)
            break
    assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGKILL
    done_before_kill = await recorded_steps(store, "killed")
    assert 3 <= done_before_kill < STEPS
    found = latest_checkpoint(checkpoints)
    assert found is not None and found.name in ("step-00000002", "step-00000004")

    config = RecipeConfig(batch_size=8, learner=LearnerConfig(device="cpu"))
    resumed_dir, straight_dir = tmp_path / "resumed", tmp_path / "straight"
    torch.set_num_threads(1)  # as the killed process computed: the same float sums
    resumed = await train_steps(
        store, "toy", model_dir, STEPS, training_run="killed", config=config,
        checkpoint_dir=checkpoints, save_dir=resumed_dir,
    )  # fmt: skip
    await train_steps(
        store, "toy", model_dir, STEPS, training_run="straight", config=config,
        save_dir=straight_dir,
    )  # fmt: skip

    # The resumed call trained from the checkpoint's next step to the end ...
    first = int(found.name.split("-")[1]) + 1
    assert [m["step"] for m in resumed] == [float(s) for s in range(first, STEPS + 1)]
    # ... the ledger holds every step once, with the samples of the uninterrupted run ...
    assert await recorded_steps(store, "killed") == STEPS
    assert await ledger(store, "killed") == await ledger(store, "straight")
    # ... and the weights are those of the uninterrupted run (optimiser state restored too).
    resumed_model, _ = toy_task.load(resumed_dir)
    straight_model, _ = toy_task.load(straight_dir)
    for a, b in zip(resumed_model.parameters(), straight_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
