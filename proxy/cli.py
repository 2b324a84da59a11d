"""The proxy's commands of the `trajstore` command line: `proxy` and `relay` (`commands`)."""

from __future__ import annotations

import click

from trajstore.proxy.options import ProxyOptions, proxy_options
from trajstore.store.embedded import role_database_url
from trajstore.store.roles import RECORDER_ROLE
from trajstore.store.settings import store_settings_of


@click.command("proxy")
@proxy_options
@click.pass_context
def proxy(ctx: click.Context, options: ProxyOptions) -> None:
    """Run the recording proxy: an OpenAI-compatible gateway that records every token."""
    import uvicorn

    from trajstore.proxy.app import create_app
    from trajstore.proxy.server import SERVER_OPTIONS

    urls = options.engine_urls()
    if not urls and not options.relays_only:
        raise click.UsageError(
            "name at least one engine: --engine http://HOST:PORT (or pass --relays-only to "
            "serve only engines that dial in with trajstore relay)"
        )
    settings = options.settings()
    app = create_app(settings, role_database_url(RECORDER_ROLE, store_settings_of(ctx)))
    served = ", ".join(urls) or "engines that dial in at /engines/connect"
    click.echo(f"trajstore proxy on http://{options.host}:{settings.port} -> {served}")
    uvicorn.run(app, host=options.host, port=settings.port, log_level="warning",
                access_log=False, **SERVER_OPTIONS)  # fmt: skip


@click.command("relay")
@click.option("--proxy", "proxy_url", required=True, envvar="TRAJSTORE_RELAY_PROXY",
              show_envvar=True,
              help="The proxy's URL, e.g. https://proxy.example:8400.")  # fmt: skip
@click.option("--engine", "engine_url", default="http://127.0.0.1:8000", show_default=True,
              envvar="TRAJSTORE_RELAY_ENGINE", show_envvar=True,
              help="Base URL of the local engine (vLLM OpenAI server).")  # fmt: skip
@click.option("--token", envvar="TRAJSTORE_RELAY_TOKEN", show_envvar=True,
              help="The proxy's admin key or one of its TRAJSTORE_RELAY_TOKENS.")  # fmt: skip
@click.option("--name", envvar="TRAJSTORE_RELAY_NAME", show_envvar=True,
              help="The engine's name at the proxy, relay://NAME "
                   "[default: HOST-ENGINEPORT].")  # fmt: skip
@click.option("--health-interval", type=float, default=5.0, show_default=True,
              envvar="TRAJSTORE_RELAY_HEALTH_INTERVAL", show_envvar=True,
              help="Seconds between two checks of the engine's /health.")  # fmt: skip
def relay(
    proxy_url: str, engine_url: str, token: str | None, name: str | None, health_interval: float
) -> None:
    """Run beside an engine the proxy cannot reach, and dial in to the proxy: the proxy routes
    requests to the engine over one WebSocket, which reconnects with backoff."""
    import asyncio
    import logging

    from trajstore.proxy.relay import Relay, RelayRefused
    from trajstore.proxy.relay_protocol import ProtocolError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        dialler = Relay(proxy_url, engine_url, token, name, health_interval=health_interval)
    except ProtocolError as exc:
        raise click.BadParameter(str(exc), param_hint="--name") from None
    click.echo(f"trajstore relay: {dialler.engine_url} -> {proxy_url} as relay://{dialler.name}")
    try:
        try:
            import uvloop  # uvicorn[standard] brings it; the proxy runs on it too
        except ImportError:
            asyncio.run(dialler.run())
        else:
            uvloop.run(dialler.run())
    except RelayRefused as exc:
        raise click.ClickException(str(exc)) from None
    except KeyboardInterrupt:
        pass


#: What the root of the command line (`trajstore.cli`) adds from the proxy.
commands: list[click.Command] = [proxy, relay]
