"""Live replay with a maximum policy lag: stale samples are dropped, batches carry exact lags."""

from __future__ import annotations

from tests.trainer.rows import sample_row, store_samples
from trajstore.store import EventStore
from trajstore.trainer.replay_live import replay_live


async def test_samples_beyond_the_max_lag_are_dropped_and_never_come_back(
    store: EventStore,
) -> None:
    rows = [
        sample_row(session_id=f"v{v}", group_id=None, policy_versions=(v, v + 1)) for v in range(5)
    ] + [sample_row(session_id="unknown", group_id=None, policy_versions=())]
    await store_samples(store, rows)

    version = 4
    got = [
        item
        async for item in replay_live(
            store, batch_size=1, poll_interval=0.05, idle_timeout=0.2,
            policy_version=lambda: version, max_lag=2,
        )
    ]  # fmt: skip
    delivered = [s for batch, _ in got for s in batch.get_non_tensor("samples")]
    # Versions 2, 3, 4 are at most 2 behind version 4; 0, 1 and the unknown one are dropped.
    assert sorted((s["session_id"], s["staleness"]) for s in delivered) == [
        ("v2", 2), ("v3", 1), ("v4", 0),
    ]  # fmt: skip
    assert all(batch["staleness"][0, 0].item() in (0, 1, 2) for batch, _ in got)

    # Resuming from the last checkpoint at a later version delivers nothing again.
    checkpoint = got[-1][1]
    assert {"v0", "v1"} <= {r["session_id"] for r in rows if str(r["sample_id"]) in
                            checkpoint.delivered}  # fmt: skip
    version = 9
    again = [
        item
        async for item in replay_live(
            store, batch_size=1, poll_interval=0.05, idle_timeout=0.2, checkpoint=checkpoint,
            policy_version=lambda: version, max_lag=2,
        )
    ]  # fmt: skip
    assert again == []


async def test_without_a_max_lag_batches_still_carry_the_lag_at_the_current_version(
    store: EventStore,
) -> None:
    await store_samples(store, [sample_row(session_id="old", group_id=None)])
    ((batch, _),) = [
        item
        async for item in replay_live(
            store, batch_size=1, poll_interval=0.05, idle_timeout=0.2, policy_version=lambda: 7
        )
    ]
    assert batch.get_non_tensor("samples")[0]["staleness"] == 7
