"""`trajstore proxy`: run the recording proxy in front of one or more engines."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from trajstore.store.embedded import port_in_use, role_database_url
from trajstore.store.roles import RECORDER_ROLE
from trajstore.store.settings import StoreSettings

if TYPE_CHECKING:
    from trajstore.proxy.settings import ProxySettings


def free_port_from(host: str, port: int, attempts: int = 50) -> int:
    """The first port from `port` on that nobody listens on."""
    for candidate in range(port, port + attempts):
        if not port_in_use(host, candidate):
            return candidate
    raise click.ClickException(f"no free port in {port}..{port + attempts - 1} on {host}")


def engine_urls(engines: tuple[str, ...] | list[str]) -> list[str]:
    """The engine URLs of repeated --engine options, each of which may be comma-separated."""
    return [u.strip() for e in engines for u in e.split(",") if u.strip()]


def proxy_settings(
    engines: list[str],
    host: str,
    port: int,
    next_free_port: bool,
    public_url: str | None,
    policy_version: str,
) -> ProxySettings:
    """The proxy's settings from its command-line options (and TRAJSTORE_* for the rest)."""
    from trajstore.proxy.settings import ProxySettings

    if port_in_use(host, port):
        if not next_free_port:
            raise click.ClickException(
                f"port {port} on {host} is in use; choose another with --port, "
                "or pass --next-free-port"
            )
        port = free_port_from(host, port)
    return ProxySettings(
        engines=engines, host=host, port=port, public_url=public_url, policy_version=policy_version
    )


def store_settings_of(ctx: click.Context) -> StoreSettings:
    """The store settings the `trajstore` group made from its options."""
    settings: StoreSettings | None = (ctx.find_object(dict) or {}).get("settings")
    return settings or StoreSettings()


@click.command("proxy")
@click.option(
    "--engine", "engines", multiple=True, envvar="TRAJSTORE_ENGINES", show_envvar=True,
    help="Base URL of an engine (vLLM OpenAI server); repeat for several. Env: comma-separated.",
)  # fmt: skip
@click.option("--host", envvar="TRAJSTORE_HOST", show_envvar=True, default="127.0.0.1",
              show_default=True, help="Address to listen on.")  # fmt: skip
@click.option("--port", envvar="TRAJSTORE_PORT", show_envvar=True, default=8400, type=int,
              show_default=True, help="Port to listen on.")  # fmt: skip
@click.option("--next-free-port", is_flag=True,
              help="If the port is taken, use the next free one instead of failing.")  # fmt: skip
@click.option("--public-url", envvar="TRAJSTORE_PUBLIC_URL", show_envvar=True,
              help="URL agents reach the proxy at [default: http://HOST:PORT].")  # fmt: skip
@click.option("--policy-version", envvar="TRAJSTORE_POLICY_VERSION", show_envvar=True,
              default="0", show_default=True, help="Policy version of the engines.")  # fmt: skip
@click.option("--relays-only", is_flag=True,
              help="Start with no --engine: serve only engines whose relays dial in "
                   "(trajstore relay).")  # fmt: skip
@click.pass_context
def proxy(
    ctx: click.Context,
    engines: tuple[str, ...],
    host: str,
    port: int,
    next_free_port: bool,
    public_url: str | None,
    policy_version: str,
    relays_only: bool,
) -> None:
    """Run the recording proxy: an OpenAI-compatible gateway that records every token."""
    import uvicorn

    from trajstore.proxy.app import create_app
    from trajstore.proxy.server import SERVER_OPTIONS

    urls = engine_urls(engines)
    if not urls and not relays_only:
        raise click.UsageError(
            "name at least one engine: --engine http://HOST:PORT (or pass --relays-only to "
            "serve only engines that dial in with trajstore relay)"
        )
    settings = proxy_settings(urls, host, port, next_free_port, public_url, policy_version)
    app = create_app(settings, role_database_url(RECORDER_ROLE, store_settings_of(ctx)))
    served = ", ".join(urls) or "engines that dial in at /engines/connect"
    click.echo(f"trajstore proxy on http://{host}:{settings.port} -> {served}")
    uvicorn.run(
        app, host=host, port=settings.port, log_level="warning", access_log=False, **SERVER_OPTIONS
    )


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
