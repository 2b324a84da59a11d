"""A learning run's metrics in TensorBoard event files and a W&B offline run, read back with
their own readers: TensorBoard's `EventAccumulator`, W&B's record messages (`wandb_internal_pb2`).
"""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trajstore.cli import main
from trajstore.store import EventStore
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer import toy_task
from trajstore.trainer.ledger import read_step
from trajstore.trainer.metrics_log import open_metrics_log
from trajstore.trainer.recipe import RecipeConfig, train_steps

pytestmark = pytest.mark.slow

STEPS = 6
#: What the issue asks each step to report, as the trainer names it.
REPORTED = ("loss", "reward_mean", "kl_k3", "ratio_mean", "clip_fraction", "wait_seconds",
            "tokens_per_second")  # fmt: skip


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of a W&B run's transaction log (`run-<id>.wandb`), decoded with wandb's own
    protocol messages. The file is a LevelDB-style log (W&B's `datastore`): a 7-byte header,
    then 32 KiB blocks of records, each `crc32 (4) | length (2) | type (1) | data`, a record
    split over blocks as FIRST, MIDDLE..., LAST."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, parts, records = 7, [], []
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # the block's tail is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            break
        parts.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # FULL, LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


async def test_a_learning_runs_curves_reach_tensorboard_and_wandb_tagged_with_their_runs(
    store: EventStore, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")  # no network, no account
    monkeypatch.setenv("WANDB_SILENT", "true")
    model_dir = build_tiny_model(tmp_path / "model")
    await toy_task.record_toy_run(store, model_dir, "rollouts", subjects=toy_task.SUBJECTS[:8])

    with open_metrics_log(
        "toy", ["rollouts"], tensorboard_dir=tmp_path / "tb", wandb_project="trajstore-test",
        wandb_dir=tmp_path,
    ) as metrics_log:  # fmt: skip
        history = await train_steps(
            database_url, "rollouts", model_dir, STEPS, training_run="toy",
            config=RecipeConfig(batch_size=8), metrics_log=metrics_log,
        )  # fmt: skip
    rewards = [m["reward_mean"] for m in history]
    ledger = [(await read_step(store, "toy", s)).metrics["reward_mean"] for s in range(1, 7)]
    assert rewards == ledger  # what the ledger recorded, step by step

    # TensorBoard: the reward curve, point for point, and every reported metric.
    events = EventAccumulator(str(tmp_path / "tb" / "toy"))
    events.Reload()
    curve = events.Scalars("train/reward_mean")
    assert [p.step for p in curve] == list(range(1, STEPS + 1))
    assert [p.value for p in curve] == pytest.approx(rewards, rel=1e-6)
    for name in REPORTED:
        assert len(events.Scalars(f"train/{name}")) == STEPS, name
    speed = [p.value for p in events.Scalars("train/tokens_per_second")]
    expected = [m["real_tokens"] / m["step_seconds"] for m in history]
    assert speed == pytest.approx(expected, rel=1e-5)
    (told,) = events.Tensors("trajstore/provenance/text_summary")
    text = told.tensor_proto.string_val[0].decode()
    assert "trajstore_run_ids: ['rollouts']" in text and "training-toy" in text

    # W&B, offline: a run named after the training run, its runs as tags and config, and one
    # history row per step holding the same metrics.
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = wandb_records(run_dir)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "toy" and run.project == "trajstore-test"
    assert "run:rollouts" in run.tags
    config = {item.key: orjson.loads(item.value_json) for item in run.config.update}
    assert config["trajstore_run_ids"] == ["rollouts"]
    history_records = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    rows = [
        {item.key or "/".join(item.nested_key): orjson.loads(item.value_json) for item in h.item}
        for h in history_records
    ]
    assert [h.step.num for h in history_records] == list(range(1, STEPS + 1)), rows
    assert [row["train/reward_mean"] for row in rows] == pytest.approx(rewards)
    assert all(f"train/{name}" in row for row in rows for name in REPORTED)

    # A run trained before any sink was set: its ledger, exported by `trajstore replay`.
    args = ["--database-url", database_url, "replay", "--training-run", "toy", "--export-metrics",
            "--tensorboard-dir", str(tmp_path / "later")]  # fmt: skip
    result = await asyncio.to_thread(CliRunner().invoke, main, args)
    assert result.exit_code == 0, result.output
    assert f"reported {STEPS} steps" in result.output
    later = EventAccumulator(str(tmp_path / "later" / "toy"))
    later.Reload()
    assert [p.value for p in later.Scalars("train/reward_mean")] == pytest.approx(rewards)


def test_the_flags_name_their_environment_variables() -> None:
    for command in (["train", "--help"], ["replay", "--help"]):
        shown = CliRunner().invoke(main, command).output
        assert "TRAJSTORE_TENSORBOARD_DIR" in shown and "TRAJSTORE_WANDB_PROJECT" in shown
