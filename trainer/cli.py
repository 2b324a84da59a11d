"""`trajstore replay`: replay a past training step exactly, or a session's timeline.

    trajstore replay --training-run T --step N     the batch of that step, rebuilt bit for bit
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
@click.pass_context
def replay(
    ctx: click.Context, training_run: str | None, step: int | None, out: Path | None
) -> None:
    """Replay a past training step exactly, or a session's timeline (`replay session ID`)."""
    if ctx.invoked_subcommand is not None:
        return
    if training_run is None or step is None:
        raise click.UsageError("give --training-run and --step, or a subcommand (session ID)")
    from trajstore.trainer.ledger import replay_step_command

    replay_step_command(ctx, training_run, step, out)


#: What the root of the command line (`trajstore.cli`) adds from the trainer.
commands: list[click.Command] = [replay]
