"""A click group whose commands load on first use: `trajstore --help` stays fast, and a command
whose optional part is not installed says so instead of breaking the others."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """A click group whose commands named in `lazy` are imported on first use, so `--help` stays
    fast and an optional part that is missing says so. A value is "module:attribute", or
    "module": the command of that name in the module's `commands` list."""

    def __init__(self, *args: Any, lazy: Mapping[str, str] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.lazy:
            module, _, attribute = self.lazy[name].partition(":")
            try:
                command = _command(importlib.import_module(module), attribute or name)
            except ImportError as exc:
                raise click.ClickException(
                    f"`{ctx.command_path} {name}` needs an optional part that is not installed "
                    f"({exc})"
                ) from exc
            return command
        return super().get_command(ctx, name)


def _command(module: Any, name: str) -> click.Command:
    """The command `name` of a module: its attribute of that name, else the one of that name in
    its `commands` list (what each part's `cli` module exports)."""
    for command in getattr(module, "commands", []):
        if command.name == name:
            found: click.Command = command
            return found
    found = getattr(module, name)
    return found
