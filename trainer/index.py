"""The selection's index: which samples a replay reads (ids, rewards, lengths), before any of
their arrays, in the order it hands them to the trainer, with their GRPO advantages.

Order: samples are sorted by id, then shuffled with `numpy.random.default_rng(seed)`; the same
selection over the same rows and the same seed give the same order. A GRPO advantage needs a
reward, so a selection holding samples without one is refused, saying how to leave them out.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from trajstore.store import EventStore, sample_reads
from trajstore.trainer.advantages import group_advantages
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.selection import Selection

log = logging.getLogger(__name__)


class IndexEntry(NamedTuple):
    """A selected sample before its arrays are read."""

    sample_id: uuid.UUID
    session_id: str
    group_id: str | None
    reward: float | None
    n_tokens: int
    policy_version_min: int | None


@contextlib.asynccontextmanager
async def open_store(source: str | EventStore) -> AsyncIterator[EventStore]:
    """The given store, or one opened on the given URL (and closed afterwards)."""
    if isinstance(source, EventStore):
        yield source
        return
    store = await EventStore.open(source, min_size=1, max_size=2)
    try:
        yield store
    finally:
        await store.close()


async def read_index(
    source: sample_reads.Source, selection: Selection
) -> tuple[int | None, list[IndexEntry]]:
    """The selected samples, sorted by id, and the projection version they were read from."""
    rows = await sample_reads.read_index(source, selection)
    version = rows[0]["projection_version"] if rows else None
    return version, [
        IndexEntry(
            row["sample_id"],
            row["session_id"],
            row["group_id"],
            row["reward"],
            row["n_tokens"],
            row["policy_version_min"],
        )
        for row in rows
    ]


class Ordered(NamedTuple):
    """A rewarded selection in the replay's order, with each sample's advantage."""

    version: int  #: the projection version its samples were read from
    entries: list[IndexEntry]  #: by id, then a seeded permutation (`shuffled`)
    advantages: dict[uuid.UUID, float]  #: GRPO over the whole selection (`advantages_by_sample`)


async def read_ordered(
    store: EventStore, selection: Selection, *, seed: int, shuffle: bool
) -> Ordered | None:
    """The selection's index, every sample checked for a reward (`check_rewards`), with its
    advantage, in the replay's order; None when no sample is selected."""
    version, entries = await read_index(store, selection)
    if version is None:
        return None
    check_rewards(entries)
    advantages = advantages_by_sample(entries)
    return Ordered(version, shuffled(entries, seed=seed, shuffle=shuffle), advantages)


def advantages_by_sample(entries: Sequence[IndexEntry]) -> dict[uuid.UUID, float]:
    """Each rewarded entry's GRPO advantage over the whole selection, a session one member of
    its group however many rows it gives (`trainer.advantages`)."""
    advantages = group_advantages(
        [float(e.reward or 0.0) for e in entries],
        [e.group_id for e in entries],
        [e.session_id for e in entries],
    )
    return {e.sample_id: a for e, a in zip(entries, advantages, strict=True)}


def shuffled(entries: list[IndexEntry], *, seed: int, shuffle: bool) -> list[IndexEntry]:
    """The entries in the replay's order: by id, then a seeded permutation."""
    if not shuffle:
        return entries
    permutation = np.random.default_rng(seed).permutation(len(entries))
    return [entries[i] for i in permutation]


def check_rewards(entries: Sequence[IndexEntry]) -> None:
    """`BadSelection` unless every selected sample has a reward (an update needs one)."""
    unrewarded = [e for e in entries if e.reward is None]
    if unrewarded:
        raise BadSelection(
            f"{len(unrewarded)} selected samples have no reward yet (e.g. session "
            f"{unrewarded[0].session_id!r}); assign rewards first, or leave them out with "
            "Selection(min_reward=...) / Selection(max_reward=...)"
        )


def skipped_entry(entry: IndexEntry, max_sample_tokens: int) -> dict[str, Any]:
    """The record of a sample the replay left out for its length (what the ledger keeps)."""
    log.warning(
        "skipping sample %s of session %s: %d tokens, more than max_sample_tokens=%d",
        entry.sample_id, entry.session_id, entry.n_tokens, max_sample_tokens,
    )  # fmt: skip
    return {
        "sample_id": str(entry.sample_id),
        "session_id": entry.session_id,
        "n_tokens": entry.n_tokens,
        "reason": f"{entry.n_tokens} tokens, more than max_sample_tokens={max_sample_tokens}",
    }
