"""The `trajstore` command: the root of the command line, where every part adds its commands.

Each part exports its own (`commands` in `store.cli`, `proxy.cli`, `trainer.cli`, `viewer.cli`);
the room adds `up`, `demo`, `run` and `train`. The store's are added now; the others load on
first use (`store.lazy_group`), which keeps `trajstore --help` fast and lets a store-only install
(no torch, no vLLM, no FastAPI) run the store's commands; a command whose part is missing says so.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import click

from trajstore.store import cli as store_cli
from trajstore.store.errors import StoreError
from trajstore.store.lazy_group import LazyGroup
from trajstore.store.settings import StoreSettings

#: Commands of the parts above the store, loaded on first use: "module" (the command of that
#: name in the module's `commands`) or "module:attribute".
LAZY_COMMANDS = {
    "proxy": "trajstore.proxy.cli",
    "relay": "trajstore.proxy.cli",
    "replay": "trajstore.trainer.cli",
    "ui": "trajstore.viewer.cli",
    "up": "trajstore.stack:up",
    "demo": "trajstore.demo:demo",
    "run": "trajstore.run_cli:run",
    "train": "trajstore.train_cli:train",
    "score": "trajstore.teacher:score",
}


class TrajstoreGroup(LazyGroup):
    """The `trajstore` group: commands of optional packages load lazily, and store errors
    become one clear line instead of a traceback."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc


@click.group(cls=TrajstoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--database-url",
    envvar="TRAJSTORE_DATABASE_URL",
    show_envvar=True,
    help="PostgreSQL URL. Unset: a private server in the data directory.",
)
@click.option(
    "--data-dir",
    envvar="TRAJSTORE_DATA_DIR",
    show_envvar=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the embedded PostgreSQL.",
)
@click.option(
    "--embedded-port",
    envvar="TRAJSTORE_EMBEDDED_PORT",
    show_envvar=True,
    type=int,
    help="TCP port of the embedded PostgreSQL on 127.0.0.1 [default: 54329].",
)
@click.option("-v", "--verbose", is_flag=True, help="Log what happens.")
@click.pass_context
def main(
    ctx: click.Context,
    database_url: str | None,
    data_dir: Path | None,
    embedded_port: int | None,
    verbose: bool,
) -> None:
    """trajstore: record what agents say to a model, token for token, and replay it."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, stream=sys.stderr)
    overrides: dict[str, Any] = {}
    if database_url:
        overrides["database_url"] = database_url
    if data_dir:
        overrides["data_dir"] = data_dir
    if embedded_port:
        overrides["embedded_port"] = embedded_port
    ctx.ensure_object(dict)["settings"] = StoreSettings(**overrides)


main.lazy.update(LAZY_COMMANDS)
for _command in store_cli.commands:
    main.add_command(_command)

__all__ = ["main"]
