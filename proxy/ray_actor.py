"""The recording proxy as a Ray actor: how a Ray-based trainer (verl-style) hosts it.

    from trajstore.proxy.ray_actor import start_proxy_actor, proxy_url

    start_proxy_actor("trajstore-proxy", ProxySettings(engines=[...]), database_url)
    # in any rollout worker, task or actor of the same cluster (and namespace):
    base = proxy_url("trajstore-proxy")      # e.g. http://10.0.0.5:41877
    # POST {base}/sessions, then point the agent's openai client at the session's base_url

The actor is an async Ray actor: Ray runs its methods on one asyncio event loop in the actor's
process, and the proxy (uvicorn serving `proxy.app.create_app`) runs as a task on that same loop,
exactly as under `trajstore proxy`. It listens on a port the OS picks (a socket bound to port 0
and handed to uvicorn, so no other process can take it in between) and advertises the node's IP
address when it listens on every interface, so workers on other nodes can reach it.

The actor is found by name (`ray.get_actor`); with `detached=True` it outlives the driver that
started it (stop it with `ray.kill`), which suits a proxy shared by several training jobs.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import ray
import uvicorn

from trajstore.proxy.app import create_app
from trajstore.proxy.server import SERVER_OPTIONS
from trajstore.proxy.settings import ProxySettings

#: How long `start` waits for the proxy to accept connections (it connects to the store first).
START_TIMEOUT_S = 60.0


class ProxyActor:
    """Serves the recording proxy from inside a Ray actor; `url()` says where."""

    def __init__(self, settings: ProxySettings, database_url: str) -> None:
        self.settings = settings
        self.database_url = database_url
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._url: str | None = None

    async def start(self) -> str:
        """Start serving (once; later calls return the same URL) and return the base URL."""
        if self._url is not None:
            return self._url
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.settings.host, 0))
        port = int(sock.getsockname()[1])
        host = self.settings.host
        if host in ("0.0.0.0", ""):
            host = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]  # reachable
        url = (self.settings.public_url or f"http://{host}:{port}").rstrip("/")
        # The app builds each session's base URL from these: make them the real address.
        settings = self.settings.model_copy(update={"port": port, "public_url": url})
        app = create_app(settings, self.database_url)
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", **SERVER_OPTIONS
        )
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]), name="trajstore-proxy")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_TIMEOUT_S
        while not server.started:
            if task.done():
                task.result()  # raise what stopped it (no store, schema not migrated, ...)
                raise RuntimeError("the proxy stopped before it started serving")
            if loop.time() > deadline:
                server.should_exit = True
                raise TimeoutError(f"the proxy did not start within {START_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.02)
        self._server, self._task, self._url = server, task, url
        return url

    async def url(self) -> str:
        """The proxy's base URL (agents create sessions at `{url}/sessions`)."""
        if self._url is None:
            raise RuntimeError("the proxy actor was not started; call start() first")
        return self._url

    async def stop(self) -> None:
        """Stop serving: finish requests in flight, flush the recorder, close the store."""
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = self._url = None


def start_proxy_actor(
    name: str,
    settings: ProxySettings,
    database_url: str,
    *,
    namespace: str | None = None,
    detached: bool = False,
    num_cpus: float = 1.0,
) -> Any:
    """Start (or find, when one with this name runs) the named proxy actor; return its handle.

    Blocks until the proxy serves, so a rollout worker started afterwards can use it at once.
    """
    options: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "get_if_exists": True,
        "num_cpus": num_cpus,
    }
    if detached:
        options["lifetime"] = "detached"
    handle: Any = ray.remote(ProxyActor).options(**options).remote(settings, database_url)
    ray.get(handle.start.remote())
    return handle


def proxy_url(name: str, *, namespace: str | None = None) -> str:
    """The base URL of the named proxy actor, from anywhere in the cluster."""
    actor: Any = ray.get_actor(name, namespace=namespace)
    return str(ray.get(actor.url.remote()))
