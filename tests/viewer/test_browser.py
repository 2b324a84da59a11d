"""The viewer in a real headless browser (Debian's chromium, driven by Playwright), on sessions
recorded through the proxy in front of the fake engine.

Each test writes a screenshot of its page to docs/screenshots/ (the README shows one). Where
chromium or Playwright is missing these tests are skipped and say so; the HTTP-level tests in
test_pages.py still run.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from tests.proxy.fixtures import RunningProxy
from tests.viewer.agents import Agent
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.store.tokens import decode_logprobs
from trajstore.viewer.strip import logprob_colour

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOTS = Path(__file__).parents[2] / "docs" / "screenshots"

if not CHROMIUM.exists():
    pytest.skip(
        f"no browser: {CHROMIUM} is missing (apt-get install chromium); the viewer's HTTP-level "
        "tests (test_pages.py) still run",
        allow_module_level=True,
    )
playwright = pytest.importorskip(
    "playwright.async_api", reason="Playwright for Python is not installed (pip install playwright)"
)

pytestmark = pytest.mark.slow


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    async with playwright.async_playwright() as p:
        launched = await p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
async def page(browser: Any) -> Any:
    return await browser.new_page(viewport={"width": 1280, "height": 900})


async def screenshot(page: Any, name: str) -> None:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(SCREENSHOTS / name), full_page=False)


@pytest.fixture
async def agents(proxy: RunningProxy, store: EventStore) -> dict[str, Agent]:
    """Three sessions of run `browser`: `plain` (three turns), `rewritten` (its third turn
    rewrites the first follow-up question: a divergence), `active` (one turn, not finished)."""
    plain = await Agent.start(proxy, "browser", "add-17-25")
    for _ in range(3):
        await plain.turn()
    await plain.finish(1.0)
    rewritten = await Agent.start(proxy, "browser", "add-17-25")
    await rewritten.turn()
    await rewritten.turn()
    rewritten.rewrite_history()
    await rewritten.turn()
    await rewritten.finish(0.25)
    active = await Agent.start(proxy, "browser", "add-17-26")
    await active.turn()
    await Projector(store).run_once()
    return {"plain": plain, "rewritten": rewritten, "active": active}


async def test_the_run_page_lists_the_run_s_sessions_and_plots_them(
    serve_viewer: Any, tiny_model: Path, agents: dict[str, Agent], page: Any
) -> None:
    url = await serve_viewer(tokenizer=tiny_model)
    await page.goto(f"{url}/")
    await page.click("text=browser")
    listed = await page.eval_on_selector_all(
        "#sessions tbody tr", "rows => rows.map(r => r.dataset.session)"
    )
    assert sorted(listed) == sorted(a.session_id for a in agents.values())
    assert await page.locator(".uplot canvas").count() >= 2  # reward and length plots drawn
    await screenshot(page, "run.png")


async def test_a_session_s_token_colours_follow_the_stored_logprobs_and_mark_the_divergence(
    serve_viewer: Any, tiny_model: Path, agents: dict[str, Agent], page: Any, store: EventStore
) -> None:
    session_id = agents["rewritten"].session_id
    rows = await store.pool.fetch(
        "SELECT branch, divergence, token_ids, loss_mask, logprobs FROM samples "
        "WHERE session_id = $1 ORDER BY branch", session_id,
    )  # fmt: skip
    assert len(rows) == 2  # the rewrite started a second branch
    divergence = rows[1]["divergence"]
    url = await serve_viewer(tokenizer=tiny_model)
    await page.goto(f"{url}/sessions/{session_id}")
    assert await page.locator("details.turn").count() == 3
    # The turn that diverged starts branch 1: its strip is that sample from its first token.
    where = orjson.loads(divergence)
    turn = page.locator(f'details.turn[data-turn="{where["turn"]}"]')
    await turn.locator("summary").click()
    strip = turn.locator(".strip").first
    await strip.wait_for()
    tokens = await strip.evaluate(
        """s => [...s.querySelectorAll('.t')].map(t => ({
            id: Number(t.dataset.id), generated: t.classList.contains('m1'),
            lp: t.dataset.lp, colour: getComputedStyle(t).backgroundColor,
            diverged: t.classList.contains('diverged')}))"""
    )
    stored = rows[1]
    mask = np.frombuffer(stored["loss_mask"], np.uint8)
    logprobs = np.asarray(decode_logprobs(stored["logprobs"]), np.float64)
    assert [t["generated"] for t in tokens] == [bool(m) for m in mask]
    generated = [t for t in tokens if t["generated"]]
    assert generated, "the turn generated tokens"
    for token, logprob in zip(generated, logprobs[mask == 1], strict=True):
        assert float(token["lp"]) == pytest.approx(logprob, abs=1e-5)
        assert token["colour"] == "rgb({}, {}, {})".format(*logprob_colour(logprob))
    # Different logprobs, different colours: the strip is not one flat colour.
    assert len({t["colour"] for t in generated}) > 1
    assert not math.isnan(logprobs[mask == 1][0])
    # The divergence is marked on the token at its position, and named.
    assert [i for i, t in enumerate(tokens) if t["diverged"]] == [where["position"]]
    assert await strip.get_attribute("data-diverged-at") == str(where["position"])
    assert where["reason"] in await turn.inner_text()
    assert "tokenizer" in await turn.locator(".source").inner_text()
    await turn.locator(".divergence").first.scroll_into_view_if_needed()
    await screenshot(page, "session.png")


async def test_an_active_session_s_page_shows_a_new_turn_once_it_is_recorded(
    serve_viewer: Any, tiny_model: Path, agents: dict[str, Agent], page: Any
) -> None:
    active = agents["active"]
    url = await serve_viewer(tokenizer=tiny_model)
    await page.goto(f"{url}/sessions/{active.session_id}")
    assert await page.locator("details.turn").count() == 1
    await page.locator('details.turn[data-turn="0"] summary').click()
    await active.turn()
    # The page follows the log: the new turn appears without a reload, turn 0 stays open.
    await page.locator('details.turn[data-turn="1"]').wait_for(timeout=15_000)
    assert await page.locator('details.turn[data-turn="0"]').get_attribute("open") is not None
    await active.finish(0.5)
    await page.locator("#session-status", has_text="completed").wait_for(timeout=15_000)
    await screenshot(page, "live.png")


def test_the_screenshots_folder_is_the_one_the_readme_names() -> None:
    assert "docs/screenshots/" in (Path(__file__).parents[2] / "README.md").read_text()
