"""Rows for the `samples` table, written straight into it, for tests of its readers.

The projection's own tests cover how rows get there; these tests cover what readers do with
them, so they write rows with exactly the columns a test is about.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import asyncpg
import numpy as np

from trajstore.store import EventStore
from trajstore.store.sessions import ChoiceRecord, SessionRecord, TurnRecord
from trajstore.store.tokens import encode_logprobs, encode_token_ids


def sample_row(
    *,
    session_id: str = "s-1",
    run_id: str = "run-1",
    group_id: str | None = "g-1",
    reward: float | None = 1.0,
    prompt: Sequence[int] = (1, 2, 3),
    completion: Sequence[int] = (4, 5),
    status: str = "completed",
    is_final: bool = True,
    branch: int = 0,
    lineage: int = 0,
    role: str = "main",
    tags: Sequence[str] = (),
    finished_at: datetime | None = datetime(2026, 1, 1, tzinfo=UTC),
    policy_versions: Sequence[int] = (0,),
    projection_version: int = 1,  # the version the projector serves first
    sample_id: uuid.UUID | None = None,
) -> dict[str, Any]:
    """One sample's columns; logprobs of the completion are -0.1, -0.2, ... (0 on the prompt)."""
    tokens = [*prompt, *completion]
    mask = [0] * len(prompt) + [1] * len(completion)
    logprobs = [0.0] * len(prompt) + [-0.1 * (i + 1) for i in range(len(completion))]
    return {
        "sample_id": sample_id
        or uuid.uuid5(
            uuid.NAMESPACE_URL,
            f"{session_id}/{branch}" if lineage == 0 else f"{session_id}/{lineage}/{branch}",
        ),
        "projection_version": projection_version,
        "session_id": session_id,
        "run_id": run_id,
        "group_id": group_id,
        "branch": branch,
        "lineage": lineage,
        "role": role,
        "is_final": is_final,
        "status": status,
        "reward": reward,
        "token_ids": encode_token_ids(np.array(tokens, dtype=np.int32)),
        "loss_mask": bytes(mask),
        "logprobs": encode_logprobs(np.array(logprobs, dtype=np.float32)),
        "prompt_len": len(prompt),
        "response_len": len(completion),
        "n_turns": 1,
        "tool_turns": 0,
        "policy_versions": [str(v) for v in policy_versions],
        "engines": [],
        "last_position": 1,
        "tags": list(tags),
        "finished_at": finished_at,
        "policy_version_min": min(policy_versions) if policy_versions else None,
        "policy_version_max": max(policy_versions) if policy_versions else None,
    }


async def insert_samples(conn: asyncpg.Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert rows (all with the same columns) into `samples`."""
    columns = list(rows[0])
    placeholders = ", ".join(f"${i + 1}" for i in range(len(columns)))
    await conn.executemany(
        f"INSERT INTO samples ({', '.join(columns)}) VALUES ({placeholders})",
        [[row[c] for c in columns] for row in rows],
    )


async def store_samples(store: EventStore, rows: Sequence[dict[str, Any]]) -> None:
    """Insert rows into the store's `samples` (`insert_samples` on one of its connections)."""
    async with store.pool.acquire() as conn:
        await insert_samples(conn, rows)


def completed_turn(prompt: list[int], completion: list[int], index: int) -> TurnRecord:
    """A completed chat turn as rebuilt from the log (logprobs -0.5 each)."""
    record = TurnRecord(f"r{index}", "chat", {}, "e", "0", None, False, {}, prompt)
    record.status = "completed"
    record.choices[0] = ChoiceRecord(0, completion, [-0.5] * len(completion), finish_reason="stop")
    return record


def branched_session(eos: int) -> SessionRecord:
    """Three turns, two branches of one conversation: turn 1 extends turn 0, turn 2 cut the
    history back to turn 0's prompt (`store.lineages`: history_truncated)."""
    session = SessionRecord("s", run_id="r", status="completed")
    session.turns = [
        completed_turn([1, 10], [20, eos], 0),
        completed_turn([1, 10, 20, eos, 30], [40, eos], 1),
        completed_turn([1, 10], [50, 51, eos], 2),
    ]
    return session


def rollout_rows(group_id: str = "g-r") -> list[dict[str, Any]]:
    """Two sessions of one group: `rich` (reward 1) ran three conversations (its main loop in two
    branches after a divergence, a sub-agent, a side call), `plain` (reward 0) one."""
    rich = {"session_id": "rich", "group_id": group_id, "reward": 1.0}
    return [
        sample_row(**rich, branch=0, is_final=False, completion=(4, 5)),
        sample_row(**rich, branch=1, completion=(4, 5, 6)),
        sample_row(**rich, lineage=1, role="subagent", is_final=False, completion=(7, 8)),
        sample_row(**rich, lineage=2, role="side", is_final=False, completion=(9,)),
        sample_row(session_id="plain", group_id=group_id, reward=0.0),
    ]
