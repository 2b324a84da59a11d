"""The processes and requests of benchmarks/proxy_overhead.py: the fake engine, the floor, the
proxy (this checkout's, or another's as a baseline), and the requests an agent sends.

A baseline is another checkout of trajstore (`--baseline DIR`, e.g. a worktree of main), served
by this interpreter with its `trajstore` package imported from DIR instead of this one: the
same machine, the same run, the same dependencies, only the code differs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

from trajstore.proxy.wire import engine_body

ROOT = Path(__file__).resolve().parent.parent
MAX_TOKENS = 64
RUN_ID = "proxy-overhead"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
#: Requests each worker sends before a measurement: connections open, caches warm.
WARMUP_PER_WORKER = 2
MESSAGES = [
    {"role": "system", "content": "You are a careful coding agent. Answer with a patch."},
    {"role": "user", "content": "The test in tests/test_io.py fails with a KeyError; fix it."},
]


def history(tokens: int) -> list[dict[str, str]]:
    """An agent's earlier turns, about `tokens` tokens of them (four characters a token): tool
    calls and their results, as a request deep into an episode carries them."""
    turns: list[dict[str, str]] = []
    line = "    assert parse(row)[key] == expected, (key, row)  # tests/test_io.py\n"
    while sum(len(m["content"]) for m in turns) < 4 * tokens:
        turns.append({"role": "assistant", "content": "Let me look at the failing test first."})
        turns.append({"role": "tool", "content": line * 60})  # ~1,000 tokens of output
    return turns


#: The engine in its own process. FakeEngine keeps every request it saw, for tests; a benchmark
#: would grow it by a hundred thousand dicts, so it keeps only the last one here.
ENGINE_MAIN = """
import sys
import uvloop
sys.path.insert(0, sys.argv[1])
from tests.proxy.fake_engine import FakeEngine, serve_forever

uvloop.run(serve_forever(FakeEngine(instant=True), int(sys.argv[2])))
"""


def request_body(stream: bool, *, usage: bool = False, api: str = "chat") -> bytes:
    """A request as an agent sends it: no token ids or logprobs asked for.

    With `usage`, a chat stream asks for the usage chunk: a real model's tokens do not each
    carry text (a split UTF-8 character, the end-of-turn token), so counting text chunks
    undercounts. The same conversation as Anthropic Messages or OpenAI Responses (`api`): the
    system prompt as `system` / `instructions`, tool output as user turns.
    """
    system, rest = MESSAGES[0]["content"], MESSAGES[1:]
    turns = [{"role": "user" if m["role"] == "tool" else m["role"], "content": m["content"]}
             for m in rest]  # fmt: skip
    body: dict[str, object]
    if api == "messages":
        body = {"model": "tiny", "system": system, "messages": turns, "max_tokens": MAX_TOKENS}
    elif api == "responses":
        body = {"model": "tiny", "instructions": system, "input": turns}
        body["max_output_tokens"] = MAX_TOKENS
    else:
        body = {"model": "tiny", "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        if stream and usage:
            body["stream_options"] = {"include_usage": True}
    body["stream"] = stream
    return orjson.dumps(body)


#: `trajstore` imported from the checkout in argv[1] (the editable install's finder set aside),
#: then its command line run with the rest of argv.
CHECKOUT_MAIN = """
import importlib.util, sys
root = sys.argv.pop(1)
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()
                    and "Redirect" not in type(f).__name__]
spec = importlib.util.spec_from_file_location(
    "trajstore", root + "/trajstore/__init__.py", submodule_search_locations=[root + "/trajstore"])
module = importlib.util.module_from_spec(spec)
sys.modules["trajstore"] = module
spec.loader.exec_module(module)
from trajstore.cli import main
main(prog_name="trajstore")
"""


def proxy_argv(python: str, checkout: Path | None) -> list[str]:
    """The command that runs `trajstore` from this checkout, or from `checkout`."""
    if checkout is None:
        return [python, "-m", "trajstore"]
    return [python, "-c", CHECKOUT_MAIN, str(checkout.resolve())]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the processes and their waited-for children, from /proc/<pid>/stat."""
    ticks = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except FileNotFoundError:
            continue  # a backend that ended since we listed it
        fields = stat.rpartition(")")[2].split()  # the name may hold spaces; fields from 3 on
        ticks += sum(int(f) for f in fields[11:15])  # utime, stime, cutime, cstime
    return ticks / CLOCK_TICKS


@dataclass
class Server:
    """A process the benchmark started, and where it listens."""

    name: str
    process: subprocess.Popen[bytes]
    url: str
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


class Servers:
    """Starts the servers; `stop()` ends every one of them, whatever happened."""

    def __init__(self) -> None:
        self.started: list[Server] = []
        self.logs = tempfile.TemporaryDirectory(prefix="proxy-overhead-")

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Server:
        port = free_port()
        argv = [a.replace("{port}", str(port)) for a in argv]
        log = Path(self.logs.name) / f"{name}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip
        server = Server(name, process, f"http://127.0.0.1:{port}", log)
        self.started.append(server)
        return server

    async def wait_ready(self, server: Server, http: aiohttp.ClientSession, path: str) -> None:
        """Until `path` answers 200; fail with the server's log if it exits or takes 60 s."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                break
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(server.url + path) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{server.name} did not come up; its log:\n{server.log_tail()}")

    def stop(self) -> None:
        for server in reversed(self.started):  # the proxies before the engine they drain into
            if server.process.poll() is None:
                server.process.send_signal(signal.SIGTERM)
        for server in self.started:
            try:
                server.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.process.kill()
                server.process.wait()
        self.logs.cleanup()


def start_vllm(servers: Servers) -> Server:
    """A real vLLM (CPU build) on the generated tiny model, owned by `servers`."""
    from trajstore.tiny_model import build_tiny_model
    from trajstore.vllm_server import VllmServer

    model = build_tiny_model(Path(servers.logs.name) / "model")
    log = Path(servers.logs.name) / "engine.log"
    vllm = VllmServer(model, free_port(), log_file=log)
    vllm.start()
    assert vllm.process is not None
    server = Server("engine", vllm.process, vllm.url, log)
    servers.started.append(server)
    return server


async def answer_sizes(http: aiohttp.ClientSession, engine_url: str) -> str:
    """The engine's answer bytes as an agent asks, and as trajstore asks (ids and logprobs)."""
    sizes = []
    for stream in (False, True):
        plain = orjson.loads(request_body(stream))
        for body in (plain, engine_body("chat", plain)):
            async with http.post(engine_url + "/v1/chat/completions", json=body) as resp:
                sizes.append(len(await resp.read()))
    return (
        f"request body bytes {len(request_body(False))}; "
        f"engine answer bytes, as the agent asks / as trajstore asks: non-stream "
        f"{sizes[0]} / {sizes[1]}, stream {sizes[2]} / {sizes[3]}"
    )
