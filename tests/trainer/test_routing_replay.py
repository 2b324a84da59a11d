"""Routing replay on a generated tiny Qwen3-MoE (transformers' `Qwen3MoeForCausalLM`, random
weights): the trainer's forward with the recorded routing gives exactly the logprobs of the
forward that chose it, and after a training step its importance ratio stays nearer 1 than a
forward that routes freely (the effect routing replay exists for)."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.support import RecordedSession
from trajstore.store import EventStore, EventType, NewEvent, request_stream
from trajstore.store.payloads import SideDataRecorded
from trajstore.store.projection import Projector
from trajstore.store.side_data import EXPERTS, ROUTED_EXPERTS, pack
from trajstore.tiny_model import seeded_model
from trajstore.trainer.collate import ReplaySample, collate
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.loss import token_logprobs
from trajstore.trainer.replay import replay
from trajstore.trainer.replay_live import replay_live
from trajstore.trainer.routing import as_batch_routing, captured, replayed, routers

ROWS, LENGTH, PROMPT = 4, 32, 8


def tiny_moe(seed: int = 0) -> Any:
    """A Qwen3-MoE-shaped model small enough for a CPU test: 2 MoE layers of 8 experts, top-2."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, dtype="float32",
    )  # fmt: skip
    model = seeded_model(Qwen3MoeForCausalLM, config, seed)
    # At transformers' init (std 0.02) the routers route almost uniformly and the experts add
    # little to the residual stream: which expert a token takes would hardly matter. Decisive
    # routers and experts of weight, as in a trained MoE.
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in routers(model):
            router.weight.normal_(0, 0.5, generator=generator)
        for name, parameter in model.named_parameters():
            if "experts" in name:
                parameter.normal_(0, 0.25, generator=generator)
    return model.eval()


def forward(model: Any, ids: torch.Tensor, routed: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad(), replayed(model, routed):
        return token_logprobs(model(input_ids=ids).logits, ids)


def inputs() -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(0).integers(3, 500, (ROWS, LENGTH)))


def test_replayed_routing_gives_the_logprobs_of_the_forward_that_chose_it() -> None:
    model, ids = tiny_moe(), inputs()
    with torch.no_grad(), captured(model, ROWS, LENGTH) as forwards:
        free = token_logprobs(model(input_ids=ids).logits, ids)
    [routing] = forwards
    assert routing.shape == (ROWS, LENGTH, 2, 2)
    assert torch.equal(forward(model, ids, routing), free)
    # Forcing other experts changes them: the replay is what decides.
    other = (routing + 1) % 8
    assert not torch.allclose(forward(model, ids, other), free, atol=1e-4)
    # Positions without recorded routing (-1) route freely.
    partly = routing.clone()
    partly[:, ::2] = -1
    assert torch.equal(forward(model, ids, partly), free)
    with pytest.raises(TrainerError, match="3 layers"):
        forward(model, ids, torch.zeros(ROWS, LENGTH, 3, 2, dtype=torch.long))


def test_stored_routing_reads_back_with_absent_positions_free() -> None:
    stored = np.array([[[1, 2]], [[255, 255]]], np.uint8)
    assert as_batch_routing(stored).tolist() == [[[1, 2]], [[-1, -1]]]


def test_after_a_step_the_replayed_ratio_stays_nearer_one_than_free_routing() -> None:
    # The engine: the same weights in bfloat16 (as a GPU engine serves them). Its routing and
    # logprobs are what the proxy records; the trainer computes in float32, where a few tokens
    # near a tie between two experts are routed elsewhere.
    model, ids = tiny_moe(), inputs()
    engine = copy.deepcopy(model).to(torch.bfloat16)
    with torch.no_grad(), captured(engine, ROWS, LENGTH) as forwards:
        behaviour = token_logprobs(engine(input_ids=ids).logits.float(), ids)
    [routing] = forwards
    mask = np.zeros(LENGTH, np.uint8)
    mask[PROMPT:] = 1
    generated = torch.from_numpy(mask).bool().expand(ROWS, -1)

    def drift(logprobs: torch.Tensor) -> float:
        """Mean |ratio - 1| of the trainer's policy against the behaviour, generated tokens."""
        return float((torch.exp(logprobs - behaviour) - 1).abs()[generated].mean())

    before = drift(forward(model, ids, routing)), drift(forward(model, ids))
    samples = [
        ReplaySample(
            uuid.uuid4(), f"s{r}", ids[r].numpy().astype(np.int32), mask,
            (behaviour[r].numpy() * mask).astype(np.float32), float(r % 2), 1.0 - 2 * (r % 2),
            0, 0, routed_experts=routing[r].numpy(),
        )
        for r in range(ROWS)
    ]  # fmt: skip
    batch = collate([[s] for s in samples])
    assert torch.equal(batch["routed_experts"], routing)
    learner = Learner(model.train(), LearnerConfig(lr=1e-4))
    learner.step(learner.prepare(batch))  # trained with the recorded routing
    model.eval()
    after = drift(forward(model, ids, routing)), drift(forward(model, ids))
    print(
        f"mean |ratio - 1| on generated tokens, replayed vs free routing: before the step "
        f"{before[0]:.4f} vs {before[1]:.4f}, after one step {after[0]:.4f} vs {after[1]:.4f}"
    )
    assert before[0] < before[1] and after[0] < after[1]


async def moe_session(store: EventStore) -> np.ndarray:
    """A projected session of one turn (4 prompt + 3 generated tokens) whose engine recorded the
    routing of its first 6 tokens; returns that routing (tokens x layers x top-k)."""
    recorded = RecordedSession(store, "moe")
    await recorded.created(group_id="g")
    prompt, completion = [5, 6, 7, 8], [9, 10, 11]
    await recorded.turn({"request_id": "r0", "body": {}}, prompt, completion)
    experts = np.arange(6 * 2 * 2).reshape(6, 2, 2).astype(np.uint8) % 8  # 7 tokens, last none
    specs, data = pack({EXPERTS: experts})
    side = SideDataRecorded(request_id="r0", kind=ROUTED_EXPERTS, source="e", n_tokens=6,
                            arrays=specs)  # fmt: skip
    event = NewEvent(EventType.SIDE_DATA_RECORDED, session_id="moe", run_id="run-1",
                     payload=side, side_data=data)  # fmt: skip
    await store.append(request_stream("r0"), [event])
    await recorded.finished(reward=1.0)
    await Projector(store).run_once()
    return experts


async def test_a_replay_carries_the_recorded_routing_into_the_batch(store: EventStore) -> None:
    experts = await moe_session(store)
    [batch] = [b async for b in replay(store, batch_size=1, routing=True)]
    routed = batch["routed_experts"][0]
    assert routed.shape == (7, 2, 2)
    assert routed[:6].tolist() == experts.tolist() and (routed[6] == -1).all()
    [plain] = [b async for b in replay(store, batch_size=1)]
    assert plain.get("routed_experts", None) is None


async def test_a_live_replay_carries_it_too(store: EventStore) -> None:
    experts = await moe_session(store)
    live = replay_live(store, batch_size=1, routing=True, poll_interval=0.05, idle_timeout=1.0)
    [(batch, _)] = [item async for item in live]
    routed = batch["routed_experts"][0]
    assert routed[:6].tolist() == experts.tolist() and (routed[6] == -1).all()
    plain = replay_live(store, batch_size=1, poll_interval=0.05, idle_timeout=1.0)
    [(batch, _)] = [item async for item in plain]
    assert batch.get("routed_experts", None) is None


async def test_the_recipe_trains_with_the_recorded_routing_when_asked(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trajstore.trainer import learner as learner_module
    from trajstore.trainer.recipe import RecipeConfig, train_steps

    experts = await moe_session(store)
    seen: list[torch.Tensor | None] = []
    real = learner_module.routing.replayed

    def spied(model: Any, routed: torch.Tensor | None) -> Any:
        seen.append(routed)
        return real(model, routed)

    monkeypatch.setattr(learner_module.routing, "replayed", spied)
    for asked in (True, False):
        learner = Learner(tiny_moe().train(), LearnerConfig(device="cpu"))
        await train_steps(store, "run-1", Path("unused"), 1, training_run=f"r-{asked}",
                          config=RecipeConfig(batch_size=1, routing=asked),
                          learner=learner)  # fmt: skip
    with_routing, without = seen
    assert with_routing is not None and with_routing[0, :6].tolist() == experts.tolist()
    assert without is None
