"""The harness matrix: real agent CLIs, unchanged, through trajstore sessions.

    python benchmarks/agents.py [--engine fake|vllm|both] [--harness NAME ...] [--quick]
                                [--timeout S] [--save-fixtures tests/fixtures/harnesses]

Installs the pinned CLIs into the project's cache (benchmarks/agent_harnesses.py: Codex, Claude
Code, opencode, Qwen Code from npm; mini-swe-agent and smolagents from PyPI), then runs each
with exactly its README block, on one small task, through a session of `trajstore proxy`:

- `fake`: the tool-calling fake engine (tests/proxy/fake_engine.py) in this process, scripted
  to call the CLI's own tools (a shell `ls`, a read of README.md, a sub-agent where the CLI has
  one, then a text answer: benchmarks/agent_capture.py), so each run is multi-turn and ends;
- `vllm`: the real vLLM (CPU) on the generated tiny model, with the context real CLIs need
  (`trajstore.vllm_server.AGENT_CONTEXT`); its random text ends each CLI's loop at once.

Between the CLI and the proxy an HTTP front keeps every request. The table says, per run: the
model calls the CLI sent, those recorded as turns with prompt and completion ids, the turns
sent to the engine as token-in continuations (`prompt_source = continued`), the session's
samples and lineages (when samples have one), and the CLI's exit status. `--save-fixtures DIR`
writes each fake-engine run's calls, in order, with the recorded ids (DIR/NAME.jsonl.gz; the
tests replay them). `--quick` (CI) runs Codex only, on both engines.

It exits non-zero when a CLI exits non-zero or a model call it sent is not recorded with ids.
The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
from agent_capture import (
    TASK,
    WORKDIR_FILES,
    Capture,
    attach_turns,
    in_proxy_order,
    scripted_tool_call,
)
from agent_capture import write_fixture as write_fixture_file
from agent_harnesses import (
    BY_NAME,
    HARNESSES,
    Harness,
    cache_dir,
    install,
    prepare_home,
    readme_command,
    run_env,
)
from ingest import Databases  # benchmarks/ is on sys.path when this runs as a script
from proxy_overhead import ROOT, Servers, free_port

from trajstore.client import AsyncClient
from trajstore.store.embedded import database_url
from trajstore.store.sessions import rebuild_session

sys.path.insert(0, str(ROOT))
from tests.proxy.fake_engine import FakeEngine

SCRATCH = Path(tempfile.gettempdir()) / "trajstore-agents"


@dataclass
class Row:
    """One CLI's run through one session."""

    harness: Harness
    engine: str
    calls: int = 0  #: model calls it sent (count_tokens left out: nothing is generated)
    recorded: int = 0  #: ... recorded as a completed turn with prompt and completion ids
    continued: int = 0  #: turns sent to the engine as token-in continuations
    samples: int = 0
    lineages: int | None = None  #: distinct `lineage` of its samples, when samples have one
    roles: str = ""  #: how many lineages of each role (main, subagent, side)
    other: int = 0  #: requests that were no model call (HEAD /, count_tokens, /models...)
    exit: int | str = "-"
    seconds: float = 0.0
    tail: str = ""  #: the end of its output, shown when it failed

    @property
    def ok(self) -> bool:
        return self.exit == 0 and self.recorded == self.calls > 0


class Engine:
    """An engine and the proxy (a `trajstore proxy` process) in front of it, behind a capture."""

    def __init__(self, kind: str, servers: Servers, http: aiohttp.ClientSession) -> None:
        self.kind = kind
        self.servers = servers
        self.http = http
        self.fake: FakeEngine | None = None
        self.capture: Capture | None = None
        self.proxy_url = ""

    async def start(self, db_url: str, workdir: Path) -> None:
        if self.kind == "fake":
            self.fake = FakeEngine(
                call_tools=True, completion_tokens=12, max_model_len=131_072,
                tool_policy=partial(scripted_tool_call, workdir),
            )  # fmt: skip
            engine_url = await self.fake.start()
        else:
            engine_url = (await asyncio.to_thread(start_long_vllm, self.servers)).url
        front = free_port()
        env = {**os.environ, "TRAJSTORE_DATABASE_URL": db_url,
               "TRAJSTORE_PUBLIC_URL": f"http://127.0.0.1:{front}"}  # fmt: skip
        argv = [sys.executable, "-m", "trajstore", "proxy", "--engine", engine_url,
                "--port", "{port}"]  # fmt: skip
        proxy = self.servers.start(f"proxy-{self.kind}", argv, env=env)
        await self.servers.wait_ready(proxy, self.http, "/health")
        self.proxy_url = proxy.url
        self.capture = Capture(proxy.url)
        await self.capture.start(front)

    async def stop(self) -> None:
        if self.capture is not None:
            await self.capture.stop()
        if self.fake is not None:
            await self.fake.stop()


def start_long_vllm(servers: Servers) -> Any:
    """A real vLLM (CPU) on the generated tiny model with the agents' context, owned by
    `servers`."""
    from proxy_overhead import Server

    from trajstore.tiny_model import build_tiny_model
    from trajstore.vllm_server import AGENT_CONTEXT, VllmServer

    model = build_tiny_model(Path(servers.logs.name) / "model")
    log = Path(servers.logs.name) / "engine.log"
    vllm = VllmServer(model, free_port(), log_file=log, max_model_len=AGENT_CONTEXT)
    vllm.start()
    assert vllm.process is not None
    server = Server("engine", vllm.process, vllm.url, log)
    servers.started.append(server)
    return server


async def run_one(
    harness: Harness, engine: Engine, bin_dir: Path, db_url: str, timeout: float
) -> tuple[Row, list[Any]]:
    """Run `harness` through a new session of `engine`; its row, and its captured calls."""
    assert engine.capture is not None
    row = Row(harness, engine.kind)
    client = AsyncClient(engine.proxy_url, database_url=db_url)
    session = await client.create_session(f"agents-{engine.kind}", task_id=harness.name)
    home, workdir = SCRATCH / "home" / harness.name, SCRATCH / "project"
    shutil.rmtree(home, ignore_errors=True)
    prepare_home(home)
    engine.capture.take()  # a clean slate and clock
    loop = asyncio.get_running_loop()
    began = loop.time()
    child = await asyncio.create_subprocess_exec(
        "bash", "-c", readme_command(harness.name), cwd=workdir,
        env=run_env(bin_dir, home, session.info, TASK), stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(child.communicate(), timeout)
        row.exit = child.returncode if child.returncode is not None else "?"
    except TimeoutError:
        os.killpg(child.pid, 9)
        out, _ = await child.communicate()
        row.exit = f"timeout {timeout:g}s"
    row.seconds = loop.time() - began
    row.tail = out.decode(errors="replace")[-1500:]
    calls = engine.capture.take()

    async with client:
        await session.finish()
        samples = await session.samples()
        # Unpacked (token ids as lists): what the captured calls are matched against.
        events = await (await client.store()).read_session(session.session_id)
    record = rebuild_session(session.session_id, events)
    attach_turns(calls, record)
    calls = in_proxy_order(calls)
    model_calls = [c for c in calls if c.api not in (None, "count_tokens")]
    row.calls, row.other = len(model_calls), len(calls) - len(model_calls)
    row.recorded = sum(1 for c in model_calls if c.turn is not None and _with_ids(c.turn))
    row.continued = sum(1 for t in record.turns if t.prompt_source == "continued")
    row.samples = len(samples)
    if samples and hasattr(samples[0], "lineage"):
        roles = {getattr(s, "lineage", None): getattr(s, "role", "?") for s in samples}
        row.lineages = len(roles)
        row.roles = ", ".join(f"{n} {r}" for r, n in sorted(Counter(roles.values()).items()))
    return row, calls


def _with_ids(turn: Any) -> bool:
    choice = turn.choices.get(0)
    return bool(turn.status == "completed" and len(turn.prompt_token_ids) and choice
                and len(choice.token_ids))  # fmt: skip


def print_table(rows: list[Row]) -> None:
    """The matrix, as docs/agents.md shows it."""
    head = ("harness", "version", "engine", "API", "calls", "recorded with ids", "continued",
            "samples", "lineages", "other requests", "exit", "seconds")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = (r.harness.name, r.harness.version, r.engine, r.harness.api, r.calls, r.recorded,
                 r.continued, r.samples,
                 "-" if r.lineages is None else f"{r.lineages} ({r.roles})", r.other,
                 r.exit, f"{r.seconds:.0f}")  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


async def main(args: argparse.Namespace) -> int:
    harnesses = [BY_NAME[n] for n in args.harness] if args.harness else list(HARNESSES)
    if args.quick:
        harnesses = [BY_NAME["codex"]]
    cache = cache_dir()
    bins = {}
    for harness in harnesses:
        print(f"installing {harness.package}@{harness.version} into {cache}", flush=True)
        bins[harness.name] = await asyncio.to_thread(install, harness, cache)
    workdir = SCRATCH / "project"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    for name, text in WORKDIR_FILES.items():
        (workdir / name).write_text(text)

    kinds = ["fake", "vllm"] if args.engine == "both" else [args.engine]
    dbs = Databases(await asyncio.to_thread(database_url))
    servers = Servers()
    rows: list[Row] = []
    async with aiohttp.ClientSession() as http:
        engines = [Engine(kind, servers, http) for kind in kinds]
        try:
            await dbs.setup()
            for engine in engines:
                db_url = await dbs.fresh()
                await engine.start(db_url, workdir)
                for harness in harnesses:
                    row, calls = await run_one(
                        harness, engine, bins[harness.name], db_url, args.timeout
                    )
                    rows.append(row)
                    print(f"{harness.name} on {engine.kind}: exit {row.exit}, {row.calls} calls, "
                          f"{row.recorded} recorded, {row.seconds:.0f} s", flush=True)  # fmt: skip
                    if not row.ok:
                        print(row.tail)
                    if args.save_fixtures:
                        header = {"harness": harness.name, "package": harness.package,
                                  "version": harness.version, "api": harness.api,
                                  "engine": engine.kind, "task": TASK,
                                  "exit": row.exit}  # fmt: skip
                        suffix = "" if engine.kind == "fake" else f".{engine.kind}"
                        path = Path(args.save_fixtures) / f"{harness.name}{suffix}.jsonl.gz"
                        size = write_fixture_file(path, header, calls)
                        print(f"  fixture {path}: {len(calls)} requests, {size / 1024:.0f} KiB")
                await engine.stop()
        finally:
            for engine in engines:
                await engine.stop()
            servers.stop()
            await dbs.drop_all()
    print()
    print_table(rows)
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--engine", choices=["fake", "vllm", "both"], default="both")
    parser.add_argument("--harness", action="append", choices=sorted(BY_NAME))
    parser.add_argument("--quick", action="store_true", help="Codex only (CI)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per CLI run")
    parser.add_argument("--save-fixtures", metavar="DIR", help="write fake-engine runs here")
    sys.exit(asyncio.run(main(parser.parse_args())))
