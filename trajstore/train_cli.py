"""`trajstore train`: the live loop on one machine (database, vLLM, proxy, agents, trainer).

    trajstore train [--policies 8] [--batch-size 16] [--group-size 8] [--max-lag 0] [--no-tis]
                    [--eval-sessions 64] [--device auto] [--run-id R]

Starts what `up` starts, but its own vLLM: on a copy of the generated tiny model whose output
layer is not tied to its embeddings (so that in-place reloads are exact, `trajstore.publish`),
with vLLM's development endpoints on (`VLLM_SERVER_DEV_MODE=1`: /pause, /resume,
/collective_rpc). Then: `--eval-sessions` sessions on policy v0, the live loop
(`trajstore.live`), the same number on the last policy, and the difference.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:  # torch and the trainer load on use: `trajstore --help` stays fast
    from trajstore.live import LiveConfig
    from trajstore.teacher import Teacher
    from trajstore.trainer.learner import LearnerConfig
    from trajstore.trainer.metrics_log import MetricsLog

SERVED_NAME = "tiny"


@dataclass
class LiveServices:
    """A running engine with its dev endpoints, a proxy and projector in front of it."""

    database_url: str
    engine_url: str
    proxy_url: str
    model_dir: Path  #: the untied copy the engine serves (policy v0)
    publish_dir: Path


@contextlib.asynccontextmanager
async def live_services(
    database_url: str,
    base_model: Path,
    work_dir: Path,
    log_file: Path | None = None,
    *,
    engine_port: int = 8600,
    proxy_port: int = 8700,
) -> AsyncIterator[LiveServices]:
    """Serve `base_model` (untied) on a dev-mode vLLM, and a proxy + projector on `database_url`
    (each on the first free port from `engine_port`, `proxy_port`: vLLM binds with SO_REUSEPORT,
    so two stacks that pick one port serve each other's requests; give each its own range)."""
    from trajstore.proxy.options import free_port_from, proxy_settings
    from trajstore.publish import untied_copy
    from trajstore.stack import serving
    from trajstore.vllm_server import VllmServer

    model_dir = await asyncio.to_thread(untied_copy, base_model, work_dir / "v0")
    engine = VllmServer(
        model_dir, free_port_from("127.0.0.1", engine_port), served_model_name=SERVED_NAME,
        log_file=log_file, env={"VLLM_SERVER_DEV_MODE": "1"},
    )  # fmt: skip
    engine_url = await asyncio.to_thread(engine.start)
    try:
        settings = proxy_settings([engine_url], "127.0.0.1", proxy_port, True, None, "0")
        async with serving(settings, database_url, poll_interval=0.1) as running:
            yield LiveServices(database_url, engine_url, running.url, model_dir, work_dir)
    finally:
        await asyncio.to_thread(engine.stop)


async def run_config(
    services: LiveServices,
    config: LiveConfig,
    learner_config: LearnerConfig,
    *,
    run_id: str,
    eval_sessions: int,
    on_step: Callable[[dict[str, float]], None] | None = None,
    checkpoint_dir: Path | None = None,
    metrics_log: MetricsLog | None = None,
    teacher: Teacher | None = None,
) -> dict[str, object]:
    """One live run from policy v0: eval on v0, train `config.policies` versions, eval again.

    The engine is reset to v0's weights first, so runs in one process start alike. With
    `metrics_log`, each step's metrics and the two evaluations' mean rewards (`eval/`, at step
    0 and at the last version) are reported there too. With a `teacher` (and
    `learner_config.distill` naming it), a scorer follows the run meanwhile
    (`trajstore.teacher.follow`) and the learner distills from its scores.
    """
    from trajstore.client import AsyncClient
    from trajstore.live import AgentPool, train_live
    from trajstore.publish import Publisher
    from trajstore.store.eventstore import EventStore
    from trajstore.trainer.learner import Learner

    publisher = Publisher(services.engine_url, services.proxy_url, services.publish_dir / run_id)
    learner = await asyncio.to_thread(Learner.load, services.model_dir, learner_config)
    try:
        await publisher.load(services.model_dir, 0)
        async with (
            AsyncClient(services.proxy_url, timeout=120) as client,
            await EventStore.open(services.database_url) as store,
        ):
            agents = AgentPool(client, SERVED_NAME, run_id, config)
            before = await agents.evaluate(f"{run_id}-eval-v0", eval_sessions)
            _report_eval(metrics_log, 0, before)
            scoring = None
            if teacher is not None:
                from trajstore.teacher import follow

                scoring = asyncio.create_task(follow(store, teacher, [run_id], poll_interval=0.2))
            try:
                history = await train_live(
                    store, learner, publisher, config, run_id=run_id, training_run=run_id,
                    agents=agents, checkpoint_dir=checkpoint_dir, on_step=on_step,
                    metrics_log=metrics_log,
                )  # fmt: skip
            finally:
                if scoring is not None:
                    scoring.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await scoring
            after = await agents.evaluate(f"{run_id}-eval-v{config.policies}", eval_sessions)
            _report_eval(metrics_log, config.policies, after)
    finally:
        await publisher.close()
    return {"before": before, "after": after, "history": history}


def _report_eval(metrics_log: MetricsLog | None, version: int, rewards: list[float]) -> None:
    """An evaluation's mean reward (and its standard error) at policy `version`."""
    from trajstore.live import summary

    if metrics_log is not None and rewards:
        mean, se = summary(rewards)
        metrics_log.step(version, {"reward_mean": mean, "reward_se": se}, prefix="eval")


def report(result: dict[str, object], policies: int) -> str:
    """v_k against v_0: means, the difference and its standard error."""
    from trajstore.live import summary

    (m0, se0), (mk, sek) = summary(result["before"]), summary(result["after"])  # type: ignore[arg-type]
    diff, se = mk - m0, (se0**2 + sek**2) ** 0.5
    n = len(result["before"])  # type: ignore[arg-type]
    return (
        f"v0 {m0:.3f} ± {se0:.3f}   v{policies} {mk:.3f} ± {sek:.3f}   ({n} sessions each)\n"
        f"difference {diff:+.3f} ± {se:.3f} (standard error): {diff / se if se else 0:.1f} SE"
    )


@click.command("train")
@click.option("--policies", default=8, show_default=True, help="Policy versions to train.")
@click.option("--batch-size", default=16, show_default=True, help="Sessions per step.")
@click.option("--group-size", default=8, show_default=True, help="Sessions per question.")
@click.option("--max-lag", default=0, show_default=True,
              help="Policy versions a batch may be behind (0: on-policy).")  # fmt: skip
@click.option("--tis/--no-tis", default=True, show_default=True,
              help="Truncated importance weights against the engine's logprobs.")  # fmt: skip
@click.option("--lr", default=2e-2, show_default=True, help="AdamW learning rate.")
@click.option("--eval-sessions", default=64, show_default=True,
              help="Sessions on v0 and on the last policy, not trained on.")  # fmt: skip
@click.option("--device", default="auto", show_default=True, help="auto | cuda | cpu")
@click.option("--run-id", default=None, help="Run id of the sessions [default: live-<random>].")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Checkpoint every step; resume from the last one there.")  # fmt: skip
@click.option("--tensorboard-dir", type=click.Path(file_okay=False, path_type=Path),
              envvar="TRAJSTORE_TENSORBOARD_DIR", show_envvar=True,
              help="Write TensorBoard event files of the metrics under DIR/RUN_ID.")  # fmt: skip
@click.option("--wandb-project", envvar="TRAJSTORE_WANDB_PROJECT", show_envvar=True,
              help="Report the metrics to this W&B project too (WANDB_MODE=offline: no "
              "network needed).")  # fmt: skip
@click.option("--distill-from", "teacher_engine", default=None, metavar="URL",
              help="Distill on-policy from this teacher vLLM engine (same tokenizer).")  # fmt: skip
@click.option("--teacher-model", default="teacher", show_default=True,
              help="The model the teacher engine serves (also its name).")  # fmt: skip
@click.option("--distill-coef", default=1.0, show_default=True,
              help="Weight of the per-token teacher advantage.")  # fmt: skip
@click.option("--grpo-coef", default=1.0, show_default=True,
              help="Weight of GRPO's advantage when distilling (0: none).")  # fmt: skip
@click.pass_context
def train(
    ctx: click.Context, policies: int, batch_size: int, group_size: int, max_lag: int, tis: bool,
    lr: float, eval_sessions: int, device: str, run_id: str | None, checkpoint_dir: Path | None,
    tensorboard_dir: Path | None, wandb_project: str | None,
    teacher_engine: str | None, teacher_model: str, distill_coef: float, grpo_coef: float,
) -> None:  # fmt: skip
    """Agents through the proxy, trained on live as they finish; each policy published."""
    from trajstore.live import LiveConfig, describe_step
    from trajstore.stack import backends, cached_tiny_model
    from trajstore.store.settings import store_settings_of
    from trajstore.trainer.learner import LearnerConfig
    from trajstore.trainer.metrics_log import open_metrics_log

    if batch_size % group_size:
        raise click.UsageError("--batch-size must be a multiple of --group-size")
    run_id = run_id or f"live-{random.randrange(16**6):06x}"
    settings = store_settings_of(ctx)
    config = LiveConfig(policies=policies, batch_size=batch_size, group_size=group_size,
                        max_lag=max_lag)  # fmt: skip
    teacher, distill = None, None
    if teacher_engine is not None:
        from trajstore.teacher import Teacher
        from trajstore.trainer.distill import DistillConfig

        teacher = Teacher(teacher_model, teacher_engine.rstrip("/"), teacher_model)
        distill = DistillConfig(teacher_model, coef=distill_coef, grpo=grpo_coef)
    learner_config = LearnerConfig(device=device, lr=lr, importance_weights=tis, distill=distill)
    with (
        open_metrics_log(
            run_id, [run_id], tensorboard_dir=tensorboard_dir, wandb_project=wandb_project
        ) as metrics_log,
        backends(settings, [], local_engine=False) as found,
        tempfile.TemporaryDirectory(prefix="trajstore-train-") as work,
    ):
        base = cached_tiny_model(settings.data_dir)
        log_file = settings.data_dir / "vllm-train.log"
        click.echo(f"starting vLLM (dev endpoints) on the tiny model; log {log_file}; about 30 s")

        async def main() -> dict[str, object]:
            async with live_services(found.database_url, base, Path(work), log_file) as services:
                return await run_config(
                    services, config, learner_config, run_id=run_id,
                    eval_sessions=eval_sessions, on_step=lambda m: click.echo(describe_step(m)),
                    checkpoint_dir=checkpoint_dir, metrics_log=metrics_log, teacher=teacher,
                )  # fmt: skip

        result = asyncio.run(main())
    click.echo(report(result, policies))
