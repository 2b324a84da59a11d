"""The live loop resumes from its checkpoint: the ledger goes on at the next version, no sample is
trained twice, and the engine is given the resumed weights first.

Real PostgreSQL and the generated tiny model; the samples are written straight into the table
(agents are not what this is about) and the publisher is a fake that records what it was given.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer.rows import sample_row, store_samples
from trajstore.live import LiveConfig, train_live
from trajstore.store import EventStore
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.ledger import read_step

pytestmark = pytest.mark.slow


class RecordingPublisher:
    """Remembers each published version and a fingerprint of the weights it was given."""

    def __init__(self) -> None:
        self.published: list[tuple[int, float]] = []

    async def publish(self, model: Any, version: int) -> Path:
        fingerprint = float(sum(p.detach().double().sum() for p in model.parameters()))
        self.published.append((version, fingerprint))
        return Path(f"v{version}")


async def run(
    store: EventStore, model_dir: Path, checkpoints: Path, policies: int
) -> tuple[RecordingPublisher, list[dict[str, float]]]:
    learner = Learner.load(model_dir, LearnerConfig(device="cpu", lr=1e-2))
    publisher = RecordingPublisher()
    # All samples were made by v0: a lag of up to 10 versions keeps them trainable.
    config = LiveConfig(policies=policies, batch_size=4, group_size=4, max_lag=10)
    history = await train_live(
        store, learner, publisher, config, run_id="run", training_run="live",
        checkpoint_dir=checkpoints,
    )  # fmt: skip
    return publisher, history


async def ledger(store: EventStore, steps: int) -> list[list[str]]:
    return [(await read_step(store, "live", s)).sample_ids for s in range(1, steps + 1)]


async def test_a_live_run_resumes_at_the_next_version_without_training_a_sample_twice(
    store: EventStore, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model_dir = build_tiny_model(tmp_path / "tiny")
    rows = [
        sample_row(session_id=f"s{g}-{m}", run_id="run", group_id=f"g{g}", reward=float(m % 2),
                   prompt=[5, 6, 7], completion=[10 + m, 20 + g, 30])
        for g in range(5)
        for m in range(4)
    ]  # fmt: skip
    await store_samples(store, rows)
    checkpoints = tmp_path / "checkpoints"

    first, history = await run(store, model_dir, checkpoints, policies=2)
    assert [v for v, _ in first.published] == [1, 2]
    assert [m["policy_version"] for m in history] == [1.0, 2.0]

    # Resumed: version 2's weights are published again first, then versions 3 and 4 follow.
    resumed, history = await run(store, model_dir, checkpoints, policies=3)
    assert [v for v, _ in resumed.published] == [2, 3]
    assert resumed.published[0][1] == pytest.approx(first.published[-1][1], rel=1e-6)
    assert [m["policy_version"] for m in history] == [3.0]

    # Killed after step 4's ledger event and before its checkpoint: the checkpoint is at 3 (here:
    # version 4 ran, then its checkpoint is replaced by the one at 3 kept aside).
    at_3 = tmp_path / "at-3"
    shutil.copytree(checkpoints, at_3)
    await run(store, model_dir, checkpoints, policies=4)
    shutil.rmtree(checkpoints)
    shutil.copytree(at_3, checkpoints)
    again, history = await run(store, model_dir, checkpoints, policies=5)
    # Step 4's update is lost, its samples are not trained again; the weights go out as v4.
    assert [v for v, _ in again.published] == [4, 5]
    assert [m["policy_version"] for m in history] == [5.0]

    steps = await ledger(store, 5)
    trained = [sample for step in steps for sample in step]
    assert len(trained) == len(set(trained)) == 20  # every sample once, none twice
    assert all(len(step) == 4 for step in steps)
