"""GRPO advantages: each sample's reward compared with the other samples of its group.

A group is the samples sharing a `group_id` (the rollouts of one prompt). The advantage is
`(reward - mean) / (std + eps)` over the group's selected samples, with the population standard
deviation. It is 0 when there is nothing to compare with: a group of one sample (or a sample
with no `group_id`, which is a group of its own), or a group whose rewards are all equal
(compared exactly: the float mean of equal rewards can leave a std a hair above 0), since such a
group says nothing about which completion was better.

A group member is one rollout (one session). When a rollout gives several rows (every lineage of
a session: its main loop, its sub-agents, its side calls; `Selection(rollouts=True)`), the rows
share the session's reward and one advantage, and the group's mean and deviation count the
session once, not once per row: a rollout that spawned more sub-agents does not weigh more in
its group's baseline.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: Keeps the division finite for nearly-equal rewards; small against any reward scale in use.
EPS = 1e-6


def group_advantages(
    rewards: Sequence[float],
    group_ids: Sequence[str | None],
    members: Sequence[str] | None = None,
) -> list[float]:
    """The GRPO advantage of each sample, in the order given (see the module docstring).

    `members`: each sample's rollout (its session id); samples of one member count once and get
    one advantage (the first one's reward stands for the member). None: each sample is a member.
    Vectorised over groups (a selection can hold a hundred thousand of them); values are rounded
    to float32, the precision of the batch tensors.
    """
    if members is not None:
        first: dict[str, int] = {}
        for i, rollout in enumerate(members):
            first.setdefault(rollout, i)
        unique = list(first.values())
        per_member = group_advantages([rewards[i] for i in unique], [group_ids[i] for i in unique])
        of = dict(zip(first, per_member, strict=True))
        return [of[rollout] for rollout in members]
    numbers: dict[str, int] = {}
    group = np.fromiter(
        (-1 if g is None else numbers.setdefault(g, len(numbers)) for g in group_ids),
        np.int64,
        len(group_ids),
    )
    values = np.asarray(rewards, dtype=np.float64)
    advantages = np.zeros(len(values), np.float64)
    member = group >= 0
    if not member.any():
        return advantages.tolist()
    g, x = group[member], values[member]
    count = np.bincount(g, minlength=len(numbers))
    mean = np.bincount(g, weights=x, minlength=len(numbers)) / count
    centred = x - mean[g]
    std = np.sqrt(np.bincount(g, weights=centred * centred, minlength=len(numbers)) / count)
    # "All equal" is decided exactly (lowest == highest), not by a rounded std.
    lowest = np.full(len(numbers), np.inf)
    highest = np.full(len(numbers), -np.inf)
    np.minimum.at(lowest, g, x)
    np.maximum.at(highest, g, x)
    informative = (count >= 2) & (highest > lowest)
    advantages[member] = np.where(informative[g], centred / (std[g] + EPS), 0.0)
    return advantages.astype(np.float32).astype(np.float64).tolist()
