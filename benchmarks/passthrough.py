"""The floor for benchmarks/proxy_overhead.py: the least a Python proxy in front of an engine costs.

    python benchmarks/passthrough.py --engine http://127.0.0.1:8000 --port 8401

An aiohttp.web server and one pooled aiohttp.ClientSession to the engine, on uvloop like the real
proxy under uvicorn: it forwards the body as it came and passes the answer back, a whole answer
(the engine sent a Content-Length) as one, a stream chunk by chunk as the bytes arrive. No
parsing, no recording, no checks: whatever the real proxy costs beyond this is its own doing.
"""

from __future__ import annotations

import argparse
import asyncio

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
    args = parser.parse_args()
    uvloop.run(serve(args.engine, args.host, args.port))
