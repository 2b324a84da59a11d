"""Replay recorded samples as training batches: a finished selection (`replay`), or samples as
sessions finish (`replay_live`, for asynchronous RL).

`replay` reads the selection's index (ids, rewards, lengths) first, orders it, computes GRPO
advantages over the whole selection (`trainer.advantages`), plans batches (`trainer.collate`),
then reads the packed arrays batch by batch, so memory holds one batch of arrays at a time.

Order: samples are sorted by id, then shuffled with `numpy.random.default_rng(seed)`; the same
selection over the same rows and the same seed give the same batches, in the same order.

Rewards: a GRPO advantage needs a reward, so `replay` refuses a selection that holds samples
without one (and says how to leave them out). `replay_live` waits for them: a reward that
arrives after the finish re-projects the session, and the tail sees the sample again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import asyncpg
import numpy as np
from tensordict import TensorDict

from trajstore.store import EventStore, sample_reads
from trajstore.store.side_data import EXPERTS, ROUTED_EXPERTS, turn_arrays
from trajstore.trainer import lag
from trajstore.trainer.advantages import group_advantages
from trajstore.trainer.arrays import Arrays, decode_arrays, read_arrays
from trajstore.trainer.collate import Layout, ReplaySample, collate
from trajstore.trainer.distill import read_teacher_logprobs, unscored
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.routing import as_batch_routing
from trajstore.trainer.selection import Selection

log = logging.getLogger(__name__)

#: Samples whose arrays one read fetches (whole batches), one read ahead of the trainer.
READ_AHEAD_SAMPLES = 256


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


async def read_rewarded_index(
    store: EventStore, selection: Selection
) -> tuple[int, list[IndexEntry]] | None:
    """`read_index` on a connection of its own, every selected sample checked for a reward
    (`check_rewards`); None when no sample is selected."""
    version, entries = await read_index(store, selection)
    if version is None:
        return None
    check_rewards(entries)
    return version, entries


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


def _sample(
    entry: IndexEntry,
    arrays: Arrays,
    advantage: float,
    selection: Selection,
    teacher: np.ndarray | None = None,
    routed: np.ndarray | None = None,
) -> ReplaySample:
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
        index = await read_rewarded_index(store, selection)
        if index is None:
            return
        version, entries = index
        advantage_of = advantages_by_sample(entries)
        ordered = shuffled(entries, seed=seed, shuffle=shuffle)
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
                                _sample(
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


# -- live ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveCheckpoint:
    """Where a live replay stands; save it with the model, pass it back to resume.

    `projected_tx`, `projected_seq`: the last `samples` row read. `delivered`: the sample ids
    handed to the trainer (a re-projected sample is not handed over again). `pending`: ids read
    but not yet in a batch (waiting for their group, or for a batch to fill); a resumed replay
    reads them again first.
    """

    projected_tx: int = 0
    projected_seq: int = 0
    delivered: frozenset[str] = frozenset()
    pending: tuple[str, ...] = ()

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {
            "projected_tx": self.projected_tx,
            "projected_seq": self.projected_seq,
            "delivered": sorted(self.delivered),
            "pending": list(self.pending),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LiveCheckpoint:
        """The inverse of `as_json`."""
        return cls(
            int(data["projected_tx"]),
            int(data["projected_seq"]),
            frozenset(data["delivered"]),
            tuple(data["pending"]),
        )


@dataclass
class _Held:
    """A sample read by the tail and not yet delivered."""

    entry: IndexEntry
    arrays: Arrays
    advantage: float | None = None  # set once its group is complete
    teacher: np.ndarray | None = None  # the teacher's logprobs, once it scored the sample
    since: float = 0.0  # when the tail read it (the loop's clock)


@dataclass
class _LiveState:
    tx: int
    seq: int
    delivered: set[str]
    held: dict[uuid.UUID, _Held] = field(default_factory=dict)  # in arrival order

    def checkpoint(self) -> LiveCheckpoint:
        return LiveCheckpoint(
            self.tx, self.seq, frozenset(self.delivered), tuple(str(i) for i in self.held)
        )


def _entry(row: asyncpg.Record) -> tuple[IndexEntry, Arrays]:
    tokens, mask, logprobs, versions = decode_arrays(
        row["token_ids"], row["loss_mask"], row["logprobs"], row["version_spans"]
    )
    entry = IndexEntry(
        row["sample_id"],
        row["session_id"],
        row["group_id"],
        row["reward"],
        int(tokens.shape[0]),
        row["policy_version_min"],
    )
    return entry, (tokens, mask, logprobs, versions)


def _release_groups(state: _LiveState, group_size: int | None) -> None:
    """Give an advantage to every held sample whose group is complete (see `replay_live`)."""
    groups: dict[str | None, list[_Held]] = {}
    for held in state.held.values():
        if held.advantage is None:
            groups.setdefault(held.entry.group_id, []).append(held)
    for group_id, members in groups.items():
        if group_id is None:
            for held in members:
                held.advantage = 0.0
            continue
        sessions = [h.entry.session_id for h in members]
        if group_size is not None and len(set(sessions)) < group_size:
            continue  # a session's rows (its lineages) are one member of the group
        rewards = [float(h.entry.reward or 0.0) for h in members]
        for held, advantage in zip(
            members, group_advantages(rewards, [group_id] * len(members), sessions), strict=True
        ):
            held.advantage = advantage


async def replay_live(
    source: str | EventStore,
    selection: Selection | None = None,
    *,
    batch_size: int | None = None,
    token_budget: int | None = None,
    pack: bool = False,
    group_size: int | None = None,
    checkpoint: LiveCheckpoint | None = None,
    redeliver: bool = False,
    poll_interval: float = 0.5,
    idle_timeout: float | None = None,
    read_limit: int = 1000,
    policy_version: Callable[[], int] | None = None,
    max_lag: int | None = None,
    teacher: str | None = None,
    teacher_wait: float = 60.0,
) -> AsyncIterator[tuple[TensorDict, LiveCheckpoint]]:
    """Batches of samples as their sessions finish, each with the checkpoint that follows it.

    Samples are tailed in the order the projector committed them (the event log's rule: never
    past a transaction still in flight), filtered by `selection`. A sample without a reward
    waits: its session is re-projected when the reward arrives. A sample id already delivered
    is not delivered again when its session is re-projected, unless `redeliver=True`.

    Advantages: with `group_size`, a group's samples wait until `group_size` of its sessions
    have arrived, then are normalised together (GRPO; the rows of one session, its lineages with
    `Selection(rollouts=True)`, are one member); without it, the samples of a group that
    arrived in one read are normalised together. Samples without a `group_id` get 0.

    A batch is handed over once full (the planned batches of the held samples, all but a last
    partial one). Save the checkpoint that comes with a batch once it is trained on; pass it
    back to resume. `idle_timeout`: stop after that many seconds with nothing new (None: never).

    Policy lag (`trainer.lag`): `policy_version()` is the trainer's current version, asked as
    each batch is made; batches carry each sample's staleness against it, and with `max_lag` a
    sample whose oldest turn is more than `max_lag` versions behind is dropped (never trained,
    not delivered again, logged), as is one whose version is unknown.

    Distillation (`teacher`): a sample waits for that teacher's score (a scorer following the
    run: `trajstore score --follow`) up to `teacher_wait` seconds, then goes without it
    (`teacher_mask` false, logged), as one whose scoring failed does at once.
    """
    selection = selection or Selection()
    layout = Layout(batch_size, token_budget, pack)
    start = checkpoint or LiveCheckpoint()
    state = _LiveState(start.projected_tx, start.projected_seq, set(start.delivered))
    loop = asyncio.get_running_loop()
    async with open_store(source) as store:
        if start.pending:
            await _reload_pending(store, start.pending, state)
        idle_since = loop.time()
        while True:
            position = (state.tx, state.seq)
            rows = await sample_reads.read_tail(store, selection, position, read_limit)
            for row in rows:
                state.tx, state.seq = int(row["projected_tx"]), int(row["projected_seq"])
                entry, arrays = _entry(row)
                if str(entry.sample_id) in state.delivered and not redeliver:
                    continue
                if entry.reward is None:
                    state.held.pop(entry.sample_id, None)  # an older copy may be held
                    continue
                state.held.pop(entry.sample_id, None)  # re-projected: keep the newest copy
                state.held[entry.sample_id] = _Held(entry, arrays, since=loop.time())
            _release_groups(state, group_size)
            if teacher is not None:
                await _await_teacher(store, state, teacher, loop.time() - teacher_wait)
            current = selection
            if policy_version is not None:
                current = lag.at_version(selection, policy_version())
                lag.drop_stale(state.held, state.delivered, current, max_lag)
            for batch, after in _full_batches(state, layout, current, teacher):
                yield batch, after
            if rows:
                idle_since = loop.time()
                if len(rows) == read_limit:
                    continue
            elif idle_timeout is not None and loop.time() - idle_since >= idle_timeout:
                return
            await asyncio.sleep(poll_interval)


async def _reload_pending(store: EventStore, pending: Sequence[str], state: _LiveState) -> None:
    """Read the samples a checkpoint held back; those gone from the projection are logged."""
    ids = [uuid.UUID(i) for i in pending]
    rows = await sample_reads.read_served(store, ids)
    by_id = {row["sample_id"]: row for row in rows}
    for sample_id in ids:
        row = by_id.get(sample_id)
        if row is None:
            log.warning("live replay: held sample %s left the projection; not delivered", sample_id)
            continue
        entry, arrays = _entry(row)
        if entry.reward is not None:
            state.held[sample_id] = _Held(entry, arrays)


async def _await_teacher(
    store: EventStore, state: _LiveState, teacher: str, expired: float
) -> None:
    """Read the teacher's scores of the held samples that have none yet; a sample still without
    one that was read before `expired` (or whose scoring failed) goes on without it."""
    waiting = {i: h for i, h in state.held.items() if h.teacher is None}
    if not waiting:
        return
    found = await teacher_arrays(store, {i: h.arrays for i, h in waiting.items()}, teacher)
    for sample_id, held in waiting.items():
        if sample_id in found:
            held.teacher = found[sample_id]
        elif held.since < expired:
            log.warning("live replay: no score of teacher %s for %s; trained without", teacher,
                        sample_id)  # fmt: skip
            held.teacher = np.full(held.entry.n_tokens, np.nan, np.float32)


def _full_batches(
    state: _LiveState, layout: Layout, selection: Selection, teacher: str | None = None
) -> Iterator[tuple[TensorDict, LiveCheckpoint]]:
    """The full batches the held samples make, each with the checkpoint right after it.

    Every planned batch but the last is full; the last is full only when padding to a
    `batch_size` it reaches (a packed or budgeted one might take more samples later). With a
    `teacher`, only samples whose score was read (or given up on) are ready.
    """
    ready = [
        h
        for h in state.held.values()
        if h.advantage is not None and (teacher is None or h.teacher is not None)
    ]
    if not ready:
        return
    plan = layout.plan([h.entry.n_tokens for h in ready], [h.entry.sample_id for h in ready])
    last_full = not layout.pack and len(plan[-1]) == layout.batch_size
    for batch_rows in plan if last_full else plan[:-1]:
        rows = []
        for row in batch_rows:
            samples = []
            for i in row:
                held = ready[i]
                assert held.advantage is not None
                samples.append(
                    _sample(held.entry, held.arrays, held.advantage, selection, held.teacher)
                )
                del state.held[held.entry.sample_id]
                state.delivered.add(str(held.entry.sample_id))
            rows.append(samples)
        yield collate(rows), state.checkpoint()
