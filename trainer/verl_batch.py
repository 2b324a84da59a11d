"""Recorded samples as verl's training batch: a `verl.DataProto` laid out as verl lays a rollout.

verl (https://github.com/volcengine/verl) trains on what its `AgentLoopWorker` makes of a rollout:
one row per trajectory, the prompt left-padded to one width and the response right-padded to
another. This module lays trajstore's samples out the same way, so a recorded run can go through
verl's advantage estimators and policy losses (`verl.trainer.ppo.core_algos`) like a rollout
verl made itself:

    prompts             int64    [rows, P]    tokens before the sample's first generated token,
                                              left-padded with `pad_token_id`
    responses           int64    [rows, R]    the rest (the model's tokens, and the tool results
                                              and user messages between them), right-padded
    response_mask       int64    [rows, R]    1 on tokens the model generated and that carry a
                                              behaviour logprob, 0 on tool/user tokens and padding
    input_ids           int64    [rows, P+R]  prompts then responses
    attention_mask      int64    [rows, P+R]  1 on real tokens, 0 on padding
    position_ids        int64    [rows, P+R]  verl's `compute_position_id_with_mask`
    rollout_log_probs   float32  [rows, R]    the behaviour logprobs as recorded (0 where the
                                              mask is 0)
    teacher_log_probs   float32  [rows, R]    a teacher's logprobs (`verl_batches(teacher=...)`,
                                              `trainer.distill`; 0 where teacher_mask is 0)
    teacher_mask        int64    [rows, R]    1 on response_mask tokens the teacher scored
    rm_scores           float32  [rows, R]    the session's reward on the last response token
    token_level_scores  float32  [rows, R]    the same (what verl's reward step writes)
    token_level_rewards float32  [rows, R]    the same (verl's name after its optional KL term)
    advantages          float32  [rows, R]    trajstore's GRPO advantage of the row's rollout
                                              (`trainer.advantages`) on each response_mask token
    returns             float32  [rows, R]    the same (what verl's GRPO estimator writes)

and, per row in `non_tensor_batch` (numpy arrays): `uid` (the GRPO group: the session's
`group_id`, else its session id), `sample_id`, `session_id`, `policy_version` (the oldest
policy version of the sample's turns, -1 unknown) and `staleness` (`Selection
.current_policy_version` minus it, -1 unknown). `meta_info["trajstore"]` says which projection
version and selection the batch was read from and how many generated tokens were left out of the
mask for lack of a behaviour logprob.

A session of several conversations (`Selection(rollouts=True)`: its main loop, sub-agents and
side calls, each a row) is ONE member of its GRPO group: its rows share the session's reward and
the one `advantages` computed over the group's sessions. verl's own estimator
(`compute_grpo_outcome_advantage`) counts rows, so it would weigh a session by its number of
lineages: with rollouts, train on the batch's `advantages` (skip verl's advantage step) rather
than re-estimating them. With one row per session the two agree up to the standard deviation's
definition (trajstore: population; verl: unbiased).

A generated token whose behaviour logprob the engine did not report (NaN in the store: a turn
under a grammar, see `store.samples`) gets response_mask 0 here: verl has no NaN handling, and
an importance ratio against no logprob means nothing. `trainer.loss` leaves those tokens out the
same way.

Deterministic: samples are ordered by id, then shuffled with `numpy.random.default_rng(seed)`
(`trainer.index.shuffled`), and the same rows always give the same tensors.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask

from trajstore.store import EventStore
from trajstore.trainer.arrays import read_arrays
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.index import IndexEntry, open_store, read_ordered
from trajstore.trainer.replay import teacher_arrays
from trajstore.trainer.selection import Selection

#: The tensors of a batch, in the order they are laid out.
TENSOR_FIELDS = (
    "prompts",
    "responses",
    "response_mask",
    "input_ids",
    "attention_mask",
    "position_ids",
    "rollout_log_probs",
    "teacher_log_probs",
    "teacher_mask",
    "rm_scores",
    "token_level_scores",
    "token_level_rewards",
    "advantages",
    "returns",
)


@dataclass(frozen=True)
class SplitSample:
    """One sample cut where verl cuts a rollout: prompt, then response."""

    prompt_ids: npt.NDArray[np.int64]
    response_ids: npt.NDArray[np.int64]
    response_mask: npt.NDArray[np.int64]  #: 1: generated, with a behaviour logprob
    response_logprobs: npt.NDArray[np.float32]  #: 0.0 where the mask is 0
    missing_logprobs: int  #: generated tokens left out of the mask for lack of a logprob


def split_sample(
    token_ids: npt.NDArray[Any], loss_mask: npt.NDArray[Any], logprobs: npt.NDArray[Any]
) -> SplitSample:
    """A sample's arrays (as stored: token ids, loss mask, behaviour logprobs) as prompt and
    response: the prompt is every token before the first generated one (loss mask 1)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    mask = np.asarray(loss_mask).astype(np.int64)
    probs = np.asarray(logprobs, dtype=np.float32)
    if not tokens.shape == mask.shape == probs.shape:
        raise ValueError(
            f"token ids, loss mask and logprobs differ in length: "
            f"{tokens.shape}, {mask.shape}, {probs.shape}"
        )
    generated = np.flatnonzero(mask)
    start = int(generated[0]) if generated.size else int(tokens.shape[0])
    response_mask = mask[start:].copy()
    response_logprobs = probs[start:].copy()
    missing = (response_mask == 1) & ~np.isfinite(response_logprobs)
    response_mask[missing] = 0
    response_logprobs[response_mask == 0] = 0.0
    return SplitSample(
        tokens[:start].copy(),
        tokens[start:].copy(),
        response_mask,
        response_logprobs,
        int(missing.sum()),
    )


@dataclass(frozen=True)
class VerlRow:
    """A split sample and what a batch says about it."""

    sample: SplitSample
    reward: float
    uid: str
    sample_id: str
    session_id: str
    policy_version: int  #: -1: unknown
    staleness: int  #: -1: unknown
    advantage: float = 0.0  #: the GRPO advantage of the row's rollout (its session)
    #: The policy version that generated each of the sample's tokens (-1: prompt, glue, unknown)
    token_versions: Any = None
    #: A teacher's logprobs of the whole sample (NaN where absent), when one was asked for.
    teacher: npt.NDArray[np.float32] | None = None


def collate_verl(
    rows: Sequence[VerlRow],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
    meta_info: dict[str, Any] | None = None,
) -> DataProto:
    """One `DataProto` (layout: the module docstring), padded as `AgentLoopWorker` pads.

    The widths are `prompt_length` and `response_length` (verl's `rollout.prompt_length` and
    `rollout.response_length`, for fixed shapes across batches), or the longest of the batch.
    A sample longer than a fixed width is refused: cutting a recorded sample would train on
    something other than what was recorded.
    """
    if not rows:
        raise BadSelection("no samples to put in a batch")
    longest_prompt = max(len(r.sample.prompt_ids) for r in rows)
    longest_response = max(len(r.sample.response_ids) for r in rows)
    width_p = longest_prompt if prompt_length is None else prompt_length
    width_r = longest_response if response_length is None else response_length
    for row in rows:
        p, r = len(row.sample.prompt_ids), len(row.sample.response_ids)
        if p > width_p or r > width_r:
            raise BadSelection(
                f"sample {row.sample_id} has a prompt of {p} and a response of {r} tokens, more "
                f"than prompt_length={width_p} / response_length={width_r}; raise them or "
                "select shorter samples"
            )
    n = len(rows)
    prompts = np.full((n, width_p), pad_token_id, dtype=np.int64)
    responses = np.full((n, width_r), pad_token_id, dtype=np.int64)
    response_mask = np.zeros((n, width_r), dtype=np.int64)
    attention_mask = np.zeros((n, width_p + width_r), dtype=np.int64)
    rollout_log_probs = np.zeros((n, width_r), dtype=np.float32)
    teacher_log_probs = np.zeros((n, width_r), dtype=np.float32)
    teacher_mask = np.zeros((n, width_r), dtype=np.int64)
    for i, row in enumerate(rows):
        s = row.sample
        p, r = len(s.prompt_ids), len(s.response_ids)
        prompts[i, width_p - p :] = s.prompt_ids
        responses[i, :r] = s.response_ids
        response_mask[i, :r] = s.response_mask
        rollout_log_probs[i, :r] = s.response_logprobs
        if row.teacher is not None:
            teacher = row.teacher[p:]
            scored = np.isfinite(teacher) & (s.response_mask == 1)
            teacher_mask[i, :r] = scored
            teacher_log_probs[i, :r] = np.where(scored, teacher, 0.0)
        attention_mask[i, width_p - p : width_p + r] = 1
    attention = torch.from_numpy(attention_mask)
    # As AgentLoopWorker._postprocess: the reward on the last response token (the last column
    # when the response is empty).
    last = attention[:, width_p:].sum(dim=1) - 1
    scores = torch.zeros((n, width_r), dtype=torch.float32)
    scores[torch.arange(n), last] = torch.tensor([r.reward for r in rows], dtype=torch.float32)
    prompts_t, responses_t = torch.from_numpy(prompts), torch.from_numpy(responses)
    advantages = torch.tensor([r.advantage for r in rows], dtype=torch.float32)[:, None] * (
        torch.from_numpy(response_mask).to(torch.float32)
    )
    tensors = {
        "prompts": prompts_t,
        "responses": responses_t,
        "response_mask": torch.from_numpy(response_mask),
        "input_ids": torch.cat([prompts_t, responses_t], dim=1),
        "attention_mask": attention,
        "position_ids": compute_position_id_with_mask(attention),
        "rollout_log_probs": torch.from_numpy(rollout_log_probs),
        "teacher_log_probs": torch.from_numpy(teacher_log_probs),
        "teacher_mask": torch.from_numpy(teacher_mask),
        "rm_scores": scores,
        "token_level_scores": scores.clone(),
        "token_level_rewards": scores.clone(),
        "advantages": advantages,
        "returns": advantages.clone(),
    }
    non_tensors = {
        "uid": np.array([r.uid for r in rows], dtype=object),
        "sample_id": np.array([r.sample_id for r in rows], dtype=object),
        "session_id": np.array([r.session_id for r in rows], dtype=object),
        "policy_version": np.array([r.policy_version for r in rows], dtype=np.int64),
        "staleness": np.array([r.staleness for r in rows], dtype=np.int64),
        # Per row, aligned with the sample's own tokens (prompt then response, unpadded).
        "token_versions": _objects(
            [None if r.token_versions is None else r.token_versions.tolist() for r in rows]
        ),
    }
    info = dict(meta_info or {})
    trajstore = dict(info.get("trajstore") or {})
    trajstore["missing_behaviour_tokens"] = sum(r.sample.missing_logprobs for r in rows)
    info["trajstore"] = trajstore
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=info)


def _row(
    entry: IndexEntry,
    arrays: tuple[Any, Any, Any, Any],
    selection: Selection,
    advantage: float,
    teacher: npt.NDArray[np.float32] | None = None,
) -> VerlRow:
    assert entry.reward is not None
    return VerlRow(
        split_sample(*arrays[:3]),
        float(entry.reward),
        entry.group_id if entry.group_id is not None else entry.session_id,
        str(entry.sample_id),
        entry.session_id,
        *selection.versions(entry.policy_version_min),
        advantage,
        arrays[3],
        teacher,
    )


async def verl_batches(
    source: str | EventStore,
    selection: Selection | None = None,
    *,
    batch_size: int | None = None,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    teacher: str | None = None,
) -> AsyncIterator[DataProto]:
    """The selected samples as `DataProto` batches of `batch_size` rows (None: one batch).

    `source` is a database URL or an open `EventStore`. The order is `trainer.replay`'s (by id,
    then a permutation seeded by `seed`); arrays are read one batch at a time. Every selected
    sample needs a reward (a GRPO/PPO update has nothing to learn from without one). With
    `teacher`, rows carry its logprobs (`teacher_log_probs`, `teacher_mask`).
    """
    selection = selection or Selection()
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise BadSelection(f"batch_size must be a positive integer, got {batch_size!r}")
    async with open_store(source) as store:
        index = await read_ordered(store, selection, seed=seed, shuffle=shuffle)
        if index is None:
            return
        version, ordered, advantage_of = index
        size = batch_size or len(ordered)
        meta = {"trajstore": {"projection_version": version, "selection": selection.as_json()}}
        for start in range(0, len(ordered), size):
            chunk = ordered[start : start + size]
            ids: list[uuid.UUID] = [e.sample_id for e in chunk]
            arrays = await read_arrays(store, version, ids)
            teachers = await teacher_arrays(store, arrays, teacher)
            yield collate_verl(
                [
                    _row(
                        e,
                        arrays[e.sample_id],
                        selection,
                        advantage_of[e.sample_id],
                        teachers.get(e.sample_id),
                    )
                    for e in chunk
                ],
                prompt_length=prompt_length,
                response_length=response_length,
                pad_token_id=pad_token_id,
                meta_info=meta,
            )


async def verl_batch(
    source: str | EventStore, selection: Selection | None = None, **options: Any
) -> DataProto | None:
    """The whole selection as one `DataProto` (None when it selects nothing); the options are
    `verl_batches`' (but `batch_size`)."""
    async for batch in verl_batches(source, selection, batch_size=None, **options):
        return batch
    return None


def _objects(values: Sequence[Any]) -> np.ndarray:
    """An object array of per-row lists (their lengths differ), as verl's non-tensors hold."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out
