"""`trajstore replay`: replay a past training step exactly, or a session's timeline.

    trajstore replay --training-run T --step N     the batch of that step, rebuilt bit for bit
    trajstore replay session ID [--against URL]    a session's timeline (and a mismatch check)

Subcommands are imported on first use, so `--help` stays fast and needs no torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import click

#: name -> "module:attribute" of each subcommand.
_SUBCOMMANDS: dict[str, str] = {"session": "trainer.timeline:session"}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_SUBCOMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in _SUBCOMMANDS:
            module, _, attribute = _SUBCOMMANDS[name].partition(":")
            command: click.Command = getattr(importlib.import_module(module), attribute)
            return command
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, invoke_without_command=True)
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
    from trainer.ledger import replay_step_command

    replay_step_command(ctx, training_run, step, out)
