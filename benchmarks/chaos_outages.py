"""Chaos scenarios 1 to 3: PostgreSQL restarted, a proxy replica and an engine SIGKILLed, each
under streaming agent sessions (benchmarks/chaos.py states the promises they check).
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter

import orjson

# benchmarks/ is on sys.path when chaos.py runs as a script
from chaos_agents import (
    Agent,
    Answer,
    compare_tokens,
    create_agents,
    finish,
    stream_chat,
    wait_for,
)
from chaos_world import (
    FAILURES,
    Chaos,
    Result,
    fetch,
    log_count,
    median,
    say,
    start_engine,
    start_proxy,
    stored_tokens,
    turns_by_session,
    wait_ready,
)
from proxy_overhead import Servers, new_client

from trajstore.proxy.engines import EnginePool
from trajstore.store import EventStore
from trajstore.store.projection import Projector

# -- 1. PostgreSQL restarted mid-load -----------------------------------------------------------


async def pg_restart(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, turns, max_tokens, delay, outage = chaos.sizes.pg_sessions, 3, 48, 0.025, 1.5
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", token_delay=delay)
    proxy = start_proxy(servers, "proxy", [engine], url)
    async with new_client() as http:
        await wait_ready(servers, http, engine, proxy)
        agents = await create_agents(http, proxy.url, [f"pg-{i}" for i in range(n)])
        span = turns * max_tokens * delay  # one session's turns, back to back
        finished: dict[str, tuple[int, int, str, float]] = {}
        window: list[float] = []

        async def session(i: int, agent: Agent) -> None:
            # Staggered: when PostgreSQL goes, the first sessions are finishing, the rest
            # streaming; the last start while it is down.
            await asyncio.sleep(i * span / n)
            for _ in range(turns):
                agent.went_on(await stream_chat(http, proxy.url, agent, max_tokens, Answer()))
            started = time.monotonic()
            status, retries, text = await finish(http, proxy.url, agent)
            finished[agent.sid] = (status, retries, text, time.monotonic() - started)

        async def restart() -> None:
            await asyncio.sleep(0.8 * span)
            window.append(time.monotonic())
            await asyncio.to_thread(chaos.pg.stop, "immediate")  # as a crash
            await asyncio.sleep(outage)
            await asyncio.to_thread(chaos.pg.start)
            window.append(time.monotonic())
            say(f"  PostgreSQL stopped (immediate) and back after {window[1] - window[0]:.2f} s")

        await asyncio.gather(restart(), *(session(i, a) for i, a in enumerate(agents)))

    down, up = window
    answers = [a for agent in agents for a in agent.answers]
    across = sum(1 for a in answers if a.started < up and a.ended > down)
    errors = Counter(a.error for a in answers if a.error)
    retries = [r for _, r, _, _ in finished.values()]
    result.figure("sessions x turns", f"{n} x {turns} (max_tokens {max_tokens}, {delay}s/token)")
    result.figure("PostgreSQL down (s)", round(up - down, 2))
    result.figure("turns streaming while it was down", across)
    result.figure("agent errors", sum(errors.values()))
    for error, count in errors.items():
        say(f"    {count} x {error}")
    result.figure("finish retries (503 + Retry-After)", f"{sum(retries)} over "
                  f"{sum(1 for r in retries if r)} sessions")  # fmt: skip
    result.figure(
        "finish latency median / max (s)",
        f"{median([s for *_, s in finished.values()]):.2f} / "
        f"{max(s for *_, s in finished.values()):.2f}",
    )
    result.figure("writer retries logged by the proxy",
                  log_count(proxy, "event writer lost PostgreSQL"))  # fmt: skip
    failed = {sid: (s, t) for sid, (s, _, t, _) in finished.items() if s != 200}
    result.expect(not failed, f"every finish succeeds once PostgreSQL is back: {failed}")
    result.expect(not errors, "a PostgreSQL restart is invisible to agents (model calls go on)")
    result.expect(log_count(proxy, "gave up after") == 0, "the writer never gives up")
    compare_tokens(result, agents, await stored_tokens(url))
    turns_of = await turns_by_session(url)
    bad = {a.sid: [t["status"] for t in turns_of.get(a.sid, [])] for a in agents
           if [t["status"] for t in turns_of.get(a.sid, [])] != ["completed"] * turns}  # fmt: skip
    result.expect(not bad, f"every turn is recorded completed: {bad}")


# -- 2. a proxy replica SIGKILLed mid-stream ----------------------------------------------------

FINAL_SAMPLES = "SELECT session_id, n_turns FROM samples WHERE is_final"
#: An idle session finished as `timeout`, and how long after its last event.
TIMED_OUT = """
SELECT t.finish_reason, extract(epoch FROM f.recorded_at - (
    SELECT max(recorded_at) FROM events WHERE session_id = $1 AND position < f.position
))::float8 AS idle_s
FROM trajectories t JOIN events f ON f.session_id = t.session_id
WHERE t.session_id = $1 AND t.status = 'timeout' AND f.event_type = 'session_finished'
"""


async def replica_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, max_tokens, delay, lost_after, idle = chaos.sizes.replica_sessions, 64, 0.03, 2.0, 5.0
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", token_delay=delay)
    reaping = {"session_secret": "chaos-shared-secret", "reap_interval": 0.2,
               "replica_lost_after": lost_after, "session_idle_timeout": idle}  # fmt: skip
    a = start_proxy(servers, "replica-a", [engine], url, **reaping)
    b = start_proxy(servers, "replica-b", [engine], url, **reaping)
    async with new_client() as http:
        await wait_ready(servers, http, engine, a, b)
        agents = await create_agents(http, a.url, [f"replica-{i}" for i in range(n)])
        # One more whose orchestrator dies: one turn through B, then nothing, ever.
        [abandoned] = await create_agents(http, a.url, ["replica-abandoned"])
        first = await asyncio.gather(
            *(stream_chat(http, b.url, x, max_tokens, Answer()) for x in [*agents, abandoned])
        )
        for agent, answer in zip([*agents, abandoned], first, strict=True):
            agent.went_on(answer)
        await asyncio.sleep(0.5)
        cut = [Answer() for _ in agents]
        streams = [
            asyncio.create_task(stream_chat(http, b.url, agent, max_tokens, answer))
            for agent, answer in zip(agents, cut, strict=True)
        ]
        await wait_for(lambda: all(x.tokens >= max_tokens // 3 or x.error for x in cut), 60,
                       "every stream through B to be a third through")  # fmt: skip
        killed_at = time.time()
        b.process.send_signal(signal.SIGKILL)
        await asyncio.gather(*streams)
        say(f"  SIGKILLed replica B with {n} streams a third through or more")

        async def give_up(agent: Agent) -> int:
            # The orchestrator ends the episode on the agent's error, at once.
            status, _, _ = await finish(http, a.url, agent)
            return status

        async def go_on(agent: Agent) -> tuple[Answer, int]:
            # The agent retries its turn on A once the reaper has recorded the lost one.
            deadline = time.monotonic() + lost_after + 20
            while time.monotonic() < deadline:
                if any(r["session_id"] == agent.sid for r in await fetch(url, FAILURES)):
                    break
                await asyncio.sleep(0.2)
            answer = await stream_chat(http, a.url, agent, max_tokens, Answer())
            status, _, _ = await finish(http, a.url, agent)
            return answer, status

        early, late = agents[::2], agents[1::2]
        gave_up, outcomes = await asyncio.gather(
            asyncio.gather(*(give_up(agent) for agent in early)),
            asyncio.gather(*(go_on(agent) for agent in late)),
        )
        await asyncio.sleep(max(0.0, killed_at + lost_after + 2.0 - time.time()))
        deadline = time.monotonic() + idle + 15
        while not (timed_out := await fetch(url, TIMED_OUT, abandoned.sid)):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.2)

    turns_of = await turns_by_session(url)
    failures = {r["session_id"]: r for r in await fetch(url, FAILURES)}
    late_ids = {agent.sid for agent in late}
    lost_turns, gaps, latencies, open_turns, wrong = 0, [], [], [], []
    for agent in agents:
        turns = turns_of.get(agent.sid, [])
        whole = [0] if agent.sid not in late_ids else [0, 2]  # the turns that were not cut
        if len(turns) != len(whole) + 1:
            wrong.append(f"{agent.sid}: {len(turns)} turns")
            continue
        for i in whole:
            turn, answer = turns[i], agent.answers[i]
            if turn["status"] != "completed" or turn["completion_tokens"] != answer.tokens:
                wrong.append(f"{agent.sid}: a whole turn {turn['status']}, stored "
                             f"{turn['completion_tokens']} of {answer.tokens}")  # fmt: skip
        killed, received = turns[1], agent.answers[1].tokens
        failure = failures.get(agent.sid)
        if killed["status"] == "in_progress":
            open_turns.append(agent.sid)
        elif killed["failure"] != "replica_lost" or failure is None:
            wrong.append(f"{agent.sid}: {killed['status']} {killed['failure']}")
        else:
            lost_turns += 1
            partial = orjson.loads(failure["payload"])["partial_tokens"]["0"]
            latencies.append(failure["recorded_at"].timestamp() - killed_at)
            gaps.append(received - killed["completion_tokens"])
            if partial != killed["completion_tokens"] or killed["completion_tokens"] > received + 1:
                wrong.append(f"{agent.sid}: partial_tokens {partial}, stored "
                             f"{killed['completion_tokens']}, received {received}")  # fmt: skip
    agent_errors = Counter(x.error for x in cut if x.error)
    result.figure("sessions", f"{n} ({len(early)} finished at once, {len(late)} go on after "
                  "the reaper)")  # fmt: skip
    result.figure("streams cut by the kill (agent errors)", sum(agent_errors.values()))
    result.figure("tokens the cut turns' agents received",
                  sum(agent.answers[1].tokens for agent in agents))  # fmt: skip
    result.figure("turns recorded failed (replica_lost)", lost_turns)
    result.figure(
        "tokens received but not in the log, per lost turn (median / max)",
        f"{median(gaps):.0f} / {max(gaps)}" if gaps else "n/a",
    )
    result.figure(
        "kill -> replica_lost recorded, median / max (s)",
        f"{median(latencies):.2f} / {max(latencies):.2f}" if latencies else "n/a",
    )
    result.figure("retried turns served by A", sum(1 for x, _ in outcomes if x.error is None))
    finishes = [*gave_up, *(s for _, s in outcomes)]
    result.figure("finishes through A", sum(1 for s in finishes if s == 200))
    result.figure("cut turns left in_progress", f"{len(open_turns)} {sorted(open_turns)}")
    result.expect(not wrong, f"turns recorded as promised: {wrong}")
    result.expect(all(x.error is None for x, _ in outcomes), "replica A serves the next turns")
    result.expect(all(s == 200 for s in finishes), "replica A finishes the sessions")
    result.expect(
        not late_ids & set(open_turns),
        "every open turn of an active session is recorded failed (replica_lost) by the reaper",
    )
    async with await EventStore.open(url) as store:
        await Projector(store).run_once()
    final = {r["session_id"]: r["n_turns"] for r in await fetch(url, FINAL_SAMPLES)}
    whole = sum(1 for x in agents if final.get(x.sid) == (2 if x.sid in late_ids else 1))
    result.figure("sessions whose final sample holds their whole turns", f"{whole} of {n}")
    result.expect(whole == n, f"the samples keep the whole turns only: {final}")
    result.figure(
        f"abandoned session finished as timeout (TRAJSTORE_SESSION_IDLE_TIMEOUT={idle:g})",
        f"after {timed_out[0]['idle_s']:.2f} s idle" if timed_out else "no",
    )
    result.expect(
        bool(timed_out) and final.get(abandoned.sid) == 1,
        "a session nobody finishes is finished as timeout, and has its sample",
    )
    early_open = sorted(set(open_turns) - late_ids)
    result.expect(
        not early_open,
        f"the cut turns of sessions finished at once after the kill (before "
        f"TRAJSTORE_REPLICA_LOST_AFTER={lost_after:g} s) are recorded failed too: {early_open}",
    )


# -- 3. an engine SIGKILLed mid-stream ----------------------------------------------------------


async def engine_kill(chaos: Chaos, servers: Servers, result: Result) -> None:
    n, max_tokens, delay = chaos.sizes.engine_sessions, 64, 0.03
    url = await chaos.fresh()
    doomed = start_engine(servers, "engine-1", token_delay=delay)
    spare = start_engine(servers, "engine-2", token_delay=delay)
    proxy = start_proxy(servers, "proxy", [doomed, spare], url)
    # Half the sessions hash to each engine (the proxy's own rendezvous hashing).
    pool = EnginePool([doomed.url, spare.url])
    on: dict[str, list[str]] = {doomed.url: [], spare.url: []}
    for i in range(10 * n):
        sid = f"engine-{i}"
        preferred = on[pool.preferred(sid).url]
        if len(preferred) < n // 2:
            preferred.append(sid)
    async with new_client() as http:
        await wait_ready(servers, http, doomed, spare, proxy)
        agents = await create_agents(http, proxy.url, on[doomed.url] + on[spare.url])
        on_doomed = agents[: n // 2]
        first = await asyncio.gather(
            *(stream_chat(http, proxy.url, x, max_tokens, Answer()) for x in agents)
        )
        for agent, answer in zip(agents, first, strict=True):
            agent.went_on(answer)
        cut = {agent.sid: Answer() for agent in agents}
        streams = [asyncio.create_task(stream_chat(http, proxy.url, x, max_tokens, cut[x.sid]))
                   for x in agents]  # fmt: skip
        await wait_for(lambda: all(cut[x.sid].tokens >= max_tokens // 3 for x in on_doomed), 60,
                       "every stream on engine-1 to be a third through")  # fmt: skip
        killed_at = time.time()
        doomed.process.send_signal(signal.SIGKILL)
        await asyncio.gather(*streams)
        say("  SIGKILLed engine-1 mid-stream")
        for agent in agents:
            agent.went_on(cut[agent.sid])
        refused: Counter[str] = Counter()

        async def turn_with_retries(agent: Agent) -> Answer:
            # As the OpenAI client does: a 502/503 before any token is retried (2 more times).
            for attempt in range(3):
                answer = await stream_chat(http, proxy.url, agent, max_tokens, Answer())
                if answer.status in (502, 503) and attempt < 2:
                    refused[f"HTTP {answer.status}"] += 1
                    await asyncio.sleep(0.5)
                    continue
                break
            agent.went_on(answer)
            return answer

        third = await asyncio.gather(*(turn_with_retries(x) for x in agents))
        fourth = await asyncio.gather(
            *(stream_chat(http, proxy.url, x, max_tokens, Answer()) for x in agents)
        )
        for agent, answer in zip(agents, fourth, strict=True):
            agent.went_on(answer)
        async with http.get(proxy.url + "/admin/engines") as resp:
            engines = {e["url"]: e for e in await resp.json()}
        finishes = [await finish(http, proxy.url, agent) for agent in agents]

    turns_of = await turns_by_session(url)
    after = [t for ts in turns_of.values() for t in ts if t["started_at"].timestamp() > killed_at]
    served_after = Counter(t["engine"] for t in after if t["status"] == "completed")
    reasons = Counter(t["failure"] for ts in turns_of.values() for t in ts if t["failure"])
    cut_errors = [cut[x.sid] for x in agents if cut[x.sid].error]
    result.figure("sessions per engine", f"{len(on[doomed.url])} / {len(on[spare.url])}")
    result.figure("streams cut (agent errors)", len(cut_errors))
    result.figure("turns recorded failed, by reason", dict(reasons))
    result.figure("next turn: first attempts refused", dict(refused) or 0)
    result.figure("next turn: agent errors after retries", sum(1 for x in third if x.error))
    result.figure("turn after: agent errors", sum(1 for x in fourth if x.error))
    result.figure("turns completed after the kill, by engine",
                  {("engine-2" if e == spare.url else e): c
                   for e, c in served_after.items()})  # fmt: skip
    result.figure("engine-1 in /admin/engines",
                  f"healthy={engines[doomed.url]['healthy']} "
                  f"({str(engines[doomed.url]['last_error'])[:60]})")  # fmt: skip
    compare_tokens(result, agents, await stored_tokens(url))
    result.expect(
        len(cut_errors) == len(on_doomed) and all(not cut[x.sid].error for x in agents[n // 2 :]),
        "the kill cuts the streams on engine-1 only",
    )
    result.expect(
        reasons.get("engine_error", 0) >= len(cut_errors),
        "every cut stream is recorded failed (engine_error) with its tokens",
    )
    result.expect(set(served_after) == {spare.url}, "requests after the kill go to engine-2")
    result.expect(
        not any(x.error for x in third + fourth),
        "the sessions of the dead engine go on (after at most two retries)",
    )
    result.expect(not engines[doomed.url]["healthy"], "the dead engine is marked failed")
    result.expect(all(s == 200 for s, *_ in finishes), "every session finishes")
    result.expect(
        not refused,
        "a stream cut mid-way marks its engine failed: the next requests go to engine-2 at once "
        f"(first attempts refused: {dict(refused)})",
    )
