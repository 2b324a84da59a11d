"""Weight switches without a drain (`proxy.switching`), on the fake engine with versions.

The versioned fake engine writes every token's logprob as its version's (`version_logprob`), at
the moment the token leaves it; so the record says, token by token, which version truly
generated each token, and every test checks that the recorded spans say the same: no turn is
recorded with a version that did not produce it. And nothing is lost: each turn has all its
tokens, once, and the agent read exactly them.
"""

from __future__ import annotations

import asyncio

import anthropic
import orjson
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import version_logprob
from tests.proxy.fixtures import ProxyFactory
from tests.proxy.switching_support import (
    DELAY,
    N,
    begin,
    exact,
    live,
    streamed_chat,
    switch,
    text_of,
)
from trajstore.store import EventStore
from trajstore.store.payloads import PolicyVersionSet


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
