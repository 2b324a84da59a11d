"""The store's commands of the `trajstore` command line (`db`, `migrate`, `project`, `sql`, ...).

The command itself is `trajstore.cli.main`, which adds these (`commands`) and the other parts'.
Each reads the store settings the root made from its options (`store_settings_of`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from trajstore.store.embedded import EmbeddedPostgres, database_url, role_database_url
from trajstore.store.errors import StoreError
from trajstore.store.eventstore import EventStore
from trajstore.store.roles import PROJECTOR_ROLE, Role
from trajstore.store.settings import store_settings_of


@click.group()
def db() -> None:
    """The embedded PostgreSQL server (used when no database URL is set)."""


@db.command("start")
@click.pass_context
def db_start(ctx: click.Context) -> None:
    """Start the private server (creating it the first time); harmless when it runs."""
    server = EmbeddedPostgres.from_settings(store_settings_of(ctx))
    url = server.start()
    state = "already running" if server.reused else "started"
    click.echo(f"embedded PostgreSQL {state} in {server.data_dir} (port {server.port})")
    click.echo(url)


@db.command("stop")
@click.pass_context
def db_stop(ctx: click.Context) -> None:
    """Stop the private server."""
    server = EmbeddedPostgres.from_settings(store_settings_of(ctx))
    click.echo("stopped" if server.stop() else "not running")


@db.command("status")
@click.pass_context
def db_status(ctx: click.Context) -> None:
    """Say whether the private server runs; exit 3 when it does not (like pg_ctl)."""
    status = EmbeddedPostgres.from_settings(store_settings_of(ctx)).status()
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
    settings = store_settings_of(ctx)
    if settings.database_url:
        click.echo(settings.database_url)
        return
    server = EmbeddedPostgres.from_settings(settings)
    click.echo(server.tcp_url() if tcp else server.url())


@click.command()
@click.option("--revision", default="head", show_default=True, help="Target revision.")
@click.option(
    "--recorder-password", envvar="TRAJSTORE_RECORDER_DB_PASSWORD", show_envvar=True,
    help="Set the password of the proxy's role, trajstore_recorder (for servers that do not "
    "trust local connections).",
)  # fmt: skip
@click.option(
    "--projector-password", envvar="TRAJSTORE_PROJECTOR_DB_PASSWORD", show_envvar=True,
    help="Set the password of the projector's role, trajstore_projector.",
)  # fmt: skip
@click.pass_context
def migrate(
    ctx: click.Context,
    revision: str,
    recorder_password: str | None,
    projector_password: str | None,
) -> None:
    """Apply schema migrations (starting the embedded server if it is the store), as the
    database URL's user; optionally give the processes' roles their passwords (`store.roles`)."""
    import asyncio

    from trajstore.store import migrations, roles

    url = database_url(store_settings_of(ctx))
    migrations.upgrade(url, revision)
    click.echo(f"migrated to {revision}")
    if revision == "head":
        # The log's daily partitions, today's and a month ahead (`trajstore partitions`).
        from trajstore.store.partitions import ensure_partitions_at

        created = asyncio.run(ensure_partitions_at(url))
        click.echo(f"created {len(created)} daily partitions of events")
    passwords = {roles.RECORDER_ROLE: recorder_password, roles.PROJECTOR_ROLE: projector_password}
    for role, password in passwords.items():
        if password:
            asyncio.run(roles.set_password(url, role, password))
            click.echo(f"set the password of {role}")
    settings = store_settings_of(ctx)
    url_files = {
        roles.RECORDER_ROLE: settings.recorder_database_url_file,
        roles.PROJECTOR_ROLE: settings.projector_database_url_file,
    }
    for role, path in url_files.items():
        if path is not None:
            roles.write_url_file(url, role, path)
            click.echo(f"wrote the URL of {role} to {path}")


@click.command()
@click.option("--once", is_flag=True, help="Project what is there, then exit.")
@click.option(
    "--rebuild",
    is_flag=True,
    help="Rebuild from event 0 into a new version (readers keep the old one meanwhile), then "
    "switch readers to it, and exit.",
)
@click.option("--poll-interval", default=1.0, show_default=True, help="Seconds between polls.")
@click.pass_context
def project(ctx: click.Context, once: bool, rebuild: bool, poll_interval: float) -> None:
    """Turn finished sessions into training samples (the `samples` table), live."""
    from trajstore.store.projection import Projector

    async def run(store: EventStore) -> None:
        projector = Projector(store)
        if rebuild:
            with _progress() as bar:
                task = bar.add_task("rebuilding samples", total=None)
                version = await projector.rebuild(
                    lambda done, total: bar.update(task, completed=done, total=total)
                )
            click.echo(f"rebuilt the samples projection as version {version}; readers use it now")
        elif once:
            click.echo(f"projected {await projector.run_once()} sessions")
        else:
            click.echo("projecting finished sessions into samples; Ctrl-C stops")
            await projector.run_forever(poll_interval)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how the live projector stops
        _run_with_store(ctx, run, PROJECTOR_ROLE)


@click.command()
@click.argument("query", required=False)
@click.option("--max-width", default=60, show_default=True, help="Cut longer cells to this.")
@click.pass_context
def sql(ctx: click.Context, query: str | None, max_width: int) -> None:
    """Run a read-only QUERY and print a table; with no QUERY, open psql on the store.

    The views `trajectories`, `turns` and the `samples` table are documented in the README.
    """
    url = database_url(store_settings_of(ctx))
    if query is None:
        _exec_psql(url)
    from trajstore.store.sql import print_query

    async def run(store: EventStore) -> None:
        await print_query(store, query, max_width=max_width)

    _run_with_store(ctx, run)


@click.command()
@click.option("--run", "runs", multiple=True, help="Only this run (repeatable). Default: all.")
@click.option(
    "--status",
    "statuses",
    multiple=True,
    default=["completed"],
    show_default=True,
    help="Session statuses to include (repeatable; aborted, error, timeout are left out "
    "unless asked for).",
)
@click.option(
    "--format", "fmt", type=click.Choice(["parquet", "jsonl"]), default="parquet",
    show_default=True,
)  # fmt: skip
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Output file [default: samples.parquet or samples.jsonl].",
)
@click.option(
    "--images",
    "images_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Also write the samples' images (data URLs) into this directory, once each, as files "
    "named by their sha256 (the `images` column's).",
)
@click.option(
    "--archive",
    "archive_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="A `trajstore archive` directory: the messages of samples whose days were archived "
    "are read from it.",
)
@click.pass_context
def export(
    ctx: click.Context,
    runs: tuple[str, ...],
    statuses: tuple[str, ...],
    fmt: str,
    out: Path | None,
    images_dir: Path | None,
    archive_dir: Path | None,
) -> None:
    """Write samples to Parquet or JSON Lines, one record per sample."""
    from trajstore.store import export as exporting

    path = out or Path(f"samples.{fmt}")

    async def run(store: EventStore) -> None:
        total = await exporting.count(store, list(runs), list(statuses))
        with _progress() as bar:
            task = bar.add_task(f"exporting to {path}", total=total)
            written = await exporting.export(
                store, path, fmt=fmt, runs=list(runs), statuses=list(statuses),
                progress=lambda n: bar.advance(task, n), images_dir=images_dir,
                archive=archive_dir,
            )  # fmt: skip
        click.echo(f"wrote {written} samples to {path}")
        if images_dir is not None:
            click.echo(f"their images are in {images_dir}, one file per sha256")

    _run_with_store(ctx, run)


@click.command()
@click.option(
    "--days-ahead", default=31, show_default=True, envvar="TRAJSTORE_PARTITION_DAYS_AHEAD",
    show_envvar=True, help="Create the partitions of today and this many days more.",
)  # fmt: skip
@click.option(
    "--every", type=float, envvar="TRAJSTORE_PARTITION_EVERY", show_envvar=True,
    help="Keep running: do it again every this many seconds (unset: once, then list them).",
)  # fmt: skip
@click.pass_context
def partitions(ctx: click.Context, days_ahead: int, every: float | None) -> None:
    """Create the daily partitions of the log ahead of time, and list them (run it daily)."""
    import asyncio

    from trajstore.store import partitions as partitioning

    async def run(store: EventStore) -> None:
        while True:
            async with store.pool.acquire() as conn:
                created = await partitioning.ensure_partitions(conn, days_ahead=days_ahead)
                for name in created:
                    click.echo(f"created {name}")
                if every is None:
                    for p in await partitioning.list_partitions(conn):
                        click.echo(f"{p.name}\t{p.day or 'default'}\t{p.bytes} bytes")
                    return
            await asyncio.sleep(every)

    _run_with_store(ctx, run)


@click.group(invoke_without_command=True)
@click.option(
    "--before", type=click.DateTime(["%Y-%m-%d"]),
    help="Archive the daily partitions wholly before this UTC date (YYYY-MM-DD).",
)  # fmt: skip
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the archive: one Parquet file per partition and manifest.json.",
)  # fmt: skip
@click.option("--keep", is_flag=True, help="Detach the partitions but do not drop them.")
@click.pass_context
def archive(ctx: click.Context, before: Any, out: Path | None, keep: bool) -> None:
    """Move whole days of the log to Parquet, verified, then detach and drop them.

    Refuses a day that holds an event of a session still active; drops nothing unless every
    file read back complete. `trajstore archive show DIR SESSION_ID` rebuilds an archived
    session.
    """
    if ctx.invoked_subcommand is not None:
        return
    if before is None or out is None:
        raise click.UsageError("archive needs --before DATE and --out DIR (or: archive show)")
    from trajstore.store import archive as archiving

    async def run(store: EventStore) -> None:
        result = await archiving.archive(store, before.date(), out, keep=keep)
        if not result.partitions:
            click.echo(f"no partition lies wholly before {before.date()}")
        for p in result.partitions:
            done = "dropped" if result.dropped else "detached (kept)"
            click.echo(f"{p.name}: {p.rows} events to {out / p.file}, verified; {done}")

    _run_with_store(ctx, run)


@archive.command("show")
@click.argument("directory", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.argument("session_id")
@click.option(
    "--what", type=click.Choice(["timeline", "samples"]), default="timeline", show_default=True
)
@click.pass_context
def archive_show(ctx: click.Context, directory: Path, session_id: str, what: str) -> None:
    """Rebuild SESSION_ID from the archive in DIRECTORY (and the log's later events), as JSON
    Lines: one timeline entry, or one sample, a line (written as they go)."""
    import orjson

    from trajstore.store import archive as archiving

    async def run(store: EventStore) -> None:
        live = await store.read_session(session_id)
        rebuilt = archiving.rebuild_archived_session(directory, session_id, live)
        items = rebuilt.timeline if what == "timeline" else rebuilt.samples
        for item in items:
            click.echo(orjson.dumps(item.as_json(), default=str))

    _run_with_store(ctx, run)


def _run_with_store(
    ctx: click.Context, body: Callable[[EventStore], Awaitable[None]], role: Role | None = None
) -> None:
    """Open the store (starting the embedded server when it is the store), run `body`, close;
    as `role` when given (`store.roles`), else as the configured user."""
    import asyncio

    settings = store_settings_of(ctx)
    url = database_url(settings) if role is None else role_database_url(role, settings)

    async def run() -> None:
        async with await EventStore.open(url) as store:
            await body(store)

    asyncio.run(run())


def _progress() -> Any:
    """A progress bar on stderr (stdout stays for results)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def _exec_psql(url: str) -> NoReturn:
    """Replace this process with psql on `url` (the machine's psql, else the embedded one's)."""
    import os
    import shutil

    from trajstore.store.postgres_host import find_binaries

    psql = shutil.which("psql")
    if psql is None:
        try:
            psql = str(find_binaries() / "psql")
        except StoreError as exc:
            raise click.ClickException(
                f'psql is not installed ({exc}); give a query: trajstore sql "SELECT ..."'
            ) from exc
    os.execv(psql, [psql, url])


#: What the root of the command line (`trajstore.cli`) adds from the store.
commands: list[click.Command] = [db, migrate, project, sql, export, partitions, archive]
