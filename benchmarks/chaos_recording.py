"""Chaos scenarios 4 and 5: what the store holds is exactly what was produced, with the projector
SIGKILLed part-way (its samples against a one-shot projection) and under many concurrent streams
(the tokens received against the tokens stored).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import asyncpg

# benchmarks/ is on sys.path when chaos.py runs as a script
from chaos_world import (
    PYTHON,
    ROOT,
    Chaos,
    Result,
    database_name,
    fetch,
    say,
    start_proxy,
    trajstore_env,
    wait_ready,
)
from projection import Shape, record
from proxy_overhead import ENGINE_MAIN as INSTANT_ENGINE_MAIN
from proxy_overhead import DbBackends, Servers, Target, new_client, soak

from trajstore.store.connection import asyncpg_dsn

# -- 4. the projector SIGKILLed part-way --------------------------------------------------------

SAMPLES = """
SELECT sample_id, session_id, branch, is_final, status, reward, md5(token_ids) AS ids,
       md5(loss_mask) AS mask, md5(logprobs) AS logprobs, prompt_len, response_len, n_turns,
       last_position
FROM samples ORDER BY sample_id
"""


async def projector_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    m, kills = chaos.sizes.projector_sessions, chaos.sizes.projector_kills
    url = await chaos.fresh()
    started = time.monotonic()
    shape = Shape(turns=4, first_prompt=256, completion=64, tool_result=32, sessions=m)
    await record(url, shape)  # benchmarks/projection.py's short sessions, finished, rewarded
    say(f"  recorded {m} finished sessions in {time.monotonic() - started:.1f} s")
    copy = await chaos.clone(url)
    project = [PYTHON, "-m", "trajstore", "project"]

    started = time.monotonic()
    once = servers.start("project-once", [*project, "--once"], env=trajstore_env(copy))
    code = await asyncio.to_thread(once.process.wait, 300)
    if code != 0:
        raise RuntimeError(f"trajstore project --once exited {code}:\n{once.log_tail()}")
    once_s = time.monotonic() - started
    expected = [tuple(r) for r in await fetch(copy, SAMPLES)]

    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:

        async def count() -> int:
            value: int = await conn.fetchval("SELECT count(*) FROM samples")
            return value

        async def in_transaction() -> bool:
            """Whether a backend of the projector is inside a transaction of 10 ms or more."""
            busy: bool = await conn.fetchval(
                "SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = $1 "
                "AND pid <> pg_backend_pid() AND now() - xact_start > interval '10 ms'",
                database_name(url),
            )
            return busy

        at_kill: list[int] = []
        inside: list[bool] = []
        live = [*project, "--poll-interval", "0.2"]
        for k in range(kills):
            # Past a share of the samples: the even kills right after the projector committed a
            # batch, the odd ones in the middle of the next (inside its transaction).
            threshold = (k + 1) * len(expected) // (kills + 1)
            runner = servers.start(f"project-{k}", live, env=trajstore_env(url))
            while True:
                done = await count()
                if done >= threshold or runner.process.poll() is not None:
                    break
                await asyncio.sleep(0.005)
            deadline = time.monotonic() + 10
            while k % 2 and done < len(expected) and time.monotonic() < deadline:
                if await in_transaction():
                    break
                await asyncio.sleep(0.002)
            inside.append(await in_transaction())
            runner.process.send_signal(signal.SIGKILL)
            await asyncio.to_thread(runner.process.wait)
            at_kill.append(await count())
            where = "inside a transaction" if inside[-1] else "between batches"
            say(f"  SIGKILLed the projector {where}, {at_kill[-1]} samples committed")
        started = time.monotonic()
        runner = servers.start("project-last", live, env=trajstore_env(url))
        deadline = time.monotonic() + chaos.sizes.limit / 2
        while await count() < len(expected) and time.monotonic() < deadline:
            if runner.process.poll() is not None:
                raise RuntimeError(f"the projector exited:\n{runner.log_tail()}")
            await asyncio.sleep(0.02)
        catch_up = time.monotonic() - started
        await asyncio.sleep(1.0)  # would it write more?
        runner.process.send_signal(signal.SIGTERM)
        rows = [tuple(r) for r in await conn.fetch(SAMPLES)]
        finished = await conn.fetchval(
            "SELECT count(DISTINCT session_id) FROM events WHERE event_type = 'session_finished'"
        )
    finally:
        await conn.close()

    ids = [r[0] for r in rows]
    by_id = {r[0]: r for r in rows}
    want = {r[0]: r for r in expected}
    missing = sorted(set(want) - set(by_id))
    extra = sorted(set(by_id) - set(want))
    differ = sorted(i for i in set(want) & set(by_id) if want[i] != by_id[i])
    per_session = Counter(r[1] for r in rows)
    landed = sum(1 for c in at_kill if 0 < c < len(expected))
    result.figure("finished sessions", finished)
    result.figure("one-shot --once samples (s)", f"{len(expected)} ({once_s:.2f} s)")
    result.figure("kills that landed part-way", f"{landed} of {kills}, samples committed "
                  f"then: {at_kill}, {sum(inside)} inside a transaction")  # fmt: skip
    result.figure("live samples after catching up", f"{len(rows)} ({catch_up:.2f} s)")
    result.figure("duplicates / missing / extra / different",
                  f"{len(ids) - len(set(ids))} / {len(missing)} / {len(extra)} / "
                  f"{len(differ)}")  # fmt: skip
    result.expect(len(ids) == len(set(ids)), "no sample doubled")
    result.expect(not missing, f"no sample lost: {missing[:5]}")
    result.expect(not extra and not differ, f"the same samples as a one-shot projection: "
                  f"{(extra + differ)[:5]}")  # fmt: skip
    result.expect(
        len(per_session) == finished and set(per_session.values()) == {1},
        "every finished session has its sample exactly once",
    )
    if landed < kills:
        result.note("a kill came after the projector had finished: raise the sessions")


# -- 5. many concurrent streams -----------------------------------------------------------------


async def concurrent_soak(chaos: Chaos, servers: Servers, result: Result) -> None:
    n = chaos.sizes.soak_streams
    url = await chaos.fresh()
    engine = servers.start("engine", [PYTHON, "-c", INSTANT_ENGINE_MAIN, str(ROOT), "{port}"])
    proxy = start_proxy(servers, "proxy", [engine], url)
    conn = await asyncpg.connect(asyncpg_dsn(url))
    try:
        async with new_client() as http:
            await wait_ready(servers, http, engine, proxy)
            target = Target("trajstore", [], [proxy.process.pid], proxy)
            db = DbBackends(conn, database_name(url))
            started = time.monotonic()
            ok = await soak(http, [target], db, n)  # benchmarks/proxy_overhead.py
            seconds = time.monotonic() - started
            stored = await db.stored_tokens()
            users = await conn.fetch(
                "SELECT DISTINCT usename FROM pg_stat_activity "
                "WHERE datname = $1 AND application_name LIKE 'trajstore-proxy:%'",
                database_name(url),
            )
    finally:
        await conn.close()
    result.figure("streams", n)
    result.figure("seconds (sessions, streams, finishes)", round(seconds, 2))
    result.figure("tokens received / stored", f"{target.received_tokens} / {stored}")
    result.figure("the proxy's PostgreSQL role", ", ".join(r["usename"] for r in users))
    result.expect(ok, "no error, and every token received is stored (see the soak line above)")
