"""Publishing weights while agents' long turns are in flight: the drain against the switch.

    python benchmarks/publish.py [--quick] [--agents 4] [--turn-tokens 2000] [--seconds 40]
                                 [--every 3]

One vLLM (CPU build, dev endpoints) on the generated tiny model (untied, `trajstore.publish`),
the proxy on a fresh database. In the same run, one phase per way of publishing:

    drain    `Publisher(drain=True)`: `POST /pause?mode=wait` (the engine finishes every turn
             in flight), reload, tell the proxy the version, resume
    switch   `Publisher()`: the proxy cuts the turns in flight where it received them and holds
             new requests, reload, live: the cut turns continue token-in on the new weights

In each phase `--agents` agents loop: a session, one streamed chat turn of exactly
`--turn-tokens` tokens (min_tokens = max_tokens, temperature 1), the next; and a publisher loads
another checkpoint (two distinct ones, alternating) every `--every` seconds, `--seconds` long.

Printed per phase: the time from "publish" to the new version serving (the publisher's call,
median and max), the agents' tokens/s over the phase, turns completed, turns lost (started and
neither completed nor failed to the agent: 0), agent errors (0), and from the log: turns recorded
across a switch (`turn_versions.straddled`) and the share of tokens they hold. Then the ratios
switch / drain. The database is TRAJSTORE_DATABASE_URL's server, else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from ingest import Databases  # benchmarks/ingest.py, next to this file
from openai import AsyncOpenAI, OpenAIError

from trajstore.publish import Publisher, untied_copy
from trajstore.store import EventStore
from trajstore.store.embedded import database_url
from trajstore.tiny_model import build_tiny_model, moved_policy
from trajstore.train_cli import SERVED_NAME, live_services


class Phase:
    """One way of publishing under load: its agents, its publishes, its counts."""

    def __init__(self, name: str, run_id: str) -> None:
        self.name = name
        self.run_id = run_id
        self.publishes: list[float] = []
        self.tokens = 0
        self.started = self.completed = self.errors = 0
        self.seconds = 0.0
        self.straddled = 0
        self.across_share = 0.0


async def agent(
    proxy_url: str, http: httpx.AsyncClient, phase: Phase, tokens: int, stop: asyncio.Event
) -> None:
    """Turn after turn until `stop`; a turn under way when it is set is finished."""
    while not stop.is_set():
        created = (await http.post(f"{proxy_url}/sessions", json={"run_id": phase.run_id})).json()
        client = AsyncOpenAI(base_url=created["base_url"], api_key=created["api_key"],
                             max_retries=0, timeout=600)  # fmt: skip
        phase.started += 1
        try:
            stream = await client.chat.completions.create(
                model=SERVED_NAME, messages=[{"role": "user", "content": "Count the apples."}],
                max_tokens=tokens, temperature=1.0, stream=True,
                extra_body={"min_tokens": tokens},
            )  # fmt: skip
            received = 0
            async for chunk in stream:
                received += sum(1 for c in chunk.choices if c.delta.content is not None)
            phase.tokens += received
            phase.completed += 1
        except OpenAIError as exc:
            phase.errors += 1
            print(f"  agent error: {type(exc).__name__}: {exc}", flush=True)
        finally:
            await client.close()


async def run_phase(
    services: Any, phase: Phase, checkpoints: list[Path], first_version: int, args: Any
) -> int:
    """One phase; returns the next version number."""
    publisher = Publisher(services.engine_url, services.proxy_url, Path(tempfile.gettempdir()),
                          drain=phase.name == "drain")  # fmt: skip
    stop = asyncio.Event()
    version = first_version
    async with httpx.AsyncClient(timeout=600) as http:
        began = time.perf_counter()
        agents = [
            asyncio.create_task(agent(services.proxy_url, http, phase, args.turn_tokens, stop))
            for _ in range(args.agents)
        ]
        try:
            while time.perf_counter() - began < args.seconds:
                await asyncio.sleep(args.every)
                at = time.perf_counter()
                await publisher.load(checkpoints[version % 2], version)
                phase.publishes.append(time.perf_counter() - at)
                version += 1
        finally:
            stop.set()
            await asyncio.gather(*agents)
            await publisher.close()
        phase.seconds = time.perf_counter() - began
    async with await EventStore.open(services.database_url) as store:
        row = await store.pool.fetchrow(
            "SELECT count(*) FILTER (WHERE straddled) AS straddled, "
            "coalesce(sum((version_spans -> -1 ->> 'end')::int) FILTER (WHERE straddled), 0) "
            "AS across, coalesce(sum((version_spans -> -1 ->> 'end')::int), 0) AS tokens "
            "FROM turn_versions WHERE run_id = $1",
            phase.run_id,
        )
    phase.straddled = int(row["straddled"])
    phase.across_share = int(row["across"]) / max(1, int(row["tokens"]))
    return version


def report(phases: list[Phase]) -> None:
    print(f"\n{'phase':7s} {'publish→serving p50':>20s} {'max':>7s} {'publishes':>9s} "
          f"{'agent tok/s':>11s} {'turns':>5s} {'lost':>4s} {'errors':>6s} "
          f"{'straddled':>9s} {'tokens across':>13s}")  # fmt: skip
    for p in phases:
        lost = p.started - p.completed - p.errors
        print(f"{p.name:7s} {statistics.median(p.publishes):19.2f}s {max(p.publishes):6.2f}s "
              f"{len(p.publishes):9d} {p.tokens / p.seconds:11.0f} {p.completed:5d} {lost:4d} "
              f"{p.errors:6d} {p.straddled:9d} {p.across_share:12.0%}")  # fmt: skip
    drain, switch = phases
    print(f"\nswitch / drain: publish→serving p50 "
          f"{statistics.median(switch.publishes) / statistics.median(drain.publishes):.3f}x, "
          f"max {max(switch.publishes) / max(drain.publishes):.3f}x; agent tokens/s "
          f"{(switch.tokens / switch.seconds) / (drain.tokens / drain.seconds):.2f}x")  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    if args.quick:
        args.agents, args.turn_tokens, args.seconds, args.every = 2, 800, 12, 3
    databases = Databases(await asyncio.to_thread(database_url))
    await databases.setup()
    url = databases.url_of(databases.template)
    try:
        with tempfile.TemporaryDirectory(prefix="trajstore-publish-") as work:
            base = build_tiny_model(Path(work) / "tiny")
            v1 = moved_policy(untied_copy(base, Path(work) / "untied"), Path(work) / "v1")
            served = Path(work) / "served"
            # Ports of its own: vLLM binds with SO_REUSEPORT, and a stack started beside this one
            # on the same port would take half of its requests.
            port = random.randrange(20000, 30000, 100)
            async with live_services(
                url, base, served, args.vllm_log, engine_port=port, proxy_port=port + 50
            ) as services:
                checkpoints = [services.model_dir, v1]
                print(f"{args.agents} agents, turns of {args.turn_tokens} tokens, a publish "
                      f"every {args.every} s for {args.seconds} s", flush=True)  # fmt: skip
                phases = [Phase("drain", "publish-drain"), Phase("switch", "publish-switch")]
                version = 1
                for phase in phases:
                    version = await run_phase(services, phase, checkpoints, version, args)
                    print(f"{phase.name}: {len(phase.publishes)} publishes, "
                          f"{phase.completed} turns", flush=True)  # fmt: skip
        report(phases)
    finally:
        await databases.drop_all()
    lost = [p.name for p in phases if p.started != p.completed + p.errors]
    failed = [p.name for p in phases if p.errors]
    if lost or failed:
        raise SystemExit(f"turns lost in {lost}, agent errors in {failed}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--agents", type=int, default=4, help="agents streaming at once")
    parser.add_argument("--turn-tokens", type=int, default=2000, help="tokens of each turn")
    parser.add_argument("--seconds", type=float, default=40.0, help="length of each phase")
    parser.add_argument("--every", type=float, default=3.0, help="seconds between publishes")
    parser.add_argument("--quick", action="store_true", help="2 agents, 800 tokens, 12 s")
    default_log = Path(tempfile.gettempdir()) / "publish-vllm.log"
    parser.add_argument("--vllm-log", type=Path, default=default_log, help="vLLM's output")
    asyncio.run(main(parser.parse_args()))
