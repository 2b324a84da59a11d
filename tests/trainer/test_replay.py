"""Replay against a real `samples` table: order, batches, advantages, refusals, live tailing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from tensordict import TensorDict

from tests.trainer.rows import insert_samples, rollout_rows, sample_row, store_samples
from trajstore.store import EventStore
from trajstore.trainer.collate import sample_ids
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.replay import replay
from trajstore.trainer.replay_live import LiveCheckpoint, replay_live
from trajstore.trainer.selection import Selection


def group_rows(n_groups: int, per_group: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """Groups whose members get rewards 0, 1, ...; completions of varying length."""
    return [
        sample_row(session_id=f"s-{g}-{m}", group_id=f"g-{g}", reward=float(m),
                   completion=list(range(10, 11 + (g + m) % 4)), **kwargs)
        for g in range(n_groups)
        for m in range(per_group)
    ]  # fmt: skip


async def collect(store: EventStore, **kwargs: Any) -> list[TensorDict]:
    return [batch async for batch in replay(store, **kwargs)]


async def test_the_same_seed_gives_the_same_batches_and_another_seed_another_order(
    store: EventStore,
) -> None:
    await store_samples(store, group_rows(8))
    first = await collect(store, batch_size=4, seed=1)
    again = await collect(store, batch_size=4, seed=1)
    other = await collect(store, batch_size=4, seed=2)
    assert [b.shape[0] for b in first] == [4, 4, 4, 4]
    assert [sample_ids(b) for b in first] == [sample_ids(b) for b in again]
    assert all((a == b).all() for a, b in zip(first, again, strict=True))
    ids = [i for b in first for i in sample_ids(b)]
    assert len(set(ids)) == 16  # every selected sample once
    assert ids != [i for b in other for i in sample_ids(b)]


async def test_batches_carry_the_stored_tokens_and_group_advantages(store: EventStore) -> None:
    await store_samples(store, group_rows(1, prompt=(1, 2, 3)))
    (batch,) = await collect(store, batch_size=2, shuffle=False)
    by_session = {s["session_id"]: r for r, s in enumerate(batch.get_non_tensor("samples"))}
    low, high = by_session["s-0-0"], by_session["s-0-1"]
    assert batch["input_ids"][low, :4].tolist() == [1, 2, 3, 10]
    assert batch["loss_mask"][low, :4].tolist() == [False, False, False, True]
    assert batch["logprobs"][low, 3].item() == pytest.approx(-0.1)
    # rewards 0 and 1 in one group: advantages -1 and +1 on the generated tokens
    assert batch["advantages"][low, 3].item() == pytest.approx(-1.0, abs=1e-5)
    assert batch["advantages"][high, 3].item() == pytest.approx(1.0, abs=1e-5)
    assert batch["rewards"][high, 0].item() == 1.0


async def test_a_session_s_lineages_are_one_group_member_with_one_advantage(
    store: EventStore,
) -> None:
    await store_samples(store, rollout_rows())
    (batch,) = await collect(store, selection=Selection(rollouts=True), batch_size=8)
    rows = [(s["session_id"], s["advantage"]) for s in batch.get_non_tensor("samples")]
    # Every lineage's last branch of `rich` (3 rows, not its main loop's first branch) and
    # `plain`; two sessions in the group, rewards 1 and 0: advantages +1 and -1, whatever the
    # rows (counting rows would give rich +0.58 and plain -1.73).
    assert (
        sorted(rows)
        == [("plain", pytest.approx(-1.0, abs=1e-5))] + [("rich", pytest.approx(1.0, abs=1e-5))] * 3
    )
    # The default sample alone: the main loop's last branch of each session.
    (main,) = await collect(store, selection=Selection(final_only=True), batch_size=8)
    assert sorted(s["session_id"] for s in main.get_non_tensor("samples")) == ["plain", "rich"]
    with pytest.raises(BadSelection, match="pick one"):
        Selection(final_only=True, rollouts=True)


async def test_live_groups_count_sessions_not_rows(store: EventStore) -> None:
    rows = rollout_rows()
    await store_samples(store, rows[:4])  # rich's rows: three to deliver, one session of two
    live = replay_live(store, Selection(rollouts=True), batch_size=3, group_size=2,
                       poll_interval=0.05, idle_timeout=0.3)  # fmt: skip
    assert [b async for b in live] == []
    await store_samples(store, rows[4:])
    batches = [b async for b, _ in replay_live(store, Selection(rollouts=True), batch_size=4,
                                               group_size=2, poll_interval=0.05,
                                               idle_timeout=0.3)]  # fmt: skip
    advantages = sorted(round(s["advantage"]) for b in batches for s in b.get_non_tensor("samples"))
    assert advantages == [-1, 1, 1, 1]


async def test_a_sample_projected_again_after_its_group_was_released_keeps_its_advantage(
    store: EventStore,
) -> None:
    """The projector may write a finished session's sample again (another fact about it came):
    the tail then reads the newer copy. When its group was already released (advantages given,
    the batch not yet full), the copy keeps its group's advantage. It waited alone for a group
    that had moved on, and the live loop with it (seen once in the learning benchmark)."""
    first, second = group_rows(1), group_rows(2)[2:]  # groups g-0 and g-1, two sessions each
    await store_samples(store, first)
    live = replay_live(store, batch_size=4, group_size=2, poll_interval=0.05)
    coming = asyncio.ensure_future(anext(live))
    await asyncio.sleep(0.3)  # g-0 read and released; a batch of 4 waits for two more
    async with store.pool.acquire() as conn:  # g-0's first sample projected again
        await conn.execute("DELETE FROM samples WHERE sample_id = $1", first[0]["sample_id"])
    await store_samples(store, [first[0]])
    await store_samples(store, second)
    batch, _ = await asyncio.wait_for(coming, timeout=10)
    await live.aclose()
    advantages = {s["session_id"]: round(s["advantage"]) for s in batch.get_non_tensor("samples")}
    assert advantages == {"s-0-0": -1, "s-0-1": 1, "s-1-0": -1, "s-1-1": 1}


async def test_packing_fills_rows_up_to_the_budget(store: EventStore) -> None:
    await store_samples(store, group_rows(6))
    batches = await collect(store, token_budget=16, pack=True, batch_size=2)
    for batch in batches:
        assert batch["input_ids"].shape[1] <= 16
        assert batch["segment_ids"].max().item() >= 2  # samples of 4 to 7 tokens share rows
    assert sum(len(sample_ids(b)) for b in batches) == 12


async def test_staleness_is_counted_from_the_current_policy_version(store: EventStore) -> None:
    old = sample_row(session_id="old", group_id=None, policy_versions=[2, 4])
    await store_samples(
        store, [old, sample_row(session_id="new", group_id=None, policy_versions=[5])]
    )
    selection = Selection(current_policy_version=5, max_staleness=2)
    (batch,) = await collect(store, selection=selection, batch_size=8)
    assert [s["session_id"] for s in batch.get_non_tensor("samples")] == ["new"]
    assert batch["staleness"][0, 0].item() == 0
    assert batch["policy_version"][0, 0].item() == 5


async def test_samples_without_a_reward_are_refused_with_the_fix(store: EventStore) -> None:
    await store_samples(store, [sample_row(session_id="pending", reward=None)])
    with pytest.raises(BadSelection, match=r"no reward yet.*'pending'.*min_reward"):
        await collect(store, batch_size=2)
    assert await collect(store, selection=Selection(min_reward=0.0), batch_size=2) == []


async def test_replay_opens_its_own_connection_from_a_url(
    store: EventStore, database_url: str
) -> None:
    await store_samples(store, group_rows(1))
    batches = [b async for b in replay(database_url, batch_size=2)]
    assert torch.equal(
        batches[0]["input_ids"], (await collect(store, batch_size=2))[0]["input_ids"]
    )


# -- live ------------------------------------------------------------------------------------


async def live(store: EventStore, **kwargs: Any) -> list[tuple[TensorDict, LiveCheckpoint]]:
    kwargs.setdefault("poll_interval", 0.05)
    kwargs.setdefault("idle_timeout", 0.2)
    return [item async for item in replay_live(store, **kwargs)]


async def test_live_replay_waits_for_complete_groups_and_resumes_without_repeats(
    store: EventStore,
) -> None:
    rows = group_rows(3, per_group=2)
    await store_samples(store, rows[:3])  # group 0 complete, group 1 half there
    first = await live(store, batch_size=2, group_size=2)
    assert len(first) == 1
    batch, checkpoint = first[0]
    assert sorted(s["session_id"] for s in batch.get_non_tensor("samples")) == ["s-0-0", "s-0-1"]
    assert checkpoint.pending == (str(rows[2]["sample_id"]),)

    await store_samples(store, rows[3:])
    resumed = await live(store, batch_size=2, group_size=2, checkpoint=checkpoint)
    delivered = [s["session_id"] for b, _ in resumed for s in b.get_non_tensor("samples")]
    assert sorted(delivered) == ["s-1-0", "s-1-1", "s-2-0", "s-2-1"]
    # a whole group in one batch: advantages -1 and +1
    assert sorted(round(s["advantage"]) for s in resumed[0][0].get_non_tensor("samples")) == [-1, 1]


async def test_a_re_projected_sample_is_not_delivered_twice_unless_asked(
    store: EventStore,
) -> None:
    row = sample_row(session_id="s", group_id=None, reward=None)
    await store_samples(store, [row])
    assert await live(store, batch_size=1) == []  # no reward yet: it waits
    async with store.pool.acquire() as conn:  # the reward arrives: the session is re-projected
        await conn.execute("DELETE FROM samples WHERE session_id = 's'")
        await insert_samples(conn, [{**row, "reward": 1.0}])
    ((batch, checkpoint),) = await live(store, batch_size=1)
    assert batch["rewards"][0, 0].item() == 1.0

    async with store.pool.acquire() as conn:  # a later re-projection, e.g. another reward
        await conn.execute("DELETE FROM samples WHERE session_id = 's'")
        await insert_samples(conn, [{**row, "reward": 0.5}])
    assert await live(store, batch_size=1, checkpoint=checkpoint) == []
    again = await live(store, batch_size=1, checkpoint=checkpoint, redeliver=True)
    assert again[0][0]["rewards"][0, 0].item() == 0.5


def test_a_live_checkpoint_round_trips_through_json() -> None:
    checkpoint = LiveCheckpoint(7, 3, frozenset({"a", "b"}), ("c",))
    assert LiveCheckpoint.from_json(checkpoint.as_json()) == checkpoint


async def test_batches_say_which_version_generated_each_token(store: EventStore) -> None:
    # A turn cut by a weight switch: its first completion token by v3, the second by v4.
    row = sample_row(prompt=(1, 2, 3), completion=(4, 5), policy_versions=(3, 4))
    row["version_spans"] = [
        {"version": "3", "start": 3, "end": 4},
        {"version": "4", "start": 4, "end": 5},
    ]
    await store_samples(store, [row])
    selection = Selection(current_policy_version=5)
    [batch] = [b async for b in replay(store, selection, batch_size=1)]
    assert batch["token_version"][0].tolist() == [-1, -1, -1, 3, 4]
    assert batch["token_staleness"][0].tolist() == [-1, -1, -1, 2, 1]
    assert batch["staleness"][0, 0].item() == 2  # the sample's oldest token, as before
    # The verl batch and the TRL dataset carry them too, aligned with the sample's tokens.
    from trajstore.trainer.trl_dataset import read_samples_table
    from trajstore.trainer.verl_batch import verl_batch

    verl = await verl_batch(store, selection)
    assert verl is not None
    assert list(verl.non_tensor_batch["token_versions"][0]) == [-1, -1, -1, 3, 4]
    table = await read_samples_table(store, selection)
    assert table.column("token_versions").to_pylist() == [[-1, -1, -1, 3, 4]]
