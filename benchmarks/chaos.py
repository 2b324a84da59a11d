"""Chaos: what trajstore promises when something breaks, checked by breaking it.

    python benchmarks/chaos.py [--quick] [--only NAME ...] [--seed N]

Six scenarios, run one after the other against a private PostgreSQL this suite starts (in a
temporary directory, on a free port: never the machine's server), each with processes of its
own (fake engines from tests/proxy/fake_engine.py, `trajstore proxy`, `trajstore project`):

1. pg-restart: N streaming multi-turn sessions through a proxy while PostgreSQL is stopped like a
   crash (`pg_ctl stop -m immediate`) and started again; every session is finished as it ends,
   a finish answered 503 is retried after its Retry-After. Tokens received by the agents must
   all be stored, no agent may see an error, every finish must succeed.
2. replica-kill: two proxy replicas sharing TRAJSTORE_SESSION_SECRET; sessions stream through B,
   which is SIGKILLed mid-stream. A's reaper must record each open turn of an active session as
   failed (`replica_lost`, with the tokens that reached the log); A serves the retried turns and
   finishes the sessions. Half the sessions are finished at once, before the reaper could look;
   one more session, left idle by its orchestrator, must be finished as `timeout`.
3. engine-kill: a proxy in front of two engine processes; one is SIGKILLed mid-stream. The cut
   streams must be recorded as failed with their tokens, and the sessions' next requests must be
   served by the other engine (agents retry a 502/503 the way the OpenAI client does).
4. projector-kill: M finished sessions; the live `trajstore project` is SIGKILLed part-way, more
   than once, then let catch up. Its samples must equal, sample for sample, those of a one-shot
   `trajstore project --once` on a copy of the same log: none lost, none doubled.
5. soak: N concurrent streams, one request each on a fresh session (proxy_overhead's soak): no
   error, and the tokens the clients received are the tokens stored.
6. api-fuzz: property-based requests against the running proxy: every route of its OpenAPI
   schema (schemathesis; positive and negative cases, and cases on a real session with its
   orchestrator key), and random JSON bodies for the chat completions, Messages and Responses
   routes (hypothesis). No 5xx, no hang (a client timeout), the proxy still healthy after.

Sizes, full / --quick: pg-restart 24 / 8 sessions of 3 turns; replica-kill and engine-kill 16 / 8
sessions; projector-kill 4,000 / 1,000 sessions and 3 / 2 kills; soak 1,000 / 200 streams; the
fuzz 50 / 10 cases per operation and pass, 300 / 50 per model-call route (`--seed` varies them).
The fuzz needs schemathesis (`pip install 'schemathesis>=4.32,<5'`).

Each scenario prints its figures; a table of verdicts ends the run. The exit status is 1 when a
promise is broken (or a scenario could not run), 0 otherwise. Every process and temporary
directory is removed at the end, on failure too. `--quick` (CI-sized) takes about two minutes on
2 cores. docs/reliability.md states the promises and the figures measured.

This module is the command line, the run and its table; the scenarios are in chaos_outages.py
(1 to 3), chaos_recording.py (4 and 5) and chaos_fuzz.py (6, its bodies in chaos_bodies.py);
what they share, in chaos_world.py (PostgreSQL, processes, results) and chaos_agents.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
import traceback

import uvloop

# benchmarks/ is on sys.path when chaos.py runs as a script
from chaos_fuzz import api_fuzz
from chaos_outages import engine_kill, pg_restart, replica_kill
from chaos_recording import concurrent_soak, projector_kill
from chaos_world import Chaos, Result, Scenario, Sizes, say
from proxy_overhead import Servers

# -- the run ------------------------------------------------------------------------------------

SCENARIOS: dict[str, tuple[str, Scenario]] = {
    "pg-restart": ("PostgreSQL restarted mid-load", pg_restart),
    "replica-kill": ("a proxy replica SIGKILLed mid-stream", replica_kill),
    "engine-kill": ("an engine SIGKILLed mid-stream", engine_kill),
    "projector-kill": ("the projector SIGKILLed part-way", projector_kill),
    "soak": ("concurrent streams, one request each", concurrent_soak),
    "api-fuzz": ("property-based fuzz of the HTTP API", api_fuzz),
}


async def run_scenario(chaos: Chaos, name: str) -> Result:
    title, scenario = SCENARIOS[name]
    say(f"\n== {name}: {title}")
    result = Result(name)
    servers = Servers()
    started = time.monotonic()
    try:
        async with asyncio.timeout(chaos.sizes.limit) as limit:
            await scenario(chaos, servers, result)
    except TimeoutError:
        if limit.expired():
            result.error = f"did not end within {chaos.sizes.limit:.0f} s"
        else:
            result.error = f"TimeoutError: {traceback.format_exc(limit=3)}"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if result.verdict != "ok":
            for server in servers.started:
                with contextlib.suppress(OSError):
                    say(f"  -- last lines of {server.name}'s log:\n{server.log_tail(12)}")
        await asyncio.to_thread(servers.stop)
    result.seconds = time.monotonic() - started
    if result.error:
        say(f"  ERROR: {result.error}")
    say(f"  -> {result.verdict} in {result.seconds:.1f} s")
    return result


def print_table(results: list[Result], total: float) -> None:
    say(f"\n{'scenario':<15} {'verdict':<7} {'s':>6}  figures")
    for r in results:
        figures = "; ".join(f"{k}: {v}" for k, v in list(r.figures.items())[:4])
        say(f"{r.name:<15} {r.verdict:<7} {r.seconds:6.1f}  {figures[:150]}")
        for promise in r.broken:
            say(f"{'':<30}broken: {promise[:200]}")
        for note in r.notes:
            say(f"{'':<30}note: {note.splitlines()[0][:200]}")
    say(f"total {total:.1f} s")


async def main(names: list[str], quick: bool, seed: int) -> int:
    if os.environ.get("TRAJSTORE_DATABASE_URL"):
        say("note: TRAJSTORE_DATABASE_URL is ignored: the suite restarts a PostgreSQL of its own")
    started = time.monotonic()
    chaos = Chaos(Sizes.of(quick), seed)
    results: list[Result] = []
    try:
        await chaos.start()
        say(f"PostgreSQL of the suite: {chaos.pg.data_dir} (port {chaos.pg.port})")
        for name in names:
            results.append(await run_scenario(chaos, name))
    finally:
        await chaos.close()
    print_table(results, time.monotonic() - started)
    return 0 if all(r.verdict == "ok" for r in results) else 1


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # so that SIGTERM cleans up as Ctrl-C does


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized: about two minutes")
    parser.add_argument("--only", nargs="+", choices=list(SCENARIOS), help="these scenarios")
    parser.add_argument("--seed", type=int, default=0, help="the fuzz's seed [0]")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _interrupt)
    sys.exit(uvloop.run(main(args.only or list(SCENARIOS), args.quick, args.seed)))
