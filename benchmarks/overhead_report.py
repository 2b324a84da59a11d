"""The tables and ratios `proxy_overhead.py` prints: medians over runs, each target against the
floor, the baseline, chat (other APIs), direct (a real engine) and tracing off (`--tracing`); and
the table of the benchmarks that send one request at a time (`continuation.py`, `relay.py`)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from overhead_load import Sample, percentile

#: The proxies whose ratios to the floor are printed: this checkout's, and the baseline's.
PROXIES = ("trajstore", "trajstore-baseline")


# -- report -------------------------------------------------------------------------------------


@dataclass
class Row:
    """Medians over the runs of one (target, mode, concurrency)."""

    rps: float
    p50: float
    p99: float
    ttft: float
    cpu: dict[str, float]  # ms per request
    errors: int


def summarise(samples: list[Sample]) -> Row:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    def per_request(key: str) -> float:
        return med([1000 * s.cpu[key] / max(s.requests, 1) for s in samples])

    return Row(
        rps=med([s.requests / s.seconds for s in samples]),
        p50=med([1000 * percentile(s.latencies, 0.5) for s in samples]),
        p99=med([1000 * percentile(s.latencies, 0.99) for s in samples]),
        ttft=med([1000 * percentile(s.ttfts, 0.5) for s in samples]),
        cpu={key: per_request(key) for key in samples[0].cpu},
        errors=sum(s.errors for s in samples),
    )


def fmt(value: float | None, spec: str = "8.2f") -> str:
    width = int(spec.split(".")[0])
    if value is None or value != value:  # None or NaN
        return "n/a".rjust(width)
    return format(value, spec)


def print_table(rows: dict[tuple[str, str, int], Row]) -> None:
    print(
        f"{'target':<19} {'mode':<10} {'conc':>4} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'+p50 ms':>8} {'ttft ms':>8} {'cpu/req':>8} {'db/req':>8} {'eng/req':>8} "
        f"{'cli/req':>8} {'errors':>6}"
    )
    for (name, mode, conc), row in rows.items():
        direct = rows[("direct", mode, conc)]
        print(
            f"{name:<19} {mode:<10} {conc:>4} {row.rps:8.0f} {row.p50:8.2f} {row.p99:8.2f} "
            f"{fmt(None if name == 'direct' else row.p50 - direct.p50)} "
            f"{fmt(row.ttft if mode == 'stream' else None)} "
            f"{fmt(None if name.startswith('direct') else row.cpu['target'], '8.3f')} "
            f"{fmt(row.cpu.get('db'), '8.3f')} {row.cpu['engine']:8.3f} "
            f"{row.cpu['client']:8.3f} {row.errors:6d}"
        )
    print(
        "(+p50: p50 minus direct's; cpu/req: the target server's CPU ms per request; db/req: "
        "trajstore's PostgreSQL backends'; eng/req: the engine's; cli/req: the load generator's)"
    )


def print_ratios(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\nCPU/request ÷ floor CPU/request (target ≤ 2×; with its db backends):")
    for name in [*PROXIES, "floor-asgi"]:
        for mode in ("non-stream", "stream"):
            if (name, mode, levels[0]) not in rows:
                continue
            parts = []
            for conc in levels:
                ours, floor = rows[(name, mode, conc)].cpu, rows[("floor", mode, conc)].cpu
                ratio = ours["target"] / floor["target"]
                with_db = (ours["target"] + ours.get("db", 0.0)) / floor["target"]
                parts.append(f"c={conc} {ratio:.2f}× ({with_db:.2f}×)")
            print(f"  {name:<18} {mode:<10} " + "   ".join(parts))
    if ("trajstore-baseline", "stream", levels[0]) in rows:
        print("trajstore CPU/request ÷ the baseline's (same run):")
        for mode in ("non-stream", "stream"):
            parts = []
            for conc in levels:
                ours = rows[("trajstore", mode, conc)].cpu["target"]
                base = rows[("trajstore-baseline", mode, conc)].cpu["target"]
                parts.append(f"c={conc} {ours / base:.2f}× ({ours:.3f} / {base:.3f} ms)")
            print(f"  {mode:<10} " + "   ".join(parts))
    print("trajstore added p50 vs direct at concurrency 1 (target ≤ 1 ms):")
    for mode in ("non-stream", "stream"):
        direct, floor = rows[("direct", mode, 1)], rows[("floor", mode, 1)]
        ours = rows[("trajstore", mode, 1)]
        print(
            f"  {mode:<10} {ours.p50 - direct.p50:.3f} ms "
            f"(floor {floor.p50 - direct.p50:.3f} ms; trajstore over floor "
            f"{ours.p50 - floor.p50:.3f} ms)"
        )
    top = max(levels)
    print(f"trajstore p99 ÷ floor p99 at concurrency {top} (target ≤ 1.5×):")
    for mode in ("non-stream", "stream"):
        ours, floor = rows[("trajstore", mode, top)], rows[("floor", mode, top)]
        print(f"  {mode:<10} {ours.p99 / floor.p99:.2f}× ({ours.p99:.1f} / {floor.p99:.1f} ms)")


def print_apis(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\neach agent API's CPU/request through trajstore ÷ chat's (target ≤ 1.2×):")
    for api in ("messages", "responses"):
        for mode in ("non-stream", "stream"):
            parts = []
            for conc in levels:
                chat = rows[("trajstore", mode, conc)].cpu["target"]
                ours = rows[(f"trajstore-{api}", mode, conc)].cpu["target"]
                parts.append(f"c={conc} {ours / chat:.2f}× ({ours:.3f} / {chat:.3f} ms)")
            print(f"  {api:<9} {mode:<10} " + "   ".join(parts))


def print_tracing(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\ntracing on: CPU/request ÷ tracing off's (same run, target ≤ 1.05×):")
    for name in ("trajstore-traced", "trajstore-traced-down"):
        for mode in ("non-stream", "stream"):
            parts = []
            for conc in levels:
                off = rows[("trajstore", mode, conc)]
                on = rows[(name, mode, conc)]
                ratio = on.cpu["target"] / off.cpu["target"]
                parts.append(
                    f"c={conc} {ratio:.3f}× ({on.cpu['target']:.3f} / {off.cpu['target']:.3f} ms"
                    f", p50 {on.p50 - off.p50:+.2f} ms)"
                )
            print(f"  {name:<22} {mode:<10} " + "   ".join(parts))


def print_throughput(rows: dict[tuple[str, str, int], Row], levels: list[int]) -> None:
    print("\nagainst the real engine, trajstore req/s ÷ direct req/s (target ≥ 0.95×):")
    for mode in ("non-stream", "stream"):
        parts = []
        for conc in levels:
            ours, direct = rows[("trajstore", mode, conc)], rows[("direct", mode, conc)]
            parts.append(f"c={conc} {ours.rps / direct.rps:.2f}×")
        print(f"  {mode:<10} " + "   ".join(parts))
    print(
        "the engine asked directly for what trajstore asks it (token ids, logprobs) ÷ direct, "
        "and trajstore ÷ that (the proxy's own share):"
    )
    for mode in ("non-stream", "stream"):
        parts = []
        for conc in levels:
            direct = rows[("direct", mode, conc)]
            asked = rows[("direct+ids", mode, conc)]
            ours = rows[("trajstore", mode, conc)]
            parts.append(f"c={conc} {asked.rps / direct.rps:.2f}× / {ours.rps / asked.rps:.2f}×")
        print(f"  {mode:<10} " + "   ".join(parts))


def print_sequential(
    cpu: dict[str, list[float]],
    latency: dict[str, list[float]],
    names: tuple[str, ...],
    per: str,
    widths: tuple[int, int],
) -> None:
    """A row per path of requests sent one at a time: its CPU ms per `per` (request, turn),
    median of the runs' figures in `cpu`, then the p50 and p90 of all its `latency` seconds;
    `widths`: of the name column and of the CPU column."""
    name_width, cpu_width = widths
    title = f"CPU ms/{per} (median of runs)"
    print(f"{'':{name_width}}{title:>{cpu_width}}{'p50 ms':>10}{'p90 ms':>10}")
    for name in names:
        cuts = statistics.quantiles(latency[name], n=10)
        print(f"{name:{name_width}}{1e3 * statistics.median(cpu[name]):{cpu_width}.3f}"
              f"{1e3 * statistics.median(latency[name]):10.2f}{1e3 * cuts[8]:10.2f}")  # fmt: skip
