"""The samples projection against a real PostgreSQL: what becomes a sample, and crash safety."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import asyncpg
import numpy as np
import pytest

from tests.support import RecordedSession
from trajstore.store import EventStore, EventType, NewEvent, StoreUnavailable, session_stream
from trajstore.store.projection import Projector
from trajstore.store.sessions import rebuild_session


async def record_session(
    store: EventStore,
    session_id: str,
    turns: list[tuple[list[int], list[int]]],
    *,
    finish: str | None = "completed",
    reward: float | None = 1.0,
    commit_order: list[int] | None = None,
) -> None:
    """Append a session as the proxy records it: created, turns, reward, finished.

    Turns arrive in the order given; `commit_order` appends them in another (as two proxy
    replicas' writers may commit them).
    """

    recorded = RecordedSession(store, session_id)
    await recorded.created(task_id="t", group_id="g")
    for n in commit_order or range(len(turns)):
        prompt, completion = turns[n]
        received = {
            "request_id": f"{session_id}-{n}",
            "body": {},
            "received_at": 1_800_000_000.0 + n,
        }
        await recorded.turn(received, prompt, completion, logprob=-0.25)
    await recorded.finished(reward, finish)


async def samples_of(store: EventStore) -> list[asyncpg.Record]:
    return await store.pool.fetch("SELECT * FROM samples ORDER BY session_id, branch")


async def test_a_finished_session_becomes_a_token_exact_sample(store: EventStore) -> None:
    await record_session(store, "s1", [([1, 10], [20, 2]), ([1, 10, 20, 2, 30], [40, 2])])
    assert await Projector(store).run_once() == 1
    [row] = await samples_of(store)
    assert np.frombuffer(row["token_ids"], "<i4").tolist() == [1, 10, 20, 2, 30, 40, 2]
    assert list(row["loss_mask"]) == [0, 0, 1, 1, 0, 1, 1]
    logprobs = np.frombuffer(row["logprobs"], "<f4").tolist()
    assert logprobs == [0, 0, -0.25, -0.25, 0, -0.25, -0.25]
    assert (row["run_id"], row["task_id"], row["group_id"]) == ("run-1", "t", "g")
    assert (row["reward"], row["status"], row["n_turns"], row["response_len"]) == (
        1.0, "completed", 2, 4
    )  # fmt: skip
    assert row["is_final"] and row["divergence"] is None


async def test_turns_committed_out_of_request_order_still_make_one_sample(
    store: EventStore,
) -> None:
    # Two replicas served the session's turns; the second turn's replica committed first.
    turns = [([1, 10], [20, 2]), ([1, 10, 20, 2, 30], [40, 2]), ([1, 10, 20, 2, 30, 40, 2], [5])]
    await record_session(store, "s1", turns, commit_order=[1, 0, 2])
    await Projector(store).run_once()
    [row] = await samples_of(store)
    assert np.frombuffer(row["token_ids"], "<i4").tolist() == [1, 10, 20, 2, 30, 40, 2, 5]
    assert (row["n_turns"], row["divergence"]) == (3, None)
    session = await store.read_session("s1")
    assert [t.request_id for t in rebuild_session("s1", session).turns] == [
        "s1-0", "s1-1", "s1-2"
    ]  # fmt: skip


async def test_unfinished_and_discarded_sessions_have_no_samples(store: EventStore) -> None:
    await record_session(store, "open", [([1], [2])], finish=None)
    await record_session(store, "gone", [([1], [2])])
    await store.append(
        session_stream("gone"),
        [NewEvent(EventType.SESSION_DISCARDED, session_id="gone", payload={"reason": "leak"})],
    )
    await record_session(store, "failed", [([1], [2])], finish="error")
    await Projector(store).run_once()
    assert [(r["session_id"], r["status"]) for r in await samples_of(store)] == [
        ("failed", "error")
    ]


async def test_a_late_reward_updates_the_samples(store: EventStore) -> None:
    await record_session(store, "s1", [([1], [2])], reward=None)
    projector = Projector(store)
    await projector.run_once()
    assert (await samples_of(store))[0]["reward"] is None
    await store.append(
        session_stream("s1"),
        [NewEvent(EventType.REWARD_ASSIGNED, session_id="s1", payload={"value": 0.5})],
    )
    await projector.run_once()
    [row] = await samples_of(store)
    assert row["reward"] == 0.5


async def test_killed_between_writing_and_committing_it_resumes_without_loss_or_doubles(
    store: EventStore,
) -> None:
    for i in range(5):
        await record_session(store, f"s{i}", [([1, i], [20 + i])])

    class Killed(Projector):
        async def before_commit(self, conn: asyncpg.Connection) -> None:
            # Everything is written, nothing committed: the connection dies right here.
            await store.pool.execute("SELECT pg_terminate_backend($1)", conn.get_server_pid())

    with pytest.raises(StoreUnavailable):
        await Killed(store, batch_size=3).run_once()
    assert await samples_of(store) == []  # the transaction died with the connection
    assert await store.pool.fetchval("SELECT count(*) FROM projection_checkpoints") == 0

    # Small batches: a session's reward and its finish may land in different batches.
    assert await Projector(store, batch_size=3).run_once() >= 5
    rows = await samples_of(store)
    assert [r["session_id"] for r in rows] == [f"s{i}" for i in range(5)]
    assert await Projector(store).run_once() == 0  # nothing new: nothing doubled


async def test_a_rebuild_writes_a_new_version_beside_the_served_one_then_switches(
    store: EventStore,
) -> None:
    await record_session(store, "s1", [([1, 10, 11], [20]), ([1, 10], [40])])  # truncated
    await record_session(store, "s2", [([1, 10], [30])])
    projector = Projector(store, batch_size=1)
    await projector.run_once()
    before = [dict(r) for r in await samples_of(store)]
    assert {r["projection_version"] for r in before} == {1}

    seen: list[tuple[int, int]] = []
    served_during: list[int] = []

    def progress(done: int, total: int) -> None:
        seen.append((done, total))

    async def served_rows() -> list[asyncpg.Record]:
        return await store.pool.fetch(
            "SELECT s.* FROM samples s JOIN projection_serving p"
            " ON p.name = 'samples' AND p.version = s.projection_version"
            " ORDER BY session_id, lineage, branch"
        )

    # While the rebuild runs, readers of the served version still get every old row.
    class Watching(Projector):
        async def before_commit(self, conn: asyncpg.Connection) -> None:
            served_during.append(len(await served_rows()))

    rebuilder = Watching(store, batch_size=1)
    assert await rebuilder.rebuild(progress) == 2
    assert served_during and set(served_during) == {len(before)}
    assert seen[-1] == (4, 4)  # two sessions: a reward and a finish each

    after = [dict(r) for r in await served_rows()]
    unversioned = {"projected_at", "projected_tx", "projected_seq", "projection_version"}
    assert [{k: v for k, v in r.items() if k not in unversioned} for r in after] == [
        {k: v for k, v in r.items() if k not in unversioned} for r in before
    ]
    assert len(after) == 3 and after[1]["divergence"] is not None
    # The old version is gone; the live projector now follows the new one.
    assert {r["projection_version"] for r in await samples_of(store)} == {2}
    await record_session(store, "s3", [([1, 10], [50])])
    assert await projector.run_once() == 2  # s3's reward and finish, one batch each
    assert {r["projection_version"] for r in await samples_of(store)} == {2}
    assert len(await served_rows()) == 4


async def test_live_projection_follows_new_sessions(store: EventStore) -> None:
    projector = asyncio.create_task(Projector(store).run_forever(poll_interval=30.0))
    try:
        await record_session(store, "live-1", [([1], [2])])
        rows: list[asyncpg.Record] = []
        for _ in range(100):  # woken by NOTIFY, not by the 30 s poll
            if rows := await samples_of(store):
                break
            await asyncio.sleep(0.05)
        assert [r["session_id"] for r in rows] == ["live-1"]
    finally:
        projector.cancel()
        with pytest.raises(asyncio.CancelledError):
            await projector


def test_the_cli_projects_once(database_url: str) -> None:
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-m", "trajstore", "project", "--once"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "projected 0 sessions"
