"""How the templates write numbers, durations, times and JSON."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import orjson


def number(value: Any, digits: int = 3) -> str:
    """A float to `digits` significant digits; ints with thousands separators; — for none."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.{digits}g}"


def seconds(value: Any) -> str:
    """A duration people read: 12 ms, 1.4 s, 3 min 2 s."""
    if value is None:
        return "—"
    value = float(value)
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 60:
        return f"{value:.2f} s"
    return f"{int(value // 60)} min {value % 60:.0f} s"


def when(value: Any) -> str:
    """A timestamp (datetime or epoch seconds) in UTC, to the second."""
    if value is None:
        return "—"
    moment = value if isinstance(value, datetime) else datetime.fromtimestamp(float(value), UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def as_json(value: Any) -> str:
    """JSON, indented, for people."""
    if isinstance(value, bytes | bytearray):
        value = orjson.loads(value)
    text: str = orjson.dumps(value, option=orjson.OPT_INDENT_2, default=str).decode()
    return text


#: Ranges of turns a list of turns shows before it is cut.
RANGES_SHOWN = 6


def turn_ranges(turns: list[int]) -> str:
    """Turns as ranges ("0–48, 50–98, …"), cut after `RANGES_SHOWN` of them: a main loop's
    sample of thousands of turns is one line."""
    ranges: list[list[int]] = []
    for turn in turns:
        if ranges and ranges[-1][1] == turn - 1:
            ranges[-1][1] = turn
        else:
            ranges.append([turn, turn])
    text = ", ".join(str(lo) if lo == hi else f"{lo}–{hi}" for lo, hi in ranges[:RANGES_SHOWN])
    return text + (", …" if len(ranges) > RANGES_SHOWN else "")


ALL: dict[str, Callable[..., str]] = {
    "number": number, "seconds": seconds, "when": when, "as_json": as_json,
    "turn_ranges": turn_ranges,
}  # fmt: skip


def colour(logprob: float) -> str:
    """The background a generated token with this logprob gets (`strip.logprob_colour`)."""
    from trajstore.viewer.strip import logprob_colour

    red, green, blue = logprob_colour(logprob)
    return f"rgb({red},{green},{blue})"


ALL["colour"] = colour
