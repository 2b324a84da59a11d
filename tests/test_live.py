"""The live loop end to end on the real vLLM (CPU build, dev endpoints) through the real proxy.

- publishing reloads the trained weights into the running engine exactly: vLLM's logprobs of a
  prompt equal transformers' on the published weights (and differ from the old ones);
- a short on-policy run: every step is in the ledger with lag 0, and every session the proxy
  recorded carries the policy version that served it (v0 before training, the last after);
- distilling live (`trajstore train --distill-from`): every generated token of a step's batch
  scored by the teacher engine before the step trains on it.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trajstore.live import LiveConfig
from trajstore.publish import Publisher
from trajstore.store import EventStore
from trajstore.teacher import Teacher
from trajstore.tiny_model import build_tiny_model
from trajstore.train_cli import SERVED_NAME, live_services, run_config
from trajstore.trainer.distill import DistillConfig
from trajstore.trainer.learner import LearnerConfig
from trajstore.trainer.ledger import read_step
from trajstore.trainer.metrics_log import open_metrics_log

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def transformers_logprobs(model: object, ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # type: ignore[operator]
    logprobs = torch.log_softmax(logits.float(), -1)
    return [logprobs[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


async def engine_logprobs(http: httpx.AsyncClient, engine_url: str, ids: list[int]) -> list[float]:
    body = {"model": SERVED_NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0}
    reply = (await http.post(f"{engine_url}/v1/completions", json=body)).json()
    entries = reply["choices"][0]["prompt_logprobs"][1:]
    return [entry[str(ids[i + 1])]["logprob"] for i, entry in enumerate(entries)]


async def test_published_policies_serve_exactly_and_every_turn_records_its_version(
    database_url: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "tiny")
    async with (
        live_services(database_url, base, tmp_path / "work") as services,
        httpx.AsyncClient(timeout=60) as http,
    ):
        ids = list(range(5, 40))
        model = AutoModelForCausalLM.from_pretrained(services.model_dir, dtype=torch.float32)
        before = transformers_logprobs(model, ids)
        served = await engine_logprobs(http, services.engine_url, ids)
        assert max(abs(a - b) for a, b in zip(served, before, strict=True)) < 1e-4
        with torch.no_grad():  # a "trained" policy: every weight moved
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        publisher = Publisher(services.engine_url, services.proxy_url, tmp_path / "published")
        try:
            await publisher.publish(model, 1)
        finally:
            await publisher.close()
        served = await engine_logprobs(http, services.engine_url, ids)
        after = transformers_logprobs(model, ids)
        assert max(abs(a - b) for a, b in zip(served, after, strict=True)) < 1e-4
        assert max(abs(a - b) for a, b in zip(served, before, strict=True)) > 0.05

        config = LiveConfig(policies=2, batch_size=8, group_size=4, concurrency=4)
        with open_metrics_log("live", ["live"], tensorboard_dir=tmp_path / "tb") as metrics_log:
            result = await run_config(
                services, config, LearnerConfig(device="cpu", lr=2e-2),
                run_id="live", eval_sessions=8, metrics_log=metrics_log,
            )  # fmt: skip

        # `trajstore train --distill-from`: a scorer follows the run and each step learns from
        # its scores. The teacher here is the engine itself (what matters is the path: every
        # trained token scored, by the engine's prompt_logprobs, before the step trains on it).
        teacher = Teacher("self", services.engine_url, SERVED_NAME)
        distill = DistillConfig("self", coef=1.0, grpo=1.0)
        distilled = await run_config(
            services, LiveConfig(policies=1, batch_size=8, group_size=4, concurrency=4),
            LearnerConfig(device="cpu", lr=2e-2, distill=distill),
            run_id="distilled", eval_sessions=4, teacher=teacher,
        )  # fmt: skip

    history = result["history"]
    assert [m["policy_version"] for m in history] == [1.0, 2.0]  # type: ignore[union-attr,index]
    async with await EventStore.open(database_url) as store:
        for step in (1, 2):
            recorded = await read_step(store, "live", step)
            assert [s.staleness for s in recorded.samples] == [0] * 8  # on-policy
        versions = dict(
            await store.pool.fetch(
                "SELECT run_id, array_agg(DISTINCT policy_version_min) FROM samples "
                "WHERE run_id LIKE 'live%' GROUP BY run_id"
            )
        )
    # The evaluation before training ran on v0, the one after on v2; the training sessions on
    # v0 (step 1's batch) and v1 (step 2's).
    assert versions == {"live-eval-v0": [0], "live-eval-v2": [2], "live": [0, 1]}
    # `trajstore train --tensorboard-dir`: each step at its policy version, the lag among them,
    # and the two evaluations, read back with TensorBoard's own reader.
    events = EventAccumulator(str(tmp_path / "tb" / "live"))
    events.Reload()
    assert [p.step for p in events.Scalars("train/reward_mean")] == [1, 2]
    assert [p.value for p in events.Scalars("train/staleness_mean")] == [0.0, 0.0]  # on-policy
    evaluated = [(p.step, p.value) for p in events.Scalars("eval/reward_mean")]
    assert [step for step, _ in evaluated] == [0, 2]
    assert [value for _, value in evaluated] == pytest.approx(
        [sum(result[k]) / len(result[k]) for k in ("before", "after")]  # type: ignore[arg-type]
    )
    [step] = distilled["history"]  # type: ignore[misc]
    async with await EventStore.open(database_url) as store:
        recorded = await read_step(store, "distilled", 1)
        generated = await store.pool.fetchval(
            "SELECT sum(response_len) FROM samples WHERE sample_id = ANY($1::uuid[])",
            [s.sample_id for s in recorded.samples],
        )
    assert step["teacher_tokens"] == generated > 0  # every generated token scored
    assert abs(step["reverse_kl"]) < 0.5  # the engine scored its own v0 tokens
