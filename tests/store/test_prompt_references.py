"""Prompts stored as a reference to an earlier turn plus their new tokens (the prompt_tokens
contract in `store.sessions`): every reader sees the whole prompt, token for token."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from tests.support import RecordedSession
from trajstore.store import EventStore, migrations
from trajstore.store.projection import Projector
from trajstore.store.sessions import rebuild_session

Turn = tuple[list[int], dict[str, Any], list[int]]  # stored prompt ids, prompt payload, completion


def whole(prompt: list[int]) -> Turn:
    return prompt, {"choice": None}, []


def referencing(request: int, shared: int, new: list[int], total: int) -> Turn:
    prefix = {"request_id": f"r{request}", "n_tokens": shared}
    return new, {"choice": None, "prefix": prefix, "n_tokens": total}, []


async def record(store: EventStore, turns: list[tuple[Turn, list[int]]]) -> None:
    recorded = RecordedSession(store)
    await recorded.created()
    for n, ((prompt, payload, _), completion) in enumerate(turns):
        received = {"request_id": f"r{n}", "body": {}}
        await recorded.turn(received, prompt, completion, prompt=payload)
    await recorded.finished()


async def test_a_referencing_prompt_is_rebuilt_whole_through_a_chain(store: EventStore) -> None:
    await record(
        store,
        [
            (whole([1, 10, 11]), [20, 2]),
            # turn 0's prompt and completion (5 tokens), then its own new tokens
            (referencing(0, 5, [30, 31], total=7), [40, 2]),
            # a chain: turn 1's whole prompt and completion, then more
            (referencing(1, 9, [50], total=10), [60]),
            # sharing only part of turn 0's prompt: a rewritten history
            (referencing(0, 2, [99, 98], total=4), [70]),
        ],
    )
    events = await store.read_session("s1")
    for packed in (False, True):
        session = rebuild_session("s1", events, packed=packed)
        prompts = [
            np.frombuffer(t.prompt_token_ids, "<i4").tolist() if packed else t.prompt_token_ids  # type: ignore[arg-type]
            for t in session.turns
        ]
        assert prompts == [
            [1, 10, 11],
            [1, 10, 11, 20, 2, 30, 31],
            [1, 10, 11, 20, 2, 30, 31, 40, 2, 50],
            [1, 10, 99, 98],
        ]
        assert [t.status for t in session.turns] == ["completed"] * 4

    # The samples are the same as from whole prompts: one extended sample, then another
    # conversation (it shares two tokens with the first: store.lineages).
    assert await Projector(store).run_once() == 1
    rows = await store.pool.fetch("SELECT * FROM samples ORDER BY lineage, branch")
    assert [np.frombuffer(r["token_ids"], "<i4").tolist() for r in rows] == [
        [1, 10, 11, 20, 2, 30, 31, 40, 2, 50, 60],
        [1, 10, 99, 98, 70],
    ]
    assert [(r["lineage"], r["divergence"]) for r in rows] == [(0, None), (1, None)]
    # The turns view counts whole prompts, not the stored new tokens.
    counts = await store.pool.fetch("SELECT prompt_tokens FROM turns ORDER BY position")
    assert [r["prompt_tokens"] for r in counts] == [3, 7, 10, 4]


async def test_a_reference_the_log_cannot_satisfy_fails_its_turn(store: EventStore) -> None:
    await record(
        store,
        [
            (whole([1, 10, 11]), [20, 2]),
            (referencing(0, 9, [30], total=10), [40]),  # turn 0 holds only 5 tokens
            (referencing(7, 3, [30], total=4), [40]),  # no request r7 in this session
            (referencing(3, 1, [30], total=2), [40]),  # itself
        ],
    )
    session = rebuild_session("s1", await store.read_session("s1"))
    assert [t.status for t in session.turns] == ["completed", "failed", "failed", "failed"]
    for turn in session.turns[1:]:
        assert turn.failure is not None and turn.failure.reason == "prompt_unresolved"
        assert turn.prompt_token_ids == []
    # Never a sample with guessed tokens: only the first turn is trained on.
    assert await Projector(store).run_once() == 1
    [row] = await store.pool.fetch("SELECT token_ids FROM samples")
    assert np.frombuffer(row["token_ids"], "<i4").tolist() == [1, 10, 11, 20, 2]


async def test_migration_0008_makes_an_existing_turns_view_count_whole_prompts(
    store: EventStore, database_url: str
) -> None:
    await record(store, [(whole([1, 10, 11]), [20, 2]), (referencing(0, 5, [30, 31], 7), [40])])
    query = "SELECT prompt_tokens FROM turns ORDER BY position"
    await asyncio.to_thread(migrations.downgrade, database_url, "0007_payload_compression")
    assert [r["prompt_tokens"] for r in await store.pool.fetch(query)] == [3, 2]  # stored only
    await asyncio.to_thread(migrations.upgrade, database_url)
    assert [r["prompt_tokens"] for r in await store.pool.fetch(query)] == [3, 7]
