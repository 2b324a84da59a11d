"""On-policy distillation: a teacher's per-token logprobs of the student's own samples as dense
credit, alone or mixed with GRPO.

The teacher scored each generated token x_t of a recorded sample (`trajstore score`:
`store.side_data`); the student's per-token reverse KL on its sampled tokens is

    kl_t = log pi_student(x_t | x_<t) - log pi_teacher(x_t | x_<t)

and its sum over a sample estimates KL(pi_student || pi_teacher) on the student's own
trajectories. Minimising it by the score function makes -kl_t a per-token advantage: the
loss keeps `trainer.loss`'s clipped, importance-weighted surrogate and only changes the
advantage each token gets,

    A_t = grpo * A_session + coef * (log pi_teacher(x_t) - log pi_student(x_t))   (detached)

`grpo = 0` is distillation alone; `coef = 0` is GRPO alone. Tokens the teacher did not score
(`teacher_mask` false: a sample scored by no one, a failed score) get the GRPO term only.
The student's logprob is the current policy's, so the credit follows the student as it moves
(what "on-policy" distillation means: peers' recipes do the same).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from tensordict import TensorDict

from trajstore.store.errors import BadEvent
from trajstore.store.eventstore import EventStore
from trajstore.store.side_data import LOGPROBS, TEACHER_LOGPROBS, aligned_score, read_sample_facts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    """Which teacher's scores to learn from, and how much of each signal."""

    teacher: str  #: the teacher's name (`trajstore score --teacher`)
    coef: float = 1.0  #: weight of the per-token teacher advantage
    grpo: float = 1.0  #: weight of the session's GRPO advantage (0: distillation alone)


def with_distillation(
    tensors: TensorDict, logprobs: torch.Tensor, config: DistillConfig
) -> tuple[TensorDict, dict[str, torch.Tensor]]:
    """The rows with each token's advantage as the module docstring mixes it, and metrics:
    `reverse_kl` (mean kl_t over the teacher-scored tokens, current policy), `teacher_tokens`
    (how many); 0-d tensors on the batch's device, read once a step by the learner."""
    teacher = tensors["teacher_logprobs"]
    scored = tensors["teacher_mask"] & tensors["loss_mask"]
    student = logprobs.detach()
    kl = torch.where(scored, student - teacher.nan_to_num(0.0), torch.zeros_like(student))
    copy = tensors.clone(recurse=False)
    copy["advantages"] = config.grpo * tensors["advantages"] - config.coef * kl
    n = scored.sum()
    return copy, {
        "reverse_kl": kl.sum() / n.clamp(min=1),
        "teacher_tokens": n.float(),
    }


async def read_teacher_logprobs(
    store: EventStore,
    token_ids: Mapping[uuid.UUID, npt.NDArray[Any]],
    loss_masks: Mapping[uuid.UUID, npt.NDArray[Any]],
    teacher: str,
) -> dict[uuid.UUID, npt.NDArray[np.float32]]:
    """The latest logprobs `teacher` recorded for these samples, aligned with their tokens (NaN
    where absent); samples it has not scored (or failed to) are left out, a failure logged."""
    facts = await read_sample_facts(store, list(token_ids))
    found: dict[uuid.UUID, npt.NDArray[np.float32]] = {}
    for sample_id, sample_facts in facts.items():
        for payload, data in sample_facts.scores:
            if payload.kind != TEACHER_LOGPROBS or payload.source != teacher:
                continue
            try:
                side = aligned_score(
                    payload, data, np.ascontiguousarray(token_ids[sample_id], "<i4").tobytes(),
                    loss_masks[sample_id],
                )  # fmt: skip
            except BadEvent as exc:
                log.warning("teacher %s: sample %s: %s", teacher, sample_id, exc)
                continue
            found[sample_id] = side.arrays[LOGPROBS].astype(np.float32, copy=False)
        for failure in sample_facts.failures:
            if failure.source == teacher and sample_id not in found:
                log.warning(
                    "teacher %s could not score sample %s (%s): trained without its logprobs",
                    teacher, sample_id, failure.reason,
                )  # fmt: skip
    return found


def unscored(ids: Sequence[uuid.UUID], found: Mapping[uuid.UUID, Any]) -> list[uuid.UUID]:
    """The ids without a teacher score."""
    return [i for i in ids if i not in found]
