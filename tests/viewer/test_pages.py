"""The viewer's pages over HTTP, on a real PostgreSQL with the sessions of
tests/store/views_data.py (s1..s4 in run r1, s5 discarded and s6 active in run r2; s3's second
turn rewrites the history at position 21, after
its 20-token system prompt)."""

from __future__ import annotations

import re

import asyncpg
import httpx
import numpy as np
import pytest

from trajstore.store import EventStore
from trajstore.store.tokens import decode_logprobs, decode_token_ids

pytestmark = pytest.mark.usefixtures("recorded")


def sessions_listed(html: str) -> list[str]:
    return re.findall(r'<tr data-session="([^"]+)"', html)


def strip_tokens(html: str) -> list[tuple[int, str, str | None]]:
    """(id, class, data-lp) of every token of the strips in a turn's body."""
    found = re.findall(r'<span class="t (m[01][^"]*)" data-id="(\d+)"(?: data-lp="([^"]+)")?', html)
    return [(int(token), cls, lp or None) for cls, token, lp in found]


async def test_the_runs_page_lists_each_run_with_its_sessions_by_status(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/")
    assert page.status_code == 200
    assert re.findall(r'<tr data-run="([^"]+)"', page.text) == ["r2", "r1"]  # newest first
    r1 = page.text.split('data-run="r1"')[1].split("</tr>")[0]
    assert "completed 3" in r1 and "timeout 1" in r1


async def test_a_run_page_shows_its_figures_and_all_its_sessions(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/runs/r1")
    assert page.status_code == 200
    assert sessions_listed(page.text) == ["s1", "s2", "s3", "s4"]
    # Rewards 1.0, 0.5 (corrected from 0.0), 1.0: mean 0.833; s4 timed out without one.
    assert "<b>0.833</b><span>mean reward (3 rewarded)" in page.text
    assert '<div id="plot-reward"' in page.text and "uPlot.iife.min.js" in page.text


@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("status=timeout", ["s4"]),
        ("task=B", ["s3", "s4"]),
        ("reward_min=0.9", ["s1", "s3"]),
        ("reward_min=0.2&reward_max=0.6", ["s2"]),
        ("divergence=yes", ["s3"]),
        ("divergence=no&task=A", ["s1", "s2"]),
        ("sort=reward&order=desc", ["s1", "s3", "s2", "s4"]),  # no reward last
        ("status=&task=&reward_min=", ["s1", "s2", "s3", "s4"]),  # an empty form field: any
    ],
)
async def test_a_run_s_sessions_filter_and_sort(
    client: httpx.AsyncClient, query: str, expected: list[str]
) -> None:
    page = await client.get(f"/runs/r1?{query}")
    assert page.status_code == 200
    assert sessions_listed(page.text) == expected


async def test_discarded_sessions_can_be_picked_out(client: httpx.AsyncClient) -> None:
    assert sessions_listed((await client.get("/runs/r2?discarded=yes")).text) == ["s5"]
    assert sessions_listed((await client.get("/runs/r2?discarded=no")).text) == ["s6"]


@pytest.mark.parametrize(
    "query",
    ["reward_min=abc", "reward_min=nan", "status=finished", "sort=session_id;drop", "order=up",
     "divergence=maybe", "page=0", "page=x", "reward_min=2&reward_max=1", "colour=red"],
)  # fmt: skip
async def test_a_malformed_filter_is_a_400_page(client: httpx.AsyncClient, query: str) -> None:
    page = await client.get(f"/runs/r1?{query}")
    assert page.status_code == 400
    assert "text/html" in page.headers["content-type"]
    assert 'data-status="400"' in page.text


@pytest.mark.parametrize(
    "path",
    ["/runs/nope", "/sessions/nope", "/sessions/s1/turns/7", "/sessions/s1/summary?page=3",
     "/sessions/nope/live", "/nowhere"],
)  # fmt: skip
async def test_an_unknown_run_session_or_turn_is_a_404_page(
    client: httpx.AsyncClient, path: str
) -> None:
    page = await client.get(path)
    assert page.status_code == 404
    assert 'data-status="404"' in page.text


@pytest.mark.parametrize("path", ["/sessions/s1/turns/x", "/sessions/s1?page=-1"])
async def test_a_malformed_path_or_page_is_a_400_page(client: httpx.AsyncClient, path: str) -> None:
    assert (await client.get(path)).status_code == 400


@pytest.mark.parametrize("method", ["POST", "PUT", "PATCH", "DELETE"])
async def test_the_viewer_answers_no_write_method(client: httpx.AsyncClient, method: str) -> None:
    for path in ("/", "/runs/r1", "/sessions/s1", "/sessions/s1/turns/0"):
        page = await client.request(method, path, json={"status": "completed"})
        assert page.status_code == 405, path
        assert "GET" in page.headers["allow"]


async def test_the_viewer_s_connections_refuse_to_write(
    viewer_store: EventStore, store: EventStore
) -> None:
    before = await store.pool.fetchval("SELECT count(*) FROM events")
    with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
        await viewer_store.pool.execute(
            "INSERT INTO events (event_id, stream_id, stream_version, event_type) "
            "VALUES (gen_random_uuid(), 'session-x', 1, 'session_created')"
        )
    with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
        await viewer_store.pool.execute("DELETE FROM samples")
    assert await store.pool.fetchval("SELECT count(*) FROM events") == before


async def test_a_session_page_shows_its_samples_divergence_and_turns(
    client: httpx.AsyncClient,
) -> None:
    page = await client.get("/sessions/s3")
    assert page.status_code == 200
    assert 'data-divergence-turn="1" data-divergence-position="21"' in page.text
    assert "history_rewritten" in page.text
    assert re.findall(r'<details class="turn" data-turn="(\d+)"', page.text) == ["0", "1"]
    assert "projected (version 1)" in page.text


async def test_a_turn_s_strip_is_its_part_of_the_stored_sample(
    client: httpx.AsyncClient, store: EventStore
) -> None:
    # s3's turn 1 starts branch 1, which holds its whole prompt then its completion.
    row = await store.pool.fetchrow(
        "SELECT token_ids, loss_mask, logprobs FROM samples WHERE session_id = 's3' AND branch = 1"
    )
    body = (await client.get("/sessions/s3/turns/1")).text
    tokens = strip_tokens(body)
    assert [t for t, _, _ in tokens] == np.asarray(decode_token_ids(row["token_ids"])).tolist()
    assert [int(c.startswith("m1")) for _, c, _ in tokens] == list(row["loss_mask"])
    stored = np.asarray(decode_logprobs(row["logprobs"]))
    shown = [float(lp) for _, c, lp in tokens if c.startswith("m1")]
    assert shown == pytest.approx(stored[np.frombuffer(row["loss_mask"], np.uint8) == 1].tolist())
    # The divergence is marked on the first token after the shared system prompt, and said.
    assert 'data-diverged-at="21"' in body
    assert tokens[21][1] == "m0 diverged"
    assert [c for _, c, _ in tokens].count("m0 diverged") == 1
    assert "history_rewritten</b> at position 21" in body


async def test_an_extending_turn_shows_only_what_it_added(client: httpx.AsyncClient) -> None:
    # s1: [1,10] -> [20,2]; then [1,10,20,2,30] -> [40,2]: turn 1 adds 30 (glue), then 40, 2.
    tokens = strip_tokens((await client.get("/sessions/s1/turns/1")).text)
    assert [(t, c) for t, c, _ in tokens] == [(30, "m0"), (40, "m1"), (2, "m1")]


async def test_a_failed_turn_shows_its_tokens_outside_any_sample(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.get("/sessions/s4/turns/1")).text
    assert "engine_error" in body and "in no sample (failed)" not in body  # it made no tokens
    assert "No tokens recorded" in body


async def test_without_a_tokenizer_or_engine_the_strip_shows_ids_and_says_so(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.get("/sessions/s1/turns/0")).text
    assert re.search(r'data-source="token ids \(the engine e1 did not answer\)"', body)
    assert ">⟨20⟩</span>" in body
