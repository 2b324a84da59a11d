"""The `trajstore` command line.

The store's own commands live here (`db`, `migrate`); the proxy and the trainer add theirs when
they are installed (see `_PLUGIN_COMMANDS`), so a store-only install needs neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import click

from store.embedded import EmbeddedPostgres, database_url
from store.errors import StoreError
from store.settings import StoreSettings

#: Commands provided by other packages: name -> "module:attribute", imported on first use.
_PLUGIN_COMMANDS: dict[str, str] = {
    "proxy": "proxy.cli:proxy",
    "up": "proxy.stack:up",
    "replay": "trainer.cli:replay",
    "demo": "trainer.demo:demo",
}


class TrajstoreGroup(click.Group):
    """A click group that loads commands of optional packages lazily and turns store errors
    into one clear line instead of a traceback."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *_PLUGIN_COMMANDS])

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in _PLUGIN_COMMANDS:
            module, _, attribute = _PLUGIN_COMMANDS[name].partition(":")
            try:
                command: click.Command = getattr(importlib.import_module(module), attribute)
            except ImportError as exc:
                raise click.ClickException(
                    f"`trajstore {name}` needs an optional part that is not installed ({exc})"
                ) from exc
            return command
        return super().get_command(ctx, name)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StoreError as exc:
            raise click.ClickException(str(exc)) from exc


def _settings(ctx: click.Context) -> StoreSettings:
    settings: StoreSettings = ctx.ensure_object(dict)["settings"]
    return settings


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


@main.group()
def db() -> None:
    """The embedded PostgreSQL server (used when no database URL is set)."""


@db.command("start")
@click.pass_context
def db_start(ctx: click.Context) -> None:
    """Start the private server (creating it the first time); harmless when it runs."""
    server = EmbeddedPostgres.from_settings(_settings(ctx))
    url = server.start()
    state = "already running" if server.reused else "started"
    click.echo(f"embedded PostgreSQL {state} in {server.data_dir} (port {server.port})")
    click.echo(url)


@db.command("stop")
@click.pass_context
def db_stop(ctx: click.Context) -> None:
    """Stop the private server."""
    server = EmbeddedPostgres.from_settings(_settings(ctx))
    click.echo("stopped" if server.stop() else "not running")


@db.command("status")
@click.pass_context
def db_status(ctx: click.Context) -> None:
    """Say whether the private server runs; exit 3 when it does not (like pg_ctl)."""
    status = EmbeddedPostgres.from_settings(_settings(ctx)).status()
    if status.running:
        click.echo(f"running (pid {status.pid}) in {status.data_dir}\n{status.url}")
        return
    state = "stopped" if status.initialised else "not initialised"
    click.echo(f"{state} in {status.data_dir}")
    ctx.exit(3)


@db.command("url")
@click.option("--tcp", is_flag=True, help="The TCP URL (with password) instead of the socket's.")
@click.pass_context
def db_url(ctx: click.Context, tcp: bool) -> None:
    """Print the database URL (the configured one, or the embedded server's)."""
    settings = _settings(ctx)
    if settings.database_url:
        click.echo(settings.database_url)
        return
    server = EmbeddedPostgres.from_settings(settings)
    click.echo(server.tcp_url() if tcp else server.url())


@main.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.pass_context
def migrate(ctx: click.Context, revision: str) -> None:
    """Apply schema migrations (starting the embedded server if it is the store)."""
    from store import migrations

    url = database_url(_settings(ctx))
    migrations.upgrade(url, revision)
    click.echo(f"migrated to {revision}")


@main.command()
@click.option("--once", is_flag=True, help="Project what is there, then exit.")
@click.option("--poll-interval", default=1.0, show_default=True, help="Seconds between polls.")
@click.pass_context
def project(ctx: click.Context, once: bool, poll_interval: float) -> None:
    """Turn finished sessions into training samples (the `samples` table), live."""
    import asyncio

    from store.eventstore import EventStore
    from store.projection import Projector

    async def run() -> None:
        async with await EventStore.open(database_url(_settings(ctx))) as store:
            projector = Projector(store)
            if once:
                click.echo(f"projected {await projector.run_once()} sessions")
            else:
                click.echo("projecting finished sessions into samples; Ctrl-C stops")
                await projector.run_forever(poll_interval)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the live projector stops
        asyncio.run(run())
