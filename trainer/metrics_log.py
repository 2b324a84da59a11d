"""Training metrics where teams already watch them: TensorBoard event files, Weights & Biases.

    MetricsLog            what the recipe, `trajstore train` and `trajstore replay --training-run
                          T --export-metrics` (a past run's steps, from the ledger) report
                          each step to: one or more sinks
    ├── TensorBoardSink   scalars in event files under DIR/<training run> (tensorboardX: no
    │                     TensorFlow, no torch); `tensorboard --logdir DIR` shows them
    └── WandbSink         a W&B run named after the training run; offline with
                          WANDB_MODE=offline (no network: `wandb sync` uploads it later)

Every point is tagged with where it came from, so a curve leads back to its samples: the
training run (its ledger stream `training-<run>`, whose step N names the step's sample ids:
`trajstore replay --training-run T --step N`) and the run ids of the trajectories trained on
(TensorBoard: a text summary `trajstore/provenance`; W&B: the run's config and tags).

Names are the trainer's own (`trainer.loss`, `trainer.learner`): `loss`, `reward_mean`,
`kl_k3`, `ratio_mean`, `clip_fraction`, `tis_truncated_fraction`, `staleness_mean` (lag, live
runs), `wait_seconds` (how long the step waited for the store's next batch), and
`tokens_per_second` (real tokens through the model over the step's time), each under `train/`;
the live loop's evaluations under `eval/`.

Configured by the CLI flags `--tensorboard-dir` (env TRAJSTORE_TENSORBOARD_DIR) and
`--wandb-project` (env TRAJSTORE_WANDB_PROJECT); W&B's own variables (WANDB_MODE, WANDB_DIR,
WANDB_ENTITY, WANDB_API_KEY) keep their meaning.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from trajstore.store import EventStore
from trajstore.store.payloads_session import TrainingStep
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.ledger import training_stream

#: The environment variables the CLI flags fall back on.
TENSORBOARD_DIR_ENV = "TRAJSTORE_TENSORBOARD_DIR"
WANDB_PROJECT_ENV = "TRAJSTORE_WANDB_PROJECT"


class MetricsSink(Protocol):
    """Somewhere a training run's metrics go."""

    def log(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        """Record the metrics of one step, each named `prefix/name`."""

    def close(self) -> None:
        """Write out what is buffered and release the sink."""


def with_throughput(metrics: Mapping[str, float]) -> dict[str, float]:
    """The step's metrics with `tokens_per_second`, when it reported its tokens and time."""
    found = dict(metrics)
    tokens, seconds = metrics.get("real_tokens"), metrics.get("step_seconds")
    if tokens is not None and seconds:
        found["tokens_per_second"] = tokens / seconds
    return found


def provenance(training_run: str, run_ids: Sequence[str]) -> dict[str, Any]:
    """Where a training run's points come from: its ledger and the trajectories' runs."""
    return {
        "trajstore_training_run": training_run,
        "trajstore_ledger_stream": training_stream(training_run),
        "trajstore_run_ids": list(run_ids),
        "trajstore_step_samples": f"trajstore replay --training-run {training_run} --step N",
    }


class TensorBoardSink:
    """Scalars in TensorBoard event files under `log_dir/<training run>`."""

    def __init__(self, log_dir: Path, training_run: str, run_ids: Sequence[str]) -> None:
        try:
            from tensorboardX import SummaryWriter
        except ImportError as exc:
            raise TrainerError(
                "--tensorboard-dir needs tensorboardX: pip install 'trajstore[observe]'"
            ) from exc
        self.path = Path(log_dir) / training_run
        self.writer = SummaryWriter(logdir=str(self.path))
        told = provenance(training_run, run_ids)
        self.writer.add_text(
            "trajstore/provenance", "\n\n".join(f"{k}: {v}" for k, v in told.items()), 0
        )

    def log(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        """One scalar per metric at `step` (NaN and infinities included, as TensorBoard shows
        them), written out at once: a step takes seconds, a reader should not wait 2 minutes."""
        for name, value in metrics.items():
            self.writer.add_scalar(f"{prefix}/{name}", float(value), step)
        self.writer.flush()

    def close(self) -> None:
        """Write out and close the event file."""
        self.writer.close()


class WandbSink:
    """A W&B run named after the training run, its provenance in the config and tags."""

    def __init__(
        self, project: str, training_run: str, run_ids: Sequence[str], directory: Path | None
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise TrainerError(
                "--wandb-project needs wandb: pip install 'trajstore[wandb]' "
                "(WANDB_MODE=offline works without a network or an account)"
            ) from exc
        self.run = wandb.init(
            project=project,
            name=training_run,
            group=run_ids[0] if len(run_ids) == 1 else None,
            tags=[f"run:{run_id}" for run_id in run_ids][:64],
            config=provenance(training_run, run_ids),
            dir=None if directory is None else str(directory),
            reinit="create_new",
        )

    def log(self, step: int, metrics: Mapping[str, float], prefix: str) -> None:
        """One W&B history row at `step` (non-finite values left out: W&B refuses NaN)."""
        row = {f"{prefix}/{k}": float(v) for k, v in metrics.items() if math.isfinite(v)}
        self.run.log(row, step=step)

    def close(self) -> None:
        """Finish the run (offline: its files are complete on disk)."""
        self.run.finish()


class MetricsLog:
    """Each step's metrics, to every configured sink; a no-op with none."""

    def __init__(self, sinks: Sequence[MetricsSink] = ()) -> None:
        self.sinks = list(sinks)

    def step(self, step: int, metrics: Mapping[str, float], prefix: str = "train") -> None:
        """Report one training step (`tokens_per_second` added when it can be)."""
        numbers = {k: v for k, v in with_throughput(metrics).items() if _is_number(v)}
        for sink in self.sinks:
            sink.log(step, numbers, prefix)

    def close(self) -> None:
        """Close every sink."""
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


async def export_ledger(store: EventStore, training_run: str, metrics_log: MetricsLog) -> int:
    """Report every step the ledger holds of `training_run` (its recorded metrics) to
    `metrics_log`: the curves of a run trained before any sink was configured. Returns how many
    steps; `TrainerError` when the ledger has none."""
    events = await store.read_stream(training_stream(training_run))
    if not events:
        raise TrainerError(f"no training run {training_run!r} in the ledger")
    for event in events:
        metrics_log.step(event.stream_version, TrainingStep.read(event.payload).metrics)
    return len(events)


def ledger_run_ids(step: TrainingStep) -> list[str]:
    """The trajectories' run ids a recorded step names (its replay selection's), if any."""
    selection = step.replay.get("selection") or {}
    return [str(run) for run in selection.get("runs") or ()]


def open_metrics_log(
    training_run: str,
    run_ids: Sequence[str],
    *,
    tensorboard_dir: Path | str | None = None,
    wandb_project: str | None = None,
    wandb_dir: Path | None = None,
) -> MetricsLog:
    """The metrics log the flags (or, unset, their environment variables) ask for."""
    tensorboard_dir = tensorboard_dir or os.environ.get(TENSORBOARD_DIR_ENV) or None
    wandb_project = wandb_project or os.environ.get(WANDB_PROJECT_ENV) or None
    sinks: list[MetricsSink] = []
    if tensorboard_dir is not None:
        sinks.append(TensorBoardSink(Path(tensorboard_dir), training_run, run_ids))
    if wandb_project is not None:
        sinks.append(WandbSink(wandb_project, training_run, run_ids, wandb_dir))
    return MetricsLog(sinks)
