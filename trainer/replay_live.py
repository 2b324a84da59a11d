"""Replay samples as their sessions finish, for asynchronous RL (`replay_live`): the tail of
the projection, filtered by a selection, handed over batch by batch with a checkpoint to resume.

A sample without a reward waits (a reward that arrives after the finish re-projects the
session, and the tail sees the sample again); a group waits for its members (`group_size`); a
teacher's score is waited for up to `teacher_wait`. The order and the batches' layout are
`trainer.replay`'s; what waits is this module's.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import numpy as np
from tensordict import TensorDict

from trajstore.store import EventStore, sample_reads
from trajstore.trainer import lag
from trajstore.trainer.advantages import group_advantages
from trajstore.trainer.arrays import Arrays, decode_arrays
from trajstore.trainer.collate import Layout, collate
from trajstore.trainer.index import IndexEntry, open_store, skipped_entry
from trajstore.trainer.replay import replay_sample, routed_arrays, teacher_arrays
from trajstore.trainer.selection import Selection

log = logging.getLogger(__name__)


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
    version: int = 0  # the projection version it was read from
    routed: np.ndarray | None = None  # its recorded routing, with `routing`, once read
    routing_read: bool = False


@dataclass
class _LiveState:
    tx: int
    seq: int
    delivered: set[str]
    held: dict[uuid.UUID, _Held] = field(default_factory=dict)  # in arrival order
    skipped: list[dict[str, Any]] = field(default_factory=list)  # told with the next batch

    def checkpoint(self) -> LiveCheckpoint:
        return LiveCheckpoint(
            self.tx, self.seq, frozenset(self.delivered), tuple(str(i) for i in self.held)
        )


def _held(row: asyncpg.Record, since: float = 0.0) -> _Held:
    """A tail (or served) row as the replay holds it: its index entry, its decoded arrays."""
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
    return _Held(entry, (tokens, mask, logprobs, versions), since=since,
                 version=int(row["projection_version"]))  # fmt: skip


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
    max_sample_tokens: int | None = None,
    routing: bool = False,
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

    `max_sample_tokens` and `routing` are `replay`'s: a longer sample is skipped whole (never
    delivered, named in the next batch's `skipped`), and one within the limit but over
    `token_budget` gets a row or batch of its own; with `routing`, batches carry the routed
    experts the engine recorded (`routed_experts`).
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
                held = _held(row, since=loop.time())
                entry = held.entry
                if str(entry.sample_id) in state.delivered and not redeliver:
                    continue
                if entry.reward is None:
                    state.held.pop(entry.sample_id, None)  # an older copy may be held
                    continue
                # Projected again (another fact about its session came): keep the newest copy.
                # If its group was released already, the copy keeps that advantage: its
                # group-mates have theirs (some may be delivered), so the group cannot be
                # released again, and the copy would wait for it forever.
                earlier = state.held.pop(entry.sample_id, None)
                if earlier is not None:
                    held.advantage = earlier.advantage
                if max_sample_tokens is not None and entry.n_tokens > max_sample_tokens:
                    state.skipped.append(skipped_entry(entry, max_sample_tokens))
                    state.delivered.add(str(entry.sample_id))  # never trained, never again
                    continue
                state.held[entry.sample_id] = held
            _release_groups(state, group_size)
            if teacher is not None:
                await _await_teacher(store, state, teacher, loop.time() - teacher_wait)
            if routing:
                await _read_routing(store, state)
            current = selection
            if policy_version is not None:
                current = lag.at_version(selection, policy_version())
                lag.drop_stale(state.held, state.delivered, current, max_lag)
            long_alone = max_sample_tokens is not None
            for batch, after in _full_batches(state, layout, current, teacher, long_alone):
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
        held = _held(row)
        if held.entry.reward is not None:
            state.held[sample_id] = held


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


async def _read_routing(store: EventStore, state: _LiveState) -> None:
    """Read the recorded routing of the held samples not yet asked for (`routed_arrays`)."""
    unread: dict[int, list[_Held]] = {}
    for held in state.held.values():
        if not held.routing_read:
            unread.setdefault(held.version, []).append(held)
    for version, members in unread.items():
        found = await routed_arrays(store, version, [h.entry.sample_id for h in members])
        for held in members:
            held.routed, held.routing_read = found.get(held.entry.sample_id), True


def _full_batches(
    state: _LiveState,
    layout: Layout,
    selection: Selection,
    teacher: str | None = None,
    long_alone: bool = False,
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
    plan = layout.plan(
        [h.entry.n_tokens for h in ready], [h.entry.sample_id for h in ready], long_alone=long_alone
    )
    last_full = not layout.pack and len(plan[-1]) == layout.batch_size
    for batch_rows in plan if last_full else plan[:-1]:
        rows = []
        for row in batch_rows:
            samples = []
            for i in row:
                held = ready[i]
                assert held.advantage is not None
                samples.append(replay_sample(held.entry, held.arrays, held.advantage, selection,
                                             held.teacher, held.routed))  # fmt: skip
                del state.held[held.entry.sample_id]
                state.delivered.add(str(held.entry.sample_id))
            rows.append(samples)
        batch = collate(rows)
        if state.skipped:  # told once, with the next batch
            batch.set_non_tensor("skipped", state.skipped)
            state.skipped = []
        yield batch, state.checkpoint()
