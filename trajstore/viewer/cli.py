"""`trajstore ui`: serve the trajectory viewer on the store, read-only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from trajstore.store.embedded import database_url
from trajstore.store.postgres_host import port_in_use
from trajstore.store.settings import StoreSettings
from trajstore.viewer.settings import ViewerSettings

_DEFAULTS = ViewerSettings.model_fields


@click.command("ui")
@click.option("--host", envvar="TRAJSTORE_UI_HOST", show_envvar=True,
              default=_DEFAULTS["host"].default, show_default=True,
              help="Interface to listen on.")  # fmt: skip
@click.option("--port", envvar="TRAJSTORE_UI_PORT", show_envvar=True, type=int,
              default=_DEFAULTS["port"].default, show_default=True,
              help="Port to listen on.")  # fmt: skip
@click.option("--next-free-port", is_flag=True,
              help="If the port is taken, use the next free one instead of failing.")  # fmt: skip
@click.option("--tokenizer", envvar="TRAJSTORE_UI_TOKENIZER", show_envvar=True,
              type=click.Path(exists=True, path_type=Path),
              help="Model directory (or tokenizer.json) for token text [default: the model the "
                   "session's engine reports, else its /detokenize, else ids].")  # fmt: skip
@click.option("--poll-interval", envvar="TRAJSTORE_UI_POLL_INTERVAL", show_envvar=True,
              type=float, default=_DEFAULTS["poll_interval"].default, show_default=True,
              help="Seconds between looks at an active session's log.")  # fmt: skip
@click.pass_context
def ui(ctx: click.Context, host: str, port: int, next_free_port: bool, tokenizer: Path | None,
       poll_interval: float) -> None:  # fmt: skip
    """Serve the trajectory viewer: runs, sessions, turns and every token's logprob.

    Read-only (GET pages on read-only connections) on the store of TRAJSTORE_DATABASE_URL, else
    the embedded server. Ctrl-C stops it.
    """
    import uvicorn

    from trajstore.viewer.app import create_app
    from trajstore.viewer.serving import url_of

    if port_in_use(host, port):
        if not next_free_port:
            raise click.ClickException(f"port {port} on {host} is in use; choose another with "
                                       "--port, or pass --next-free-port")  # fmt: skip
        free = [p for p in range(port + 1, port + 50) if not port_in_use(host, p)]
        if not free:
            raise click.ClickException(f"no free port in {port}..{port + 49} on {host}")
        port = free[0]
    settings = ViewerSettings(host=host, port=port, tokenizer=tokenizer,
                              poll_interval=poll_interval)  # fmt: skip
    store: StoreSettings = (ctx.find_object(dict) or {}).get("settings") or StoreSettings()
    url = database_url(store)
    click.echo(f"viewer: {url_of(settings)}/ (read-only; Ctrl-C stops)")
    options: dict[str, Any] = {"log_level": "warning", "access_log": False}
    uvicorn.run(create_app(url, settings), host=host, port=port, **options)


#: What the root of the command line (`trajstore.cli`) adds from the viewer.
commands: list[click.Command] = [ui]
