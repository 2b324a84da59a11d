"""Recorded samples as a TRL dataset: any `Selection`, one row per sample, with the columns
TRL's trainers read from a pre-tokenised dataset (`input_ids`, `completion_mask`) and what an
off-policy update needs besides (behaviour `logprobs`, `reward`, the session's `advantage`).

With `Selection(rollouts=True)` a session gives one row per conversation (main loop, sub-agents,
side calls: `lineage`, `role`), and the rows of a session share its reward and its advantage
(`trainer.advantages`: a session is one member of its group). TRL's online `rollout_func`
returns one completion per generation, so the online path (`trajstore.rollout.trl_rollout`)
trains on the main lineage (`is_final`); the offline dataset is where all lineages go.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from trajstore.store import EventStore, sample_reads
from trajstore.store.tokens import decode_logprobs, decode_token_ids
from trajstore.trainer.advantages import group_advantages
from trajstore.trainer.arrays import decode_arrays
from trajstore.trainer.distill import read_teacher_logprobs
from trajstore.trainer.selection import Selection

if TYPE_CHECKING:
    from datasets import Dataset  # type: ignore[import-untyped,unused-ignore]

#: The columns of `samples_dataset`, in order.
DATASET_COLUMNS = (
    "sample_id", "session_id", "run_id", "task_id", "group_id", "lineage", "role", "branch",
    "is_final", "status", "finish_reason", "reward", "advantage", "policy_version_min",
    "prompt_len", "input_ids",
    "completion_mask", "logprobs", "token_versions", "teacher_logprobs",
)  # fmt: skip


async def read_samples_table(
    source: str | EventStore, selection: Selection | None = None, teacher: str | None = None
) -> Any:
    """The selected samples as a `pyarrow.Table` with `DATASET_COLUMNS` (see `samples_dataset`)."""
    import pyarrow as pa

    selection = selection or Selection()
    store = source if isinstance(source, EventStore) else await EventStore.open(source, max_size=1)
    try:
        rows = await sample_reads.read_dataset(store, selection)
        teachers = {}
        if teacher is not None:
            teachers = await read_teacher_logprobs(
                store,
                {r["sample_id"]: np.frombuffer(r["token_ids"], "<i4") for r in rows},
                {r["sample_id"]: np.frombuffer(r["loss_mask"], np.uint8) for r in rows},
                teacher,
            )
    finally:
        if store is not source:
            await store.close()

    def lists(parts: list[np.ndarray[Any, Any]], dtype: Any) -> Any:
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum([len(p) for p in parts], out=offsets[1:])
        values = np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)
        return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))

    # One advantage per session: with `Selection(rollouts=True)` its lineages share it.
    advantages = group_advantages(
        [float(r["reward"] or 0.0) for r in rows],
        [r["group_id"] for r in rows],
        [r["session_id"] for r in rows],
    )
    tokens = [np.asarray(decode_token_ids(r["token_ids"]), np.int32) for r in rows]
    masks = [np.frombuffer(r["loss_mask"], dtype=np.uint8) for r in rows]
    logprobs = [np.asarray(decode_logprobs(r["logprobs"]), np.float32) for r in rows]
    versions = [
        decode_arrays(r["token_ids"], r["loss_mask"], r["logprobs"], r["version_spans"])[3]
        for r in rows
    ]
    absent = [np.full(len(t), np.nan, np.float32) for t in tokens]
    teacher_logprobs = [teachers.get(r["sample_id"], a) for r, a in zip(rows, absent, strict=True)]
    columns: dict[str, Any] = {
        "sample_id": pa.array([str(r["sample_id"]) for r in rows], pa.string()),
        "session_id": pa.array([r["session_id"] for r in rows], pa.string()),
        "run_id": pa.array([r["run_id"] for r in rows], pa.string()),
        "task_id": pa.array([r["task_id"] for r in rows], pa.string()),
        "group_id": pa.array([r["group_id"] for r in rows], pa.string()),
        "lineage": pa.array([r["lineage"] for r in rows], pa.int32()),
        "role": pa.array([r["role"] for r in rows], pa.string()),
        "branch": pa.array([r["branch"] for r in rows], pa.int32()),
        "is_final": pa.array([r["is_final"] for r in rows], pa.bool_()),
        "status": pa.array([r["status"] for r in rows], pa.string()),
        "finish_reason": pa.array([r["finish_reason"] for r in rows], pa.string()),
        "reward": pa.array([r["reward"] for r in rows], pa.float64()),
        "advantage": pa.array(advantages, pa.float32()),
        "policy_version_min": pa.array([r["policy_version_min"] for r in rows], pa.int64()),
        "prompt_len": pa.array([r["prompt_len"] for r in rows], pa.int32()),
        "input_ids": lists(tokens, np.int32),
        "completion_mask": lists(masks, np.int8),
        "logprobs": lists(logprobs, np.float32),
        "token_versions": lists(versions, np.int32),
        "teacher_logprobs": lists(teacher_logprobs, np.float32),
    }
    return pa.table({name: columns[name] for name in DATASET_COLUMNS})


def samples_dataset(
    database_url: str, selection: Selection | None = None, teacher: str | None = None
) -> Dataset:
    """The samples of a recorded run (any `Selection`) as a `datasets.Dataset`, one row each.

    Rows are in sample id order. Columns (`DATASET_COLUMNS`): the sample's identity and outcome
    (`sample_id`, `session_id`, `run_id`, `task_id`, `group_id`, `lineage`, `role`, `branch`,
    `is_final`, `status`, `finish_reason`, `reward`, `policy_version_min`), `advantage` (the
    GRPO advantage of the sample's session within its group, `trainer.advantages`: with
    `Selection(rollouts=True)` every lineage of a session is a row and they share it),
    `prompt_len` (tokens before the first generated one), and the token arrays: `input_ids`
    (int32), `completion_mask` (int8, the loss mask: 1 where the model generated the token) and
    `logprobs` (float32, the behaviour logprobs; 0.0 where the mask is 0), `token_versions`
    (int32, the policy version that generated each token; -1 where none). `input_ids` and
    `completion_mask` are the columns TRL's `SFTTrainer` reads from a pre-tokenised
    dataset (with `completion_only_loss=True`). `teacher_logprobs` (float32): with `teacher`,
    that teacher's logprob of each generated token (`trajstore score`, `trainer.distill`), NaN
    where it gave none (prompt tokens, an unscored sample); all NaN without.

    Every row is held in memory. From async code, `Dataset(await read_samples_table(...))`.
    """
    from datasets import Dataset

    return Dataset(run_sync(lambda: read_samples_table(database_url, selection, teacher)))


T = TypeVar("T")


def run_sync(make: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine to completion from synchronous code.

    In a thread with no running event loop (TRL's training loop), in a new loop here. Inside a
    running loop (a notebook), in a new loop on a worker thread, while this thread waits: the
    proxy must then not be served from that same loop (an async test awaits
    `TrajstoreRollout.rollout` instead, or trains with `asyncio.to_thread`).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(lambda: asyncio.run(make())).result()
