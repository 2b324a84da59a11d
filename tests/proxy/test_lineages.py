"""Conversations of one session through the proxy, against the fake engine (whose tokeniser
gives a reply's text back as the ids sampled): compaction and an edited history are divergences
of their own lineage only, and a finished session's memory is released.
"""

from __future__ import annotations

from typing import Any

from tests.proxy.conversation import Conversation
from tests.proxy.fixtures import RunningProxy
from trajstore.store import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import rebuild_session

SYSTEM = "you are a coding agent " * 20


async def samples(proxy: RunningProxy, database_url: str, session_id: str) -> list[Sample]:
    assert (await proxy.finish(session_id)).status_code == 200
    async with await EventStore.open(database_url) as store:
        events = await store.read_session(session_id)
    return build_samples(rebuild_session(session_id, events, packed=True))


def shape(found: list[Sample]) -> list[tuple[int, int, list[int], Any]]:
    return [(s.lineage, s.branch, s.turns, s.divergence and s.divergence.reason) for s in found]


async def test_compaction_is_a_divergence_of_the_conversation_it_compacted(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    main = Conversation(proxy.agent(session), SYSTEM, "fix the bug", max_tokens=16)
    for n in range(2):
        await main.call(f"tool output {n} " * 20)
    summary = await main.call("summarise the conversation so far")  # a turn of the loop
    # The agent starts over from the summary, as harnesses compact a long history.
    compacted = Conversation(
        proxy.agent(session), SYSTEM, f"summary of the work so far: {summary}", max_tokens=16
    )
    await compacted.call("go on")
    await compacted.call()
    found = await samples(proxy, database_url, session["session_id"])
    assert shape(found) == [(0, 0, [0, 1, 2], None), (0, 1, [3, 4], "compacted")]
    assert found[1].is_final and found[1].role == "main"


async def test_an_edit_inside_one_conversation_is_a_divergence_there_and_only_there(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    main = Conversation(agent, SYSTEM, "fix the bug in utils", max_tokens=16)
    helper = Conversation(agent, "you search files", "find utils", max_tokens=16)
    await main.call("tool output one")
    await helper.call("found it")
    await main.call("tool output two")
    await main.call("tool output three")
    # The agent edits its first message and sends the rest of its history again.
    main.messages[1] = {"role": "user", "content": "fix the bug in utils.py please"}
    await main.call()
    await helper.call()
    found = await samples(proxy, database_url, session["session_id"])
    assert shape(found) == [
        (0, 0, [0, 2, 3], None), (0, 1, [4], "history_rewritten"), (1, 0, [1, 5], None),
    ]  # fmt: skip


async def test_a_finished_sessions_turns_are_released(proxy: RunningProxy) -> None:
    contexts = proxy.app.state.proxy.forwarder.contexts
    session = await proxy.new_session()
    conversation = Conversation(proxy.agent(session), SYSTEM, "hello")
    await conversation.call("more")
    await conversation.call()
    held = contexts.held
    assert held > 0 and contexts.get(session["session_id"]).latest is not None
    assert (await proxy.finish(session["session_id"])).status_code == 200
    assert contexts.held < held and contexts.get(session["session_id"]).latest is None
