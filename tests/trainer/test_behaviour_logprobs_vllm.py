"""Behaviour logprobs, end to end: what vLLM reported is what the trainer's model computes.

A session is recorded through the proxy from the real vLLM (a forced tool call, then a free
turn), projected into a sample, and the trainer's model (transformers, the same generated
checkpoint, float32 on the CPU) scores the sample. Free turns agree with the recorded behaviour
logprobs to float32 rounding; the forced turn's recorded logprobs are those of vLLM's
grammar-masked distribution, so the sample holds NaN there (no usable behaviour logprob).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.proxy.fixtures import ProxyFactory
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.trainer.loss import token_logprobs

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


async def test_recorded_logprobs_are_the_trainers_except_under_a_grammar(
    start_proxy: ProxyFactory, vllm: str, database_url: str
) -> None:
    from transformers import AutoModelForCausalLM

    proxy = await start_proxy([vllm])
    session = await proxy.new_session(run_id="lp")
    agent = proxy.agent(session)
    messages: list[dict[str, object]] = [{"role": "user", "content": "add 2 and 3"}]
    forced = await agent.chat.completions.create(
        model="tiny", messages=messages, tools=TOOLS, max_tokens=24, temperature=1.0, seed=1,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # type: ignore[call-overload]  # fmt: skip
    messages.append(forced.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "and now?"})
    await agent.chat.completions.create(
        model="tiny", messages=messages, max_tokens=24, temperature=1.0, seed=2
    )  # type: ignore[call-overload]
    sid = session["session_id"]
    await proxy.http.post(f"{proxy.url}/sessions/{sid}/reward", json={"value": 1.0})
    await proxy.http.post(f"{proxy.url}/sessions/{sid}/finish", json={"status": "completed"})
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
        rows = await store.pool.fetch(
            "SELECT token_ids, loss_mask, logprobs FROM samples WHERE session_id = $1", sid
        )

    # vLLM names the checkpoint it serves: the trainer loads the very same files.
    served = (await proxy.http.get(f"{vllm}/v1/models")).json()["data"][0]["root"]
    model = AutoModelForCausalLM.from_pretrained(Path(served), dtype=torch.float32).eval()
    free = constrained = 0
    for row in rows:
        ids = np.frombuffer(row["token_ids"], "<i4").astype(np.int64)
        mask = np.frombuffer(row["loss_mask"], np.uint8).astype(bool)
        recorded = np.frombuffer(row["logprobs"], "<f4")
        with torch.no_grad():
            logits = model(input_ids=torch.from_numpy(ids)[None]).logits
        ours = token_logprobs(logits, torch.from_numpy(ids)[None])[0].numpy()
        known = mask & np.isfinite(recorded)
        assert np.abs(ours[known] - recorded[known]).max(initial=0.0) < 1e-4
        free += int(known.sum())
        constrained += int((mask & ~np.isfinite(recorded)).sum())
    assert free > 0 and constrained > 0  # both kinds of turn were checked
