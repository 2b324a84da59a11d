"""Agent-length samples end to end against a real PostgreSQL: a 64 k-token sample replays whole
(its own packed row, position ids per sample), a sample over the configured limit is skipped with
its reason in the step's ledger event, never cut, and the recipe trains on the rest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.trainer.rows import sample_row, store_samples
from trajstore.store import EventStore
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.learner import LearnerConfig
from trajstore.trainer.ledger import read_step
from trajstore.trainer.recipe import RecipeConfig, train_steps
from trajstore.trainer.replay import replay
from trajstore.trainer.replay_live import replay_live
from trajstore.trainer.selection import Selection

LONG = 65_536


def row(session: str, completion: int, prompt: int = 8, reward: float = 1.0) -> dict[str, Any]:
    """A sample of `prompt + completion` tokens (ids inside the tiny model's vocabulary)."""
    return sample_row(
        session_id=session, group_id=f"g-{session}", reward=reward,
        prompt=[3 + i % 200 for i in range(prompt)],
        completion=[5 + i % 300 for i in range(completion)],
    )  # fmt: skip


async def test_a_64k_token_sample_replays_whole_in_a_packed_row_of_its_own(
    store: EventStore,
) -> None:
    await store_samples(store, [row("long", LONG - 8), row("short-1", 40), row("short-2", 52),
                         row("too-long", LONG + 4096)])  # fmt: skip
    batches = [
        b async for b in replay(store, token_budget=4096, pack=True, batch_size=1,
                                max_sample_tokens=LONG, shuffle=False)
    ]  # fmt: skip
    by_id = {s["session_id"]: (b, s) for b in batches for s in b.get_non_tensor("samples")}
    assert set(by_id) == {"long", "short-1", "short-2"}  # the over-long one is not trained
    batch, entry = by_id["long"]
    assert entry["n_tokens"] == LONG and batch["input_ids"].shape == (1, LONG)  # not truncated
    assert batch["position_ids"][0].tolist() == list(range(LONG))
    assert batch["loss_mask"][0].sum().item() == LONG - 8
    shorts, _ = by_id["short-1"]
    assert shorts is by_id["short-2"][0]  # 48 + 60 tokens: one row of the 4,096-token budget
    segments, positions = shorts["segment_ids"][0], shorts["position_ids"][0]
    for segment in (1, 2):  # each sample at the positions it has alone
        at = positions[segments == segment]
        assert at.tolist() == list(range(len(at)))
    skipped = batches[0].get_non_tensor("skipped")
    assert [(s["session_id"], s["n_tokens"]) for s in skipped] == [("too-long", LONG + 4104)]
    assert skipped[0]["reason"] == f"{LONG + 4104} tokens, more than max_sample_tokens={LONG}"
    assert all(b.get_non_tensor("skipped", default=None) is None for b in batches[1:])


async def test_without_a_limit_a_sample_over_the_budget_is_refused(store: EventStore) -> None:
    await store_samples(store, [row("long", 200)])
    with pytest.raises(BadSelection, match="more than token_budget=64"):
        [b async for b in replay(store, token_budget=64, pack=True)]


async def test_a_selection_of_only_over_long_samples_says_so(store: EventStore) -> None:
    await store_samples(store, [row("a", 300), row("b", 400)])
    with pytest.raises(BadSelection, match=r"all 2 selected samples are longer than "
                       r"max_sample_tokens=100 \(the longest has 408 tokens\)"):  # fmt: skip
        [b async for b in replay(store, batch_size=2, max_sample_tokens=100)]


async def test_live_replay_skips_an_over_long_sample_once_and_gives_a_long_one_its_own_batch(
    store: EventStore,
) -> None:
    await store_samples(store, [row("long", 1000), row("short", 40), row("too-long", 3000)])
    options: dict[str, Any] = {"batch_size": 1, "token_budget": 512, "max_sample_tokens": 2048,
                               "poll_interval": 0.05, "idle_timeout": 1.0}  # fmt: skip
    items = [item async for item in replay_live(store, **options)]
    by_id = {s["session_id"]: b for b, _ in items for s in b.get_non_tensor("samples")}
    assert set(by_id) == {"long", "short"}
    assert by_id["long"]["input_ids"].shape == (1, 1008)  # over the budget, whole, alone
    skipped = items[0][0].get_non_tensor("skipped")
    assert [(s["session_id"], s["n_tokens"]) for s in skipped] == [("too-long", 3008)]
    assert all(b.get_non_tensor("skipped", default=None) is None for b, _ in items[1:])
    # Skipped is final: a resumed live replay neither trains nor reports it again.
    resumed = [item async for item in replay_live(store, checkpoint=items[-1][1], **options)]
    assert resumed == []
    # Without a limit, a sample over the budget is refused, as `replay` refuses it.
    with pytest.raises(BadSelection, match="more than token_budget=512"):
        [item async for item in replay_live(store, batch_size=1, token_budget=512,
                                            poll_interval=0.05, idle_timeout=1.0)]  # fmt: skip


@pytest.mark.slow
async def test_the_recipe_skips_an_over_long_sample_and_records_why(
    store: EventStore, database_url: str, tmp_path: Path
) -> None:
    model_dir = build_tiny_model(tmp_path / "model")
    rows = [{**row(f"s-{i}", 30 + 7 * i, reward=float(i % 2)), "group_id": f"g-{i // 2}"}
            for i in range(6)]  # fmt: skip
    rows.append(row("huge", 500))
    # Over the row budget, within the limit: a row of its own (in group g-0: an advantage).
    rows.append({**row("long", 150), "group_id": "g-0"})
    await store_samples(store, [{**r, "run_id": "long-run"} for r in rows])
    config = RecipeConfig(
        batch_size=2, token_budget=128, pack=True, max_sample_tokens=200,
        learner=LearnerConfig(device="cpu", gradient_checkpointing=True),
    )  # fmt: skip
    first_pass = [
        b async for b in replay(store, Selection(runs=("long-run",)), batch_size=2,
                                token_budget=128, pack=True, seed=0, max_sample_tokens=200)
    ]  # fmt: skip
    steps = len(first_pass)
    history = await train_steps(store, "long-run", model_dir, steps, training_run="skips",
                                config=config)  # fmt: skip
    first = await read_step(store, "skips", 1)
    assert first.replay["skipped"] == [
        {"sample_id": str(rows[6]["sample_id"]), "session_id": "huge", "n_tokens": 508,
         "reason": "508 tokens, more than max_sample_tokens=200"}
    ]  # fmt: skip
    assert [m["skipped_samples"] for m in history] == [1.0] + [0.0] * (steps - 1)
    assert first.metrics["skipped_samples"] == 1.0
    trained = [i for s in range(1, steps + 1)
               for i in (await read_step(store, "skips", s)).sample_ids]  # fmt: skip
    assert len(trained) == 7 and str(rows[6]["sample_id"]) not in trained
    assert str(rows[7]["sample_id"]) in trained  # 158 tokens > the 128-token row: trained whole
    assert all(m["grad_norm"] > 0 for m in history)
