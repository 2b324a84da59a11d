"""A session's lineages on its page: a tree (which conversation forked from which) with a strip
each; and a session of thousands of turns and dozens of lineages, whose page stays small."""

from __future__ import annotations

import re

import httpx

from tests.long_session import record_long_session
from tests.support import RecordedSession
from trajstore.store import EventStore

SYSTEM = list(range(1, 21))  # the harness's 20-token system prompt, shared by its sub-agent


def lineage_rows(html: str) -> list[tuple[str, str, str, str | None]]:
    """(lineage, role, depth, parent) of each row of the tree, in order."""
    found = re.findall(
        r'<li class="lineage[^"]*" data-lineage="(\d+)" data-role="(\w+)" data-depth="(\d+)"'
        r'(?: data-parent="(\d+)")?',
        html,
    )
    return [(lineage, role, depth, parent or None) for lineage, role, depth, parent in found]


def lane(html: str, lineage: int) -> list[tuple[float, float]]:
    """(left, width) of each segment of a lineage's strip."""
    row = html.split(f'data-lineage="{lineage}" data-role')[1].split("</li>")[0]
    return [(float(a), float(b)) for a, b in re.findall(r"left:([\d.]+)%;width:([\d.]+)%", row)]


async def test_a_session_s_conversations_show_as_a_tree_with_a_strip_each(
    store: EventStore, client: httpx.AsyncClient
) -> None:
    # M1, S1, T, M2, S2: a main loop, a sub-agent that repeats its system prompt, a title call.
    session = RecordedSession(store, "forest")
    await session.created()
    calls = [
        ("m1", [*SYSTEM, 100], [200, 2]),
        ("s1", [*SYSTEM, 300], [400, 2]),
        ("t", [900, 901], [902]),
        ("m2", [*SYSTEM, 100, 200, 2, 101], [201]),
        ("s2", [*SYSTEM, 300, 400, 2, 301], [401]),
    ]
    for n, (request_id, prompt, completion) in enumerate(calls):
        received = {"request_id": request_id, "body": {}, "received_at": float(n)}
        await session.turn(received, prompt, completion)
    await session.finished()

    page = (await client.get("/sessions/forest")).text
    # The main loop first, its sub-agent under it (forked after the system prompt), the title
    # call a root of its own.
    assert lineage_rows(page) == [("0", "main", "0", None), ("1", "subagent", "1", "0"),
                                  ("2", "side", "0", None)]  # fmt: skip
    assert "forked from lineage 0 at 20 tokens" in page
    # Each strip marks the turns its conversation made, out of the session's five.
    assert lane(page, 0) == [(0.0, 20.0), (60.0, 20.0)]
    assert lane(page, 1) == [(20.0, 20.0), (80.0, 20.0)]
    assert lane(page, 2) == [(40.0, 20.0)]
    assert re.findall(r'<tr data-lineage="(\d+)" data-branch="(\d+)"', page) == [
        ("0", "0"), ("1", "0"), ("2", "0")
    ]  # fmt: skip


async def test_a_session_of_thousands_of_turns_has_a_small_page(
    store: EventStore, client: httpx.AsyncClient
) -> None:
    await record_long_session(store, 3_000, side_every=20)  # a main loop and 150 title calls
    page = await client.get("/sessions/long")
    assert page.status_code == 200
    # 100 turns a page, 50 lineages listed and the others counted, strips of 400 cells at most.
    assert len(page.text) < 400_000
    assert len(re.findall(r'<details class="turn"', page.text)) == 100
    rows = lineage_rows(page.text)
    assert len(rows) == 50 and rows[0] == ("0", "main", "0", None)
    assert "and 101 more lineages (101 side), not listed" in page.text
    assert len(lane(page.text, 0)) < 400
    assert "0–18, 20–38, 40–58, 60–78, 80–98, 100–118, …" in page.text
    last = await client.get("/sessions/long?page=30")
    assert 'data-turn="2999"' in last.text
    body = await client.get("/sessions/long/turns/2998")  # the main loop's last turn
    assert body.status_code == 200 and 'class="t m1' in body.text
