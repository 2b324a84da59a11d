"""The floor for benchmarks/proxy_overhead.py: the least a Python proxy in front of an engine costs.

    python benchmarks/passthrough.py --engine http://127.0.0.1:8000 --port 8401 [--asgi]

An aiohttp.web server and one pooled aiohttp.ClientSession to the engine, on uvloop like the real
proxy under uvicorn: it forwards the body as it came and passes the answer back, a whole answer
(the engine sent a Content-Length) as one, a stream chunk by chunk as the bytes arrive. No
parsing, no recording, no checks: whatever the real proxy costs beyond this is its own doing.

With `--asgi`, the same pass-through is a bare ASGI app served the way the proxy is served
(uvicorn, `proxy.server.SERVER_OPTIONS`): what the proxy's server and engine client cost alone.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

ENGINE = web.AppKey("engine", str)
HTTP = web.AppKey("http", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    """Send the request on to the engine as it came; relay the answer as it comes."""
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[ENGINE] + request.path_qs
    async with request.app[HTTP].request(
        request.method, url, data=body, headers=headers
    ) as upstream:
        answer_headers = {"Content-Type": upstream.headers.get("Content-Type", "application/json")}
        if upstream.content_length is not None:
            raw = await upstream.read()
            return web.Response(body=raw, status=upstream.status, headers=answer_headers)
        response = web.StreamResponse(status=upstream.status, headers=answer_headers)
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
        return response


class AsgiPassThrough:
    """`forward` as a bare ASGI app, for the proxy's own server."""

    def __init__(self, engine: str) -> None:
        self.engine = engine.rstrip("/")
        self.http: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:  # type: ignore[type-arg]
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self.http is None:
            self.http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
            )
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {"Content-Type": "application/json"}
        url = self.engine + scope["path"]
        async with self.http.request(
            scope["method"], url, data=b"".join(parts), headers=headers
        ) as upstream:
            kind = upstream.headers.get("Content-Type", "application/json").encode()
            head = [(b"content-type", kind)]
            if upstream.content_length is not None:
                raw = await upstream.read()
                head.append((b"content-length", b"%d" % len(raw)))
                await send(
                    {"type": "http.response.start", "status": upstream.status, "headers": head}
                )
                await send({"type": "http.response.body", "body": raw})
                return
            await send({"type": "http.response.start", "status": upstream.status, "headers": head})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})


async def serve(engine: str, host: str, port: int) -> None:
    """Run the pass-through proxy until the process is stopped."""
    app = web.Application()
    app[ENGINE] = engine.rstrip("/")
    app[HTTP] = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
    )
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port, backlog=2048).start()
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        await app[HTTP].close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", required=True, help="engine base URL (without /v1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--asgi", action="store_true", help="a bare ASGI app on the proxy's server")
    args = parser.parse_args()
    if args.asgi:
        import uvicorn

        from trajstore.proxy.server import SERVER_OPTIONS

        app = AsgiPassThrough(args.engine)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                    **SERVER_OPTIONS)  # fmt: skip
    else:
        uvloop.run(serve(args.engine, args.host, args.port))
