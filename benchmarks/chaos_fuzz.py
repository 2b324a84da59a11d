"""Chaos scenario 6: property-based fuzz of the proxy's HTTP API. Every route of its OpenAPI
schema by schemathesis, and random bodies for the three model-call routes by hypothesis
(benchmarks/chaos_bodies.py draws them); no 5xx, no hang, the proxy healthy after.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

# benchmarks/ is on sys.path when chaos.py runs as a script
from chaos_bodies import model_call_bodies
from chaos_world import (
    Chaos,
    Result,
    fetch,
    log_count,
    say,
    start_engine,
    start_proxy,
    wait_ready,
)
from proxy_overhead import Server, Servers, new_client

#: Seconds a fuzz case may take before it counts as a hang.
CASE_TIMEOUT = 10.0


@dataclass
class RouteTally:
    """What the fuzz sent one route, and what came back."""

    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    unsendable: int = 0  # generated, but the HTTP client refused to send it (a bad header)
    refusals: Counter[str] = field(default_factory=Counter)  # 400s, by the start of the message
    seconds: float = 0.0


def new_session(client: Any, proxy_url: str) -> dict[str, Any]:
    response = client.post(f"{proxy_url}/sessions", json={"run_id": "chaos-fuzz"})
    response.raise_for_status()
    created: dict[str, Any] = response.json()
    return created


def run_cases(strategy: Any, n: int, seed: int, check: Callable[[Any], None]) -> str | None:
    """Feed `n` values of `strategy` to `check` (no shrinking: `check` records, never raises).
    Returns why generation stopped early, if it did."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity

    @hypothesis.seed(seed)
    @hypothesis.settings(
        max_examples=n, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet,
    )  # fmt: skip
    @hypothesis.given(strategy)
    def cases(value: Any) -> None:
        check(value)

    try:
        cases()
    except Exception as exc:  # an operation schemathesis cannot make cases for, for one
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def fuzz_openapi(proxy_url: str, n: int, seed: int, tallies: dict[str, RouteTally]) -> None:
    """Every operation of the proxy's OpenAPI schema, by schemathesis: positive and negative
    cases, and positive ones on a real session with its orchestrator key."""
    import httpx
    import requests
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{proxy_url}/openapi.json", timeout=CASE_TIMEOUT)
    with httpx.Client(timeout=CASE_TIMEOUT) as client:
        session = new_session(client, proxy_url)
    known = {"session_id": session["session_id"]}
    orchestrator = {"authorization": f"Bearer {session['orchestrator_key']}"}
    for operation in (result.ok() for result in schema.get_all_operations()):
        route = f"{operation.method.upper()} {operation.path}"
        tally = tallies.setdefault(route, RouteTally())

        def send(case: Any, tally: RouteTally = tally) -> None:
            try:
                response = case.call(base_url=proxy_url, timeout=CASE_TIMEOUT)
            except requests.exceptions.Timeout:
                tally.failures.append(f"no answer in {CASE_TIMEOUT:g} s: {case.as_curl_command()}")
                return
            except requests.exceptions.ConnectionError as exc:
                tally.failures.append(f"connection failed ({exc}): {case.as_curl_command()}")
                return
            except (requests.exceptions.InvalidHeader, ValueError, UnicodeError):
                tally.unsendable += 1
                return
            tally.cases += 1
            tally.statuses[response.status_code] += 1
            if response.status_code >= 500:
                body = response.content[:200].decode(errors="replace")
                tally.failures.append(
                    f"{response.status_code} {body} <- {case.as_curl_command()[:300]}"
                )

        passes = [
            operation.as_strategy(GenerationMode.POSITIVE),
            operation.as_strategy(GenerationMode.NEGATIVE),
        ]
        if "{session_id}" in operation.path:
            passes.append(
                operation.as_strategy(
                    GenerationMode.POSITIVE, path_parameters=known, headers=orchestrator
                )
            )
        started = time.monotonic()
        for i, strategy in enumerate(passes):
            stopped = run_cases(strategy, n, seed + i, send)
            if stopped and i != 1:  # negative cases of a route without inputs cannot be made
                say(f"    {route}: generation stopped: {stopped}")
        tally.seconds += time.monotonic() - started


MODEL_ROUTES = {"chat": "chat/completions", "messages": "messages", "responses": "responses"}


def fuzz_model_calls(proxy_url: str, n: int, seed: int, tallies: dict[str, RouteTally]) -> None:
    """Random bodies for the three agent APIs, on a session of their own, with the session's
    key (as Bearer or x-api-key), another key, or none; by path or by X-Session-Id."""
    import httpx
    from hypothesis import strategies as st

    with httpx.Client(timeout=CASE_TIMEOUT) as client:
        for api, path in MODEL_ROUTES.items():
            session = new_session(client, proxy_url)
            sid, key = session["session_id"], session["api_key"]
            route = f"POST /sessions/{{id}}/v1/{path}"
            tally = tallies.setdefault(route, RouteTally())
            auths = {
                "bearer": {"Authorization": f"Bearer {key}"},
                "x-api-key": {"x-api-key": key},
                "orchestrator": {"Authorization": f"Bearer {session['orchestrator_key']}"},
                "none": {},
                "wrong": {"Authorization": "Bearer not-a-key"},
            }

            def send(
                case: tuple[bytes, str, str],
                tally: RouteTally = tally,
                sid: str = sid,
                path: str = path,
                auths: dict[str, dict[str, str]] = auths,
            ) -> None:
                body, auth, where = case
                headers = {"Content-Type": "application/json", **auths[auth]}
                url = f"{proxy_url}/sessions/{sid}/v1/{path}"
                if where == "header":
                    url, headers["X-Session-Id"] = f"{proxy_url}/v1/{path}", sid
                elif where == "unknown":
                    url = f"{proxy_url}/sessions/no-such-session/v1/{path}"
                started = time.monotonic()
                try:
                    with client.stream("POST", url, content=body, headers=headers) as response:
                        received = b""
                        for data in response.iter_bytes():
                            received += data
                            if time.monotonic() - started > 2 * CASE_TIMEOUT:
                                raise httpx.ReadTimeout("the answer did not end")
                except httpx.TimeoutException:
                    tally.failures.append(f"hang: {url} {body[:300]!r}")
                    return
                except httpx.TransportError as exc:
                    tally.failures.append(f"{type(exc).__name__}: {exc}: {url} {body[:300]!r}")
                    return
                tally.cases += 1
                tally.statuses[response.status_code] += 1
                if response.status_code >= 500:
                    tally.failures.append(
                        f"{response.status_code} {received[:200]!r} <- {where} {auth} "
                        f"{body[:300]!r}"
                    )
                elif response.status_code == 400:
                    with contextlib.suppress(orjson.JSONDecodeError, AttributeError, TypeError):
                        error = orjson.loads(received)["error"]
                        tally.refusals[str(error.get("message"))[:50]] += 1
                elif b"the proxy failed" in received:  # a bug of ours reported mid-stream
                    tally.failures.append(f"error in a 200 stream: {received[-300:]!r} <- "
                                          f"{body[:300]!r}")  # fmt: skip

            cases = st.tuples(
                model_call_bodies(api),
                st.sampled_from(["bearer"] * 6 + ["x-api-key", "orchestrator", "none", "wrong"]),
                st.sampled_from(["path"] * 6 + ["header", "unknown"]),
            )
            started = time.monotonic()
            stopped = run_cases(cases, n, seed, send)
            tally.seconds += time.monotonic() - started
            if stopped:
                say(f"    {route}: generation stopped: {stopped}")


async def api_fuzz(chaos: Chaos, servers: Servers, result: Result) -> None:
    try:
        import schemathesis
    except ImportError:
        result.error = "schemathesis is not installed: pip install 'schemathesis>=4.32,<5'"
        return
    url = await chaos.fresh()
    engine = start_engine(servers, "engine", completion_tokens=8)
    proxy = start_proxy(servers, "proxy", [engine], url)
    async with new_client() as http:
        await wait_ready(servers, http, engine, proxy)
    tallies: dict[str, RouteTally] = {}
    sizes = chaos.sizes
    say(f"  schemathesis {schemathesis.__version__}, seed {chaos.seed}")
    await asyncio.to_thread(fuzz_openapi, proxy.url, sizes.schema_cases, chaos.seed, tallies)
    # The fuzz's valid `POST /admin/switches` began weight switches nobody ends (the chaos proxy
    # has no admin key): end them, as an operator would, so model calls are not held behind them.
    async with new_client() as http:
        async with http.get(proxy.url + "/admin/switches") as resp:
            switches = await resp.json()
        for begun in switches:
            if begun.get("outcome") is None:
                ended = f"{proxy.url}/admin/switches/{begun['switch_id']}/failed"
                async with http.post(ended, json={"reason": "ended after the fuzz"}) as resp:
                    resp.raise_for_status()
        say(f"  switches the fuzz began, ended: {sum(s.get('outcome') is None for s in switches)}")
    await asyncio.to_thread(fuzz_model_calls, proxy.url, sizes.model_cases, chaos.seed, tallies)
    async with new_client() as http, http.get(proxy.url + "/health") as resp:
        healthy = resp.status == 200
    say(f"  {'route':<44} {'cases':>5} {'s':>5}  statuses")
    for route, tally in tallies.items():
        statuses = " ".join(f"{s}:{c}" for s, c in sorted(tally.statuses.items()))
        extra = f" (+{tally.unsendable} unsendable)" if tally.unsendable else ""
        say(f"  {route:<44} {tally.cases:5d} {tally.seconds:5.1f}  {statuses}{extra}")
        for message, count in tally.refusals.most_common(3):
            say(f"  {'':<44} 400 x {count}: {message}")
    failures = [f"{route}: {f}" for route, t in tallies.items() for f in t.failures]
    for failure in failures[:20]:
        say(f"    {failure}")
    proxy_errors = await fetch(url, "SELECT count(*) AS n FROM turns WHERE failure = 'proxy_error'")
    tracebacks = log_count(proxy, "Traceback")
    result.figure("cases", sum(t.cases for t in tallies.values()))
    result.figure("routes", len(tallies))
    result.figure("5xx or hangs", len(failures))
    result.figure("turns recorded failed as proxy_error", proxy_errors[0]["n"])
    result.figure("tracebacks in the proxy's log", tracebacks)
    result.expect(not failures, "no 5xx and no hang, whatever the request")
    result.expect(healthy and proxy.process.poll() is None, "the proxy is healthy after the fuzz")
    if tracebacks:
        result.note(f"the proxy logged {tracebacks} traceback(s); the first:\n"
                    + first_traceback(proxy))  # fmt: skip


def first_traceback(server: Server) -> str:
    text = server.log.read_text(errors="replace")
    start = text.find("Traceback")
    return text[max(0, text.rfind("\n", 0, start - 1)) : start + 2500]
