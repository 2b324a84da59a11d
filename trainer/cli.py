"""`trajstore replay`: replay a past training step exactly, or a session's timeline.

    trajstore replay --training-run T --step N     the batch of that step, rebuilt bit for bit
    trajstore replay --training-run T --export-metrics --tensorboard-dir DIR
                                                   its steps' metrics to TensorBoard / W&B
    trajstore replay session ID [--against URL]    a session's timeline (and a mismatch check)

Subcommands are imported on first use, so `--help` stays fast and needs no torch.
"""

from __future__ import annotations

from pathlib import Path

import click

from trajstore.store.lazy_group import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={"session": "trajstore.trainer.timeline:session"},
    invoke_without_command=True,
)
@click.option("--training-run", help="The training run whose step to rebuild.")
@click.option("--step", type=int, help="The step to rebuild.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also save the rebuilt batch (a TensorDict, torch.save format) to this file.",
)
@click.option(
    "--export-metrics",
    is_flag=True,
    help="Report every recorded step's metrics of --training-run to --tensorboard-dir and/or "
    "--wandb-project (a run trained before they were set).",
)
@click.option(
    "--tensorboard-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="TRAJSTORE_TENSORBOARD_DIR",
    show_envvar=True,
    help="Write TensorBoard event files under DIR/TRAINING_RUN.",
)
@click.option(
    "--wandb-project",
    envvar="TRAJSTORE_WANDB_PROJECT",
    show_envvar=True,
    help="Report to this W&B project (WANDB_MODE=offline: no network needed).",
)
@click.pass_context
def replay(
    ctx: click.Context,
    training_run: str | None,
    step: int | None,
    out: Path | None,
    export_metrics: bool,
    tensorboard_dir: Path | None,
    wandb_project: str | None,
) -> None:
    """Replay a past training step exactly, or a session's timeline (`replay session ID`)."""
    if ctx.invoked_subcommand is not None:
        return
    if export_metrics:
        if training_run is None or (tensorboard_dir is None and wandb_project is None):
            raise click.UsageError(
                "--export-metrics needs --training-run and --tensorboard-dir or --wandb-project"
            )
        _export_metrics(ctx, training_run, tensorboard_dir, wandb_project)
        return
    if training_run is None or step is None:
        raise click.UsageError("give --training-run and --step, or a subcommand (session ID)")
    from trajstore.trainer.ledger import replay_step_command

    replay_step_command(ctx, training_run, step, out)


def _export_metrics(
    ctx: click.Context, training_run: str, tensorboard_dir: Path | None, wandb_project: str | None
) -> None:
    """`replay --training-run T --export-metrics`: the ledger's steps to the sinks."""
    import asyncio

    from trajstore.store.embedded import database_url
    from trajstore.trainer.errors import TrainerError
    from trajstore.trainer.index import open_store
    from trajstore.trainer.ledger import read_step
    from trajstore.trainer.metrics_log import export_ledger, ledger_run_ids, open_metrics_log

    settings = ctx.find_root().ensure_object(dict)["settings"]

    async def run() -> int:
        async with open_store(database_url(settings)) as store:
            run_ids = ledger_run_ids(await read_step(store, training_run, 1))
            with open_metrics_log(
                training_run, run_ids, tensorboard_dir=tensorboard_dir,
                wandb_project=wandb_project,
            ) as metrics_log:  # fmt: skip
                return await export_ledger(store, training_run, metrics_log)

    try:
        steps = asyncio.run(run())
    except TrainerError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"reported {steps} steps of training run {training_run!r}")


#: What the root of the command line (`trajstore.cli`) adds from the trainer.
commands: list[click.Command] = [replay]
