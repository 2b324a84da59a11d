"""Weight switches without a drain (`proxy.switching`), on the fake engine with versions.

The versioned fake engine writes every token's logprob as its version's (`version_logprob`), at
the moment the token leaves it; so the record says, token by token, which version truly
generated each token, and every test checks that the recorded spans say the same: no turn is
recorded with a version that did not produce it. And nothing is lost: each turn has all its
tokens, once, and the agent read exactly them.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anthropic
import orjson
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import content_text, version_logprob
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.publish import Publisher, PublishFailed
from trajstore.store import EventStore
from trajstore.store.payloads import PolicyVersionSet

N = 120  # tokens of each turn
DELAY = 0.01  # seconds per token: a turn streams for about a second


@pytest.fixture
async def versioned() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(versioned=True, token_delay=DELAY) as fake:
        yield fake


@pytest.fixture
async def two_versioned() -> AsyncIterator[tuple[FakeEngine, FakeEngine]]:
    """Two versioned engines, for a proxy that spreads its sessions over both."""
    async with (
        FakeEngine(versioned=True, token_delay=DELAY) as first,
        FakeEngine(versioned=True, token_delay=DELAY) as second,
    ):
        yield first, second


async def switch_events(database_url: str) -> list[Any]:
    """The switches' events in log order: each one's type and its reason (a failure's)."""
    async with await EventStore.open(database_url) as store:
        return await store.fetch(
            "SELECT event_type, payload ->> 'reason' AS reason FROM events "
            "WHERE stream_id LIKE 'switch-%' ORDER BY position"
        )


async def begin(proxy: RunningProxy, version: str, engines: list[str] | None = None) -> str:
    """Begin a switch; return its id once the proxy answered (its engines' turns are cut)."""
    body: dict[str, Any] = {"version": version, "checkpoint": f"/ckpt/v{version}"}
    if engines is not None:
        body["engines"] = engines
    answer = await proxy.http.post(f"{proxy.url}/admin/switches", json=body)
    assert answer.status_code == 201, answer.text
    return str(answer.json()["switch_id"])


async def live(proxy: RunningProxy, switch_id: str) -> None:
    answer = await proxy.http.post(f"{proxy.url}/admin/switches/{switch_id}/live")
    assert answer.status_code == 200, answer.text


async def switch(proxy: RunningProxy, engine: FakeEngine, version: str) -> None:
    """A whole switch of `engine`, as a trainer does it: begin, load, live."""
    switch_id = await begin(proxy, version, [engine.url])
    engine.version = version
    await live(proxy, switch_id)


def exact(choice: dict[str, Any], n: int = N) -> list[str]:
    """Check that the choice has its `n` tokens, and spans that cover them in order and name
    the version that generated each; return the spans' versions."""
    spans = choice["version_spans"]
    assert len(choice["token_ids"]) == n
    assert spans[0]["start"] == 0 and spans[-1]["end"] == n
    for before, after in itertools.pairwise(spans):
        assert before["end"] == after["start"] and before["version"] != after["version"]
    for span in spans:
        wrote = set(choice["logprobs"][span["start"] : span["end"]])
        assert wrote == {version_logprob(span["version"])}, span
    return [span["version"] for span in spans]


def text_of(ids: list[int]) -> str:
    return "".join(content_text(t) for t in ids)


async def streamed_chat(
    proxy: RunningProxy, session: dict[str, Any], after: int, action: Callable[[], Awaitable[None]]
) -> tuple[str, asyncio.Task[None]]:
    """Stream a chat turn of N tokens; `after` tokens in, start `action`. Return the text the
    agent read, and the action's task."""
    agent = proxy.agent(session)
    stream = await agent.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=N, stream=True
    )
    text, started = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
        if started is None and len(text) > after:
            started = asyncio.create_task(action())
    assert started is not None
    await started
    return "".join(text), started


async def test_each_api_reads_one_answer_across_a_switch(
    start_proxy: ProxyFactory, versioned: FakeEngine
) -> None:
    proxy = await start_proxy([versioned.url])
    session = await proxy.new_session()
    # Chat.
    text, _ = await streamed_chat(proxy, session, 30, lambda: switch(proxy, versioned, "1"))
    # Completions.
    agent = proxy.agent(session)
    chunks = await agent.completions.create(model="tiny", prompt="count", max_tokens=N, stream=True)
    completion, task = [], None
    async for chunk in chunks:
        completion.append(chunk.choices[0].text if chunk.choices else "")
        if task is None and len(completion) > 30:
            task = asyncio.create_task(switch(proxy, versioned, "2"))
    assert task is not None
    await task
    # Anthropic Messages.
    claude = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    message, task = [], None
    async with claude.messages.stream(
        model="tiny", max_tokens=N, messages=[{"role": "user", "content": "count"}]
    ) as events:
        async for piece in events.text_stream:
            message.append(piece)
            if task is None and len(message) > 30:
                task = asyncio.create_task(switch(proxy, versioned, "3"))
    assert task is not None
    await task
    # OpenAI Responses.
    responses = await agent.responses.create(
        model="tiny", input="count", max_output_tokens=N, stream=True
    )
    said, task = [], None
    async for event in responses:
        if event.type == "response.output_text.delta":
            said.append(event.delta)
            if task is None and len(said) > 30:
                task = asyncio.create_task(switch(proxy, versioned, "4"))
    assert task is not None
    await task

    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["status"] for t in turns] == ["completed"] * 4
    choices = [t["choices"][0] for t in turns]
    assert [exact(c) for c in choices] == [["0", "1"], ["1", "2"], ["2", "3"], ["3", "4"]]
    for read, choice in zip((text, completion, message, said), choices, strict=True):
        assert "".join(read) == text_of(choice["token_ids"])  # one answer, its own tokens
    assert [c["finish_reason"] for c in choices] == ["length"] * 4


async def test_a_turn_in_flight_without_a_stream_is_generated_on_the_new_version(
    start_proxy: ProxyFactory, versioned: FakeEngine
) -> None:
    proxy = await start_proxy([versioned.url])
    session = await proxy.new_session()
    agent = proxy.agent(session)
    asked = asyncio.create_task(
        agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=N
        )
    )
    await asyncio.sleep(N * DELAY / 3)
    await switch(proxy, versioned, "1")
    reply = await asked
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert exact(turn["choices"][0]) == ["1"]
    assert reply.choices[0].message.content == text_of(turn["choices"][0]["token_ids"])
    assert len(versioned.requests) == 2  # sent again whole: the first was cut, never recorded


async def test_requests_arriving_during_a_switch_wait_and_are_the_new_versions(
    start_proxy: ProxyFactory, versioned: FakeEngine
) -> None:
    proxy = await start_proxy([versioned.url], switch_hold_timeout=5.0)
    session = await proxy.new_session()
    switch_id = await begin(proxy, "1")
    agent = proxy.agent(session)
    asked = asyncio.create_task(
        agent.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8
        )
    )
    await asyncio.sleep(0.3)
    assert not asked.done() and versioned.requests == []  # held, not sent
    versioned.version = "1"
    await live(proxy, switch_id)
    await asked
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["policy_version"] == "1"
    assert exact(turn["choices"][0], 8) == ["1"]


async def test_a_request_held_past_the_deadline_is_refused_and_recorded(
    start_proxy: ProxyFactory, versioned: FakeEngine
) -> None:
    proxy = await start_proxy([versioned.url], switch_hold_timeout=0.3)
    session = await proxy.new_session()
    await begin(proxy, "1")
    import openai

    with pytest.raises(openai.APIStatusError) as refused:
        await proxy.agent(session).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8
        )
    assert refused.value.status_code == 503
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["status"] == "failed" and turn["failure"]["reason"] == "switch_timeout"


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


async def test_a_version_named_outside_a_switch_is_recorded_and_refused_while_switching(
    start_proxy: ProxyFactory, two_versioned: tuple[FakeEngine, FakeEngine], database_url: str
) -> None:
    """A trainer that syncs weights itself names the version: the turns after it record it, the
    log keeps who was told what and when, and an engine mid-switch is not told twice."""
    first, second = two_versioned
    proxy = await start_proxy([first.url, second.url])
    url = f"{proxy.url}/admin/engines/policy-version"
    named = await proxy.http.post(url, json={"version": "7"})
    assert named.status_code == 200, named.text
    assert [e["policy_version"] for e in named.json()] == ["7", "7"]
    first.version = second.version = "7"
    session = await proxy.new_session()
    await proxy.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count"}], max_tokens=8
    )
    [turn] = (await proxy.session_record(session["session_id"]))["turns"]
    assert turn["policy_version"] == "7" and exact(turn["choices"][0], 8) == ["7"]
    # Mid-switch, the engine is refused (409): its version is the switch's to name.
    switch_id = await begin(proxy, "8", [second.url])
    refused = await proxy.http.post(url, json={"version": "9", "engine": second.url})
    assert refused.status_code == 409 and "switching" in refused.json()["error"]["message"]
    second.version = "8"
    await live(proxy, switch_id)
    engines = (await proxy.http.get(f"{proxy.url}/admin/engines")).json()
    assert [e["policy_version"] for e in engines] == ["7", "8"]
    async with await EventStore.open(database_url) as store:
        rows = await store.fetch(
            "SELECT payload FROM events WHERE event_type = 'policy_version_set' ORDER BY position"
        )
    # One: the refused call said nothing.
    [said] = [PolicyVersionSet.read(orjson.loads(row["payload"])) for row in rows]
    assert (said.version, said.engines) == ("7", [first.url, second.url])
    assert said.previous == {first.url: "0", second.url: "0"}


async def test_an_engine_that_dies_mid_switch_hands_its_turn_to_another(
    start_proxy: ProxyFactory, two_versioned: tuple[FakeEngine, FakeEngine]
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
    start_proxy: ProxyFactory, versioned: FakeEngine
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


async def test_engines_switching_one_after_the_other_keep_their_sessions(
    start_proxy: ProxyFactory, two_versioned: tuple[FakeEngine, FakeEngine]
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


async def test_the_log_and_the_samples_say_which_tokens_each_version_generated(
    start_proxy: ProxyFactory, versioned: FakeEngine, database_url: str
) -> None:
    from trajstore.store.projection import Projector
    from trajstore.store.samples import token_versions

    proxy = await start_proxy([versioned.url])
    session = await proxy.new_session(run_id="spans")
    await streamed_chat(proxy, session, 30, lambda: switch(proxy, versioned, "1"))
    agent = proxy.agent(session)
    await agent.chat.completions.create(  # a turn on one version only
        model="tiny", messages=[{"role": "user", "content": "again"}], max_tokens=8
    )
    assert (await proxy.finish(session["session_id"])).status_code == 200
    async with await EventStore.open(database_url) as store:
        # Until projected: other transactions on the server may hold the readers' horizon back.
        for _ in range(60):
            await Projector(store).run_once(settle=1.0)
            if await store.pool.fetchval(
                "SELECT count(*) FROM samples WHERE session_id = $1", session["session_id"]
            ):
                break
        straddled = await store.pool.fetch(
            "SELECT request_id, first_version, last_version, version_lag FROM turn_versions "
            "WHERE session_id = $1 AND straddled",
            session["session_id"],
        )
        switches = await store.pool.fetch(
            "SELECT version, outcome, interrupted FROM policy_switches"
        )
        [sample] = await store.pool.fetch(
            "SELECT s.token_ids, s.loss_mask, s.logprobs, s.policy_versions, v.version_spans, "
            "v.version_lag FROM samples s JOIN sample_versions v USING (sample_id) "
            "WHERE s.session_id = $1 AND s.is_final",
            session["session_id"],
        )
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [(r["first_version"], r["last_version"], r["version_lag"]) for r in straddled] == [
        ("0", "1", 1)
    ]
    assert straddled[0]["request_id"] == turns[0]["request_id"]  # not the turn on v1 alone
    assert [(s["version"], s["outcome"], s["interrupted"]) for s in switches] == [("1", "live", 1)]
    import numpy as np
    import orjson

    n = len(sample["token_ids"]) // 4
    versions = token_versions(n, orjson.loads(sample["version_spans"]))
    mask = np.frombuffer(sample["loss_mask"], np.uint8)
    logprobs = np.frombuffer(sample["logprobs"], np.float32)
    assert ((versions >= 0) == (mask == 1)).all()  # a version for every generated token
    generated = versions >= 0
    expected = np.array([version_logprob(str(v)) for v in versions[generated]], np.float32)
    assert (logprobs[generated] == expected).all()  # each token's version is the one that wrote it
    assert sample["policy_versions"] == ["0", "1"] and sample["version_lag"] == 1
