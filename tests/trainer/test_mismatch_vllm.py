"""The train–inference mismatch check against a real vLLM (CPU build, generated tiny model).

A session is recorded through the proxy with temperature 1.0, exactly as an agent would make it;
then its recorded prompt + completion ids are sent back to vLLM for prompt logprobs.

Tolerance: vLLM's sampler logprob of a sampled token and its prompt logprob of the same token in
the same context are the same number: both are the log-softmax of the raw logits in float32
(`--logprobs-mode raw_logprobs`, the default; prompt logprobs never see temperature or top-p),
computed once in a one-token decode step and once in a whole-prompt prefill. Measured here on the
CPU build: |difference| exactly 0.0 on every one of 64 tokens over four turns, after both went
through float32 (the store keeps float32). Other kernels or batch shapes may round differently,
so the tests allow 1e-4 (an importance ratio within exp(1e-4) of 1); a corrupted logprob or
another model (mean |difference| about 0.27, KL about 0.06 nats/token) is far beyond it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from tests.proxy.fixtures import ProxyFactory, RunningProxy, served_tiny_model
from trajstore.cli import main
from trajstore.store import EventStore
from trajstore.store.timeline import session_as_of
from trajstore.trainer.mismatch import check_session, overall

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOLERANCE = 1e-4
SAMPLING: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "max_tokens": 16}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]


async def record_session(proxy: RunningProxy) -> str:
    """Three chat turns with tool results (one streamed), a completions turn, a finish."""
    session = await proxy.new_session(task_id="add")
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    for turn in range(3):
        if turn == 1:
            stream = await agent.chat.completions.create(
                messages=messages, tools=TOOLS, seed=turn, stream=True, **SAMPLING,  # type: ignore[arg-type]
            )  # fmt: skip
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        else:
            answer = await agent.chat.completions.create(
                messages=messages, tools=TOOLS, seed=turn, **SAMPLING,  # type: ignore[arg-type]
            )  # fmt: skip
            text = answer.choices[0].message.content or ""
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "tool_call_id": f"call-{turn}", "content": "5"},
        ]
    await agent.completions.create(prompt=[1, 20, 30, 40], seed=9, **SAMPLING)
    await agent.close()
    url = f"{proxy.url}/sessions/{session['session_id']}/finish"
    assert (await proxy.http.post(url, json={"status": "completed"})).status_code == 200
    return str(session["session_id"])


@pytest.fixture
async def recorded(start_proxy: ProxyFactory, vllm: str, database_url: str) -> str:
    return await record_session(await start_proxy([vllm]))


async def test_the_same_engine_agrees_with_what_was_recorded(
    recorded: str, vllm: str, database_url: str
) -> None:
    async with await EventStore.open(database_url) as store:
        session = await session_as_of(store, recorded)
    results = await check_session(session, vllm)
    assert [(r.turn, r.note) for r in results] == [(i, None) for i in range(4)]
    assert all(
        r.tokens == len(t.choices[0].token_ids) > 0
        for r, t in zip(results, session.turns, strict=True)
    )
    worst = max(r.max_abs_diff or 0.0 for r in results)
    print(f"same engine: max |diff| {worst:.2e}, {overall(results)}")  # shown with -s
    assert all(r.max_abs_diff is not None and r.max_abs_diff < TOLERANCE for r in results)
    assert all(r.kl is not None and 0.0 <= r.kl < TOLERANCE for r in results)


async def test_a_corrupted_recorded_logprob_is_found(
    recorded: str, vllm: str, database_url: str
) -> None:
    async with await EventStore.open(database_url) as store:
        session = await session_as_of(store, recorded)
    choice = session.turns[2].choices[0]
    at = len(choice.logprobs) // 2
    choice.logprobs[at] -= 0.7  # as if the recorder had stored another token's logprob
    results = await check_session(session, vllm)
    bad = results[2]
    assert bad.worst_token == at
    assert bad.max_abs_diff == pytest.approx(0.7, abs=TOLERANCE)
    assert bad.kl is not None and bad.kl > 0.1 / bad.tokens  # exp(0.7) - 1 - 0.7 ≈ 0.31 nats
    assert all(r.max_abs_diff is not None and r.max_abs_diff < TOLERANCE for r in results[:2])


def test_the_cli_reports_the_mismatch_per_turn(recorded: str, vllm: str, database_url: str) -> None:
    runner = CliRunner(env={"COLUMNS": "160"})
    args = ["--database-url", database_url, "replay", "session", recorded, "--against", vllm]
    document = orjson.loads(runner.invoke(main, [*args, "--json"]).output)
    turns = document["mismatch"]["turns"]
    assert len(turns) == 4 and all(t["max_abs_diff"] < TOLERANCE for t in turns)
    assert document["mismatch"]["overall"]["tokens"] == sum(t["tokens"] for t in turns)

    table = runner.invoke(main, args)
    assert table.exit_code == 0, table.output
    assert f"recorded logprobs against {vllm}" in table.output
    assert f"over {sum(t['tokens'] for t in turns)} tokens: mean |Δ|" in table.output


@pytest.fixture(scope="module")
def other_model() -> Iterator[str]:
    """A second vLLM serving a tiny model of another seed under the same name: another policy."""
    with served_tiny_model(seed=1, prefix="trajstore-vllm-other-") as url:
        yield url


async def test_another_model_shows_up_as_a_large_mismatch(
    recorded: str, other_model: str, database_url: str
) -> None:
    async with await EventStore.open(database_url) as store:
        session = await session_as_of(store, recorded)
    results = await check_session(session, other_model)
    total = overall(results)
    print(f"other model: {total}")  # shown with -s
    assert total["mean_abs_diff"] is not None and total["mean_abs_diff"] > 500 * TOLERANCE
    assert total["kl"] is not None and total["kl"] > 100 * TOLERANCE
