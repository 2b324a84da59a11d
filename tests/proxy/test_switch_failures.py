"""Weight switches that go wrong, or come close together (`proxy.switching`), on the versioned
fake engine: an engine that dies mid-switch, a publish that fails to load, a switch nobody
ends, two switches in a row (the second while the turn is being continued), engines switching
one after the other. Each turn is recorded whole, once, with spans that name the version that
wrote each token; each switch is in the log.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory
from tests.proxy.switching_support import (
    DELAY,
    N,
    begin,
    exact,
    live,
    streamed_chat,
    switch,
    switch_events,
    text_of,
)
from trajstore.publish import Publisher, PublishFailed


async def test_a_switch_nobody_ends_is_given_up_and_its_engine_serves_again(
    start_proxy: ProxyFactory, versioned: FakeEngine, database_url: str
) -> None:
    """A publisher that dies after "going live" and before "live" (or an operator's stray
    switch) leaves no engine held: past twice the hold bound the switch is recorded failed."""
    proxy = await start_proxy([versioned.url], switch_hold_timeout=0.5)
    session = await proxy.new_session()
    await begin(proxy, "1")
    await asyncio.sleep(1.5)
    answer = await proxy.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8
    )
    assert answer.choices[0].message.content  # served, on the version it had
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert exact(turn["choices"][0], 8) == ["0"]
    kinds = await switch_events(database_url)
    assert [k["event_type"] for k in kinds] == ["policy_switch_began", "policy_switch_failed"]
    assert "no word within" in kinds[1]["reason"]


async def test_an_engine_that_dies_mid_switch_hands_its_turn_to_another(
    start_proxy: ProxyFactory, two_versioned: tuple[FakeEngine, FakeEngine], database_url: str
) -> None:
    first, second = two_versioned
    proxy = await start_proxy([first.url, second.url])
    session = await proxy.new_session()
    served = proxy.app.state.proxy.engines.preferred(session["session_id"]).url
    dying, other = (first, second) if served == first.url else (second, first)

    async def dies_mid_switch() -> None:
        switch_id = await begin(proxy, "1")  # both engines
        other.version = "1"
        await dying.stop()  # its weights never loaded: it is gone
        await live(proxy, switch_id)

    text, _ = await streamed_chat(proxy, session, 30, dies_mid_switch)
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["status"] == "completed"
    assert exact(turn["choices"][0]) == ["0", "1"]
    assert text == text_of(turn["choices"][0]["token_ids"])
    events = await switch_events(database_url)
    assert [(e["event_type"], e["interrupted"]) for e in events] == [
        ("policy_switch_began", 1), ("policy_switch_live", None)
    ]  # fmt: skip


async def test_a_publish_that_fails_to_load_goes_on_with_the_old_version(
    start_proxy: ProxyFactory, database_url: str, tmp_path: Path
) -> None:
    async with FakeEngine(versioned=True, token_delay=DELAY, fail_reload=True) as engine:
        proxy = await start_proxy([engine.url])
        session = await proxy.new_session()
        publisher = Publisher(engine.url, proxy.url, tmp_path)
        failure: list[BaseException] = []

        async def publish() -> None:
            try:
                await publisher.load(tmp_path / "v1", 1)
            except PublishFailed as exc:
                failure.append(exc)

        text, _ = await streamed_chat(proxy, session, 30, publish)
        await publisher.close()
    assert failure and "cannot load" in str(failure[0])
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert exact(turn["choices"][0]) == ["0"]  # cut, and continued on the same weights
    assert text == text_of(turn["choices"][0]["token_ids"])
    kinds = await switch_events(database_url)
    assert [k["event_type"] for k in kinds] == ["policy_switch_began", "policy_switch_failed"]
    assert "cannot load" in kinds[1]["reason"]
    assert proxy.app.state.proxy.engines.engines[0].policy_version == "0"


async def test_two_switches_in_a_row_the_second_while_the_turn_is_being_continued(
    start_proxy: ProxyFactory, versioned: FakeEngine, database_url: str
) -> None:
    proxy = await start_proxy([versioned.url])
    session = await proxy.new_session()

    async def twice() -> None:
        await switch(proxy, versioned, "1")
        # At once: the continuation is on its way to the engine, or just started.
        await switch(proxy, versioned, "2")
        await asyncio.sleep(10 * DELAY)
        await switch(proxy, versioned, "3")

    text, _ = await streamed_chat(proxy, session, 30, twice)
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    versions = exact(turn["choices"][0])
    assert versions[0] == "0" and versions[-1] == "3"
    assert versions == sorted(versions)
    assert text == text_of(turn["choices"][0]["token_ids"])
    events = await switch_events(database_url)
    kinds = [e["event_type"] for e in events]
    assert kinds == ["policy_switch_began", "policy_switch_live"] * 3
    cut = [e["interrupted"] for e in events if e["event_type"] == "policy_switch_began"]
    # The first cut the turn; the last cut it again while a continuation streamed it; the
    # second, at once, found it held or just continued (either way one turn, exact spans).
    assert cut[0] == 1 and cut[2] == 1


async def test_engines_switching_one_after_the_other_keep_their_sessions(
    start_proxy: ProxyFactory, two_versioned: tuple[FakeEngine, FakeEngine], database_url: str
) -> None:
    first, second = two_versioned
    proxy = await start_proxy([first.url, second.url])
    pool = proxy.app.state.proxy.engines
    sessions: dict[str, dict[str, Any]] = {}
    for k in range(40):  # one session that prefers each engine
        session = await proxy.new_session(session_id=f"sticky-{k}")
        sessions.setdefault(pool.preferred(session["session_id"]).url, session)
        if len(sessions) == 2:
            break
    engines = {first.url: first, second.url: second}

    async def one_after_the_other() -> None:
        await switch(proxy, first, "1")
        await asyncio.sleep(10 * DELAY)
        await switch(proxy, second, "1")

    async def turn(session: dict[str, Any]) -> str:
        agent = proxy.agent(session)
        stream = await agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "go"}], max_tokens=N,
            stream=True,
        )  # fmt: skip
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    reading = [asyncio.create_task(turn(s)) for s in sessions.values()]
    await asyncio.sleep(30 * DELAY)
    await one_after_the_other()
    texts = await asyncio.gather(*reading)
    for (url, session), text in zip(sessions.items(), texts, strict=True):
        [recorded] = (await proxy.session_record(session["session_id"]))["turns"]
        assert recorded["engine"] == url  # sticky: the session stayed on its engine
        assert exact(recorded["choices"][0]) == ["0", "1"]
        assert text == text_of(recorded["choices"][0]["token_ids"])
    assert all(e.version == "1" for e in engines.values())
    events = await switch_events(database_url)  # one switch an engine, each cutting its turn
    assert [(e["event_type"], e["interrupted"]) for e in events] == [
        ("policy_switch_began", 1), ("policy_switch_live", None)
    ] * 2  # fmt: skip
