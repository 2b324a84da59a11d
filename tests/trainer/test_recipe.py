"""The recipe trains the tiny model on a recorded run, and the policy measurably improves.

The run is recorded by `trainer.toy_task`: completions sampled from the tiny model itself, written
as the events the proxy writes, then projected by the real projector into a real PostgreSQL.
Not through vLLM and the proxy: those paths have their own end-to-end tests (the samples they
produce are token-exact), and this test is about learning, which needs ~130 rollouts of the same
model whose logprobs we train, in seconds on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trajstore.store import EventStore
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer import toy_task
from trajstore.trainer.ledger import read_step
from trajstore.trainer.recipe import train_steps
from trajstore.trainer.replay import replay
from trajstore.trainer.selection import Selection

pytestmark = pytest.mark.slow

TRAIN, HELD_OUT = toy_task.SUBJECTS[:12], toy_task.SUBJECTS[12:]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def fresh_reward(model_dir: Path) -> float:
    """Mean reward of 64 new completions to held-out questions (fixed sampling seed)."""
    model, tokenizer = toy_task.load(model_dir)
    digits = set(toy_task.digit_token_ids(tokenizer))
    generator = torch.Generator().manual_seed(7)
    rewards = []
    for question in toy_task.questions(HELD_OUT):
        prompt = toy_task.prompt_ids(tokenizer, question)
        for completion, _ in toy_task.sample_completions(model, prompt, 16, 16, generator):
            rewards.append(toy_task.reward(completion, digits))
    return sum(rewards) / len(rewards)


async def test_training_on_recorded_rollouts_raises_the_reward_on_held_out_questions(
    store: EventStore, database_url: str, model_dir: Path, tmp_path: Path
) -> None:
    await toy_task.record_toy_run(store, model_dir, "rollouts", subjects=TRAIN)
    await toy_task.record_toy_run(store, model_dir, "held-out", subjects=HELD_OUT, seed=1)
    selection = Selection(runs=("held-out",))
    (held_out,) = [b async for b in replay(store, selection, batch_size=64, shuffle=False)]

    trained_dir = tmp_path / "trained"
    history = await train_steps(
        database_url, "rollouts", model_dir, 12, training_run="toy", save_dir=trained_dir
    )

    model, tokenizer = toy_task.load(model_dir)
    trained, _ = toy_task.load(trained_dir)
    digits = toy_task.digit_token_ids(tokenizer)
    before = toy_task.expected_reward(model, held_out, digits)
    after = toy_task.expected_reward(trained, held_out, digits)
    print(f"held-out expected reward per token: {before:.4f} -> {after:.4f}")  # shown with -s
    assert after > 2 * before
    assert fresh_reward(trained_dir) > 2 * fresh_reward(model_dir)

    # every step is in the ledger, with the metrics the recipe returned
    assert [m["step"] for m in history] == [float(s) for s in range(1, 13)]
    last = await read_step(store, "toy", 12)
    assert last.metrics == history[-1]
    assert len(last.sample_ids) == 16
    assert history[-1]["kl_k3"] > 0  # the policy moved away from the one that sampled
