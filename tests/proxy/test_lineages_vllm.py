"""Several conversations through one session, against a real vLLM (CPU build) on the generated
tiny model, through the official openai client: each conversation is continued token-in from its
own turns, and becomes one sample of its own; the sampled audit of continuation catches a
template that stops being separable late in a conversation.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.proxy.conversation import Conversation as Talk
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.store import EventStore, EventType
from trajstore.store.samples import Sample, build_samples, final_branch
from trajstore.store.sessions import SessionRecord, rebuild_session

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EOS = 2  # <|im_end|>: a bias makes the random model end its turns, as a real one does
ASK: dict[str, Any] = {"temperature": 1.0, "extra_body": {"logit_bias": {str(EOS): 3}}}


def Conversation(agent: Any, system: str, first: str) -> Talk:  # noqa: N802
    """A conversation sampled as a real agent's is."""
    return Talk(agent, system, first, **ASK)


async def recorded(proxy: RunningProxy, database_url: str, session_id: str) -> SessionRecord:
    assert (await proxy.finish(session_id)).status_code == 200
    async with await EventStore.open(database_url) as store:
        return rebuild_session(session_id, await store.read_session(session_id), packed=True)


def agree(session: SessionRecord, samples: list[Sample]) -> None:
    """The proxy's live choice of the turn each prompt continues (its reference) is the turn
    before it in the lineage the projection put it in."""
    previous = {}
    for sample in samples:
        for before, after in zip(sample.turns, sample.turns[1:], strict=False):
            previous[after] = session.turns[before].request_id
    for index, turn in enumerate(session.turns):
        if turn.prompt_source == "continued":
            assert turn.prompt_prefix is not None
            assert turn.prompt_prefix.request_id == previous[index]


async def test_interleaved_conversations_are_continued_from_their_own_turns(
    start_proxy: ProxyFactory, vllm: str, database_url: str
) -> None:
    """M1 S1 M2 S2 M3 T: a main loop, a sub-agent, a one-off title call, interleaved."""
    proxy = await start_proxy([vllm])
    session = await proxy.new_session()
    agent = proxy.agent(session)
    main = Conversation(agent, "You are a coding agent. " * 30, "fix the failing test in utils")
    sub = Conversation(agent, "You search a code base.", "find where utils is imported")
    await main.call("the test output says: assertion error")
    await sub.call("found: app.py and cli.py")
    await main.call("the file now reads: def add(a, b): return a + b", stream=True)
    await sub.call("and tests/test_utils.py")
    await main.call("done?")
    await Conversation(agent, "Write a short title.", "fix the failing test in utils").call()

    record = await recorded(proxy, database_url, session["session_id"])
    sources = [t.prompt_source for t in record.turns]
    assert sources == ["rendered", "rendered", "continued", "continued", "continued", "rendered"]
    samples = build_samples(record)
    assert [s.turns for s in samples] == [[0, 2, 4], [1, 3], [5]]
    assert [s.role for s in samples] == ["main", "subagent", "side"]
    assert all(s.divergence is None for s in samples)
    default = final_branch(samples)
    assert default is not None and default.turns == [0, 2, 4]
    agree(record, samples)


async def test_two_sub_agents_streaming_at_once_are_each_continued(
    start_proxy: ProxyFactory, vllm: str, database_url: str
) -> None:
    proxy = await start_proxy([vllm])
    session = await proxy.new_session()
    agent = proxy.agent(session)
    first = Conversation(agent, "You read files.", "read setup.py")
    second = Conversation(agent, "You run tests.", "run the unit tests")
    await asyncio.gather(first.call("it has 20 lines"), second.call("3 failed"))
    for step in range(2):
        await asyncio.gather(
            first.call(f"next file {step}", stream=True), second.call(f"rerun {step}", stream=True)
        )
    record = await recorded(proxy, database_url, session["session_id"])
    assert [t.prompt_source for t in record.turns].count("continued") == 4
    samples = build_samples(record)
    assert sorted(len(s.turns) for s in samples) == [3, 3]
    assert all(s.divergence is None for s in samples)
    agree(record, samples)


# Separable while a conversation is short: past seven messages it renders every user message
# with a word in front, so a new message renders one way after a neutral history and another
# after the real one. Only the whole-conversation audit sees it.
LATE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if messages|length > 7 and m.role == 'user' %}late {% endif %}"
    "{{ m.content or '' }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


async def test_the_sampled_audit_catches_a_template_not_separable_late(
    start_proxy: ProxyFactory, vllm: str, database_url: str, events_of: Any
) -> None:
    proxy = await start_proxy([vllm], continuation_audit_every=3, continuation_audit_growth=0)
    session = await proxy.new_session()
    conversation = Conversation(proxy.agent(session), "You answer.", "count to three")
    for n in range(7):
        await conversation.call(f"and then {n}", chat_template=LATE_TEMPLATE)
    record = await recorded(proxy, database_url, session["session_id"])
    outcomes = [
        "continued"
        if t.prompt_source == "continued"
        else t.continuation and t.continuation.fallback
        for t in record.turns
    ]
    # Continued turns 1 and 4 are audited (the lineage's first, then every third). The template
    # changes at turn 3 (eight messages): the audit of turn 4 finds it and turns continuation
    # off for the lineage.
    assert outcomes == [
        None, "continued", "continued", "continued", "audit_failed",
        "lineage_not_separable", "lineage_not_separable",
    ]  # fmt: skip
    audited = [  # the turns whose recorded continuation says where the drift was measured
        t.continuation
        for t in record.turns
        if t.continuation and "drift_at" in t.continuation.model_fields_set
    ]
    assert len(audited) == 1  # turn 1's: the drift is measured where the audit renders
    events = await events_of(session["session_id"])
    fallbacks = [e.payload.get("continuation") for e in events if e.type == EventType.PROMPT_TOKENS]
    assert {"fallback": "audit_failed"} in fallbacks
