"""Replay a finished selection of recorded samples as training batches (`replay`; samples as
sessions finish, for asynchronous RL: `trainer.replay_live`).

`replay` reads the selection's index (ids, rewards, lengths; `trainer.index`) first, which
orders it and computes GRPO advantages over the whole selection, plans batches
(`trainer.collate`), then reads the packed arrays batch by batch, so memory holds one batch of
arrays at a time. The same selection over the same rows and the same seed give the same batches,
in the same order. Rewards: a GRPO advantage needs one, so `replay` refuses a selection that
holds samples without one (and says how to leave them out).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import numpy as np
from tensordict import TensorDict

from trajstore.store import EventStore, sample_reads
from trajstore.store.side_data import EXPERTS, ROUTED_EXPERTS, turn_arrays
from trajstore.trainer import lag
from trajstore.trainer.arrays import Arrays, read_arrays
from trajstore.trainer.collate import Layout, ReplaySample, collate
from trajstore.trainer.distill import read_teacher_logprobs, unscored
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.index import IndexEntry, open_store, read_ordered, skipped_entry
from trajstore.trainer.routing import as_batch_routing
from trajstore.trainer.selection import Selection

#: Samples whose arrays one read fetches (whole batches), one read ahead of the trainer.
READ_AHEAD_SAMPLES = 256


def replay_sample(
    entry: IndexEntry,
    arrays: Arrays,
    advantage: float,
    selection: Selection,
    teacher: np.ndarray | None = None,
    routed: np.ndarray | None = None,
) -> ReplaySample:
    """One selected sample as a batch holds it (`trainer.collate`)."""
    tokens, mask, logprobs, versions = arrays
    assert entry.reward is not None
    return ReplaySample(
        entry.sample_id,
        entry.session_id,
        tokens,
        mask,
        logprobs,
        float(entry.reward),
        advantage,
        *selection.versions(entry.policy_version_min),
        token_versions=versions,
        token_staleness=lag.token_staleness(versions, selection.current_policy_version),
        teacher_logprobs=teacher,
        routed_experts=routed,
    )


async def routed_arrays(
    store: EventStore, version: int, ids: Sequence[uuid.UUID]
) -> dict[uuid.UUID, np.ndarray]:
    """The routed experts the engine recorded for these samples' tokens, as batch rows hold
    them (`trainer.routing`); samples without any are left out."""
    found = {}
    for row in await sample_reads.read_side(store, version, ids):
        for side in turn_arrays(row["side"], row["side_data"]):
            if side.kind == ROUTED_EXPERTS:
                found[row["sample_id"]] = as_batch_routing(side.arrays[EXPERTS])
    return found


async def teacher_arrays(
    store: EventStore, arrays: dict[uuid.UUID, Arrays], teacher: str | None
) -> dict[uuid.UUID, np.ndarray]:
    """`teacher`'s logprobs of these samples, aligned with their tokens (`trainer.distill`);
    empty without a teacher."""
    if teacher is None:
        return {}
    return await read_teacher_logprobs(
        store, {i: a[0] for i, a in arrays.items()}, {i: a[1] for i, a in arrays.items()}, teacher
    )


async def replay(
    source: str | EventStore,
    selection: Selection | None = None,
    *,
    batch_size: int | None = None,
    token_budget: int | None = None,
    pack: bool = False,
    seed: int = 0,
    shuffle: bool = True,
    max_sample_tokens: int | None = None,
    teacher: str | None = None,
    routing: bool = False,
) -> AsyncIterator[TensorDict]:
    """The selected samples as `TensorDict` batches (layout: `trainer.collate`), in seeded order.

    `source` is a database URL or an open `EventStore`. Batches hold `batch_size` samples, or as
    many as fit `token_budget` padded tokens; with `pack=True`, rows of up to `token_budget`
    tokens holding several samples (`batch_size` rows per batch). One pass over the selection.

    `max_sample_tokens`: samples longer than this are skipped, whole, never truncated; the
    pass's first batch names them in its non-tensor `skipped` entry (`skipped_entry`) so the
    step that trains it records them. With it, a sample longer than `token_budget` (but within
    the limit) gets a row, or a padded batch, of its own.
    With `teacher`, batches carry that teacher's logprobs (`trainer.distill`); a selected sample
    it has not scored is refused (`BadSelection`), as one without a reward is. With `routing`,
    batches carry the routed experts the engine recorded (`routed_experts`, `trainer.routing`),
    which the learner's forward then replays.
    """
    selection = selection or Selection()
    layout = Layout(batch_size, token_budget, pack)
    async with open_store(source) as store:
        index = await read_ordered(store, selection, seed=seed, shuffle=shuffle)
        if index is None:
            return
        version, ordered, advantage_of = index
        skipped = []
        if max_sample_tokens is not None:
            skipped = [skipped_entry(e, max_sample_tokens) for e in ordered
                       if e.n_tokens > max_sample_tokens]  # fmt: skip
            ordered = [e for e in ordered if e.n_tokens <= max_sample_tokens]
            if not ordered:
                raise BadSelection(
                    f"all {len(skipped)} selected samples are longer than max_sample_tokens="
                    f"{max_sample_tokens} (the longest has "
                    f"{max(s['n_tokens'] for s in skipped)} tokens): raise the limit"
                )
        plan = layout.plan(
            [e.n_tokens for e in ordered],
            [e.sample_id for e in ordered],
            long_alone=max_sample_tokens is not None,
        )

        async def fetch(
            chunk: list[list[list[int]]],
        ) -> tuple[
            dict[uuid.UUID, Arrays], dict[uuid.UUID, np.ndarray], dict[uuid.UUID, np.ndarray]
        ]:
            ids = [ordered[i].sample_id for rows in chunk for row in rows for i in row]
            arrays = await read_arrays(store, version, ids)
            teachers = await teacher_arrays(store, arrays, teacher)
            routed = await routed_arrays(store, version, ids) if routing else {}
            if teacher is not None and (missing := unscored(ids, teachers)):
                raise BadSelection(
                    f"teacher {teacher!r} has not scored {len(missing)} selected samples (e.g. "
                    f"{missing[0]}; the scoring_failures view says why if it tried): run "
                    f"`trajstore score --teacher {teacher} ...` first"
                )
            return arrays, teachers, routed

        # Read the next chunk's arrays while this chunk's batches are built and trained on.
        chunks = _chunks(plan, READ_AHEAD_SAMPLES)
        pending = asyncio.ensure_future(fetch(chunks[0]))
        try:
            for k, chunk in enumerate(chunks):
                arrays, teachers, routed = await pending
                if k + 1 < len(chunks):
                    pending = asyncio.ensure_future(fetch(chunks[k + 1]))
                for batch_rows in chunk:
                    batch = collate(
                        [
                            [
                                replay_sample(
                                    e,
                                    arrays[e.sample_id],
                                    advantage_of[e.sample_id],
                                    selection,
                                    teachers.get(e.sample_id),
                                    routed.get(e.sample_id),
                                )
                                for e in (ordered[i] for i in row)
                            ]
                            for row in batch_rows
                        ]
                    )
                    if skipped:  # told once, with the pass's first batch
                        batch.set_non_tensor("skipped", skipped)
                        skipped = []
                    yield batch
        finally:
            pending.cancel()


def _chunks(plan: list[list[list[int]]], samples: int) -> list[list[list[list[int]]]]:
    """Consecutive batches grouped so that each group holds at least `samples` samples."""
    chunks: list[list[list[list[int]]]] = [[]]
    count = 0
    for batch_rows in plan:
        if count >= samples:
            chunks.append([])
            count = 0
        chunks[-1].append(batch_rows)
        count += sum(len(row) for row in batch_rows)
    return chunks
