"""The proxy's command-line options and the settings they make, for every command that starts a
proxy (`trajstore proxy`, and the room's `up`, `demo`, `run` and `train`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

import click

from trajstore.store.postgres_host import port_in_use

if TYPE_CHECKING:
    from trajstore.proxy.settings import ProxySettings

R = TypeVar("R")


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


@dataclass(frozen=True)
class ProxyOptions:
    """The proxy's command-line options, as one value (`proxy_options` hands it over)."""

    engines: tuple[str, ...]  #: repeated --engine, each possibly comma-separated
    host: str
    port: int
    next_free_port: bool
    public_url: str | None
    policy_version: str
    relays_only: bool

    def engine_urls(self) -> list[str]:
        """The engines' URLs (`engine_urls`)."""
        return engine_urls(self.engines)

    def settings(self) -> ProxySettings:
        """The proxy's settings (`proxy_settings`)."""
        return proxy_settings(self.engine_urls(), self.host, self.port, self.next_free_port,
                              self.public_url, self.policy_version)  # fmt: skip


def proxy_options(command: Callable[..., R]) -> Callable[..., R]:
    """The options of a command that serves the proxy (`--engine`, `--host`, `--port`,
    `--next-free-port`, `--public-url`, `--policy-version`, `--relays-only`), handed to it as
    one `options: ProxyOptions` argument."""
    names = [field.name for field in fields(ProxyOptions)]

    @functools.wraps(command)
    def with_options(*args: Any, **kwargs: Any) -> R:
        options = ProxyOptions(**{name: kwargs.pop(name) for name in names})
        return command(*args, options=options, **kwargs)

    for option in reversed(_OPTIONS):
        with_options = option(with_options)
    return with_options


# fmt: off
_OPTIONS = [
    click.option("--engine", "engines", multiple=True, envvar="TRAJSTORE_ENGINES",
                 show_envvar=True, help="Base URL of an engine (vLLM OpenAI server); repeat for "
                 "several. Env: comma-separated."),
    click.option("--host", envvar="TRAJSTORE_HOST", show_envvar=True, default="127.0.0.1",
                 show_default=True, help="Address to listen on."),
    click.option("--port", envvar="TRAJSTORE_PORT", show_envvar=True, default=8400, type=int,
                 show_default=True, help="Port to listen on."),
    click.option("--next-free-port", is_flag=True,
                 help="If the port is taken, use the next free one instead of failing."),
    click.option("--public-url", envvar="TRAJSTORE_PUBLIC_URL", show_envvar=True,
                 help="URL agents reach the proxy at [default: http://HOST:PORT]."),
    click.option("--policy-version", envvar="TRAJSTORE_POLICY_VERSION", show_envvar=True,
                 default="0", show_default=True, help="Policy version of the engines."),
    click.option("--relays-only", is_flag=True,
                 help="Start with no --engine: serve only engines whose relays dial in "
                      "(trajstore relay)."),
]
# fmt: on
