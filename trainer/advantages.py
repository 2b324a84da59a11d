"""GRPO advantages: each sample's reward compared with the other samples of its group.

A group is the samples sharing a `group_id` (the rollouts of one prompt). The advantage is
`(reward - mean) / (std + eps)` over the group's selected samples, with the population standard
deviation. It is 0 when there is nothing to compare with: a group of one sample (or a sample
with no `group_id`, which is a group of its own), or a group whose rewards are all equal
(std 0), since such a group says nothing about which completion was better.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

#: Keeps the division finite for nearly-equal rewards; small against any reward scale in use.
EPS = 1e-6


def group_advantages(rewards: Sequence[float], group_ids: Sequence[str | None]) -> list[float]:
    """The GRPO advantage of each sample, in the order given (see the module docstring)."""
    members: dict[str, list[int]] = defaultdict(list)
    for index, group in enumerate(group_ids):
        if group is not None:
            members[group].append(index)
    advantages = [0.0] * len(rewards)
    for indices in members.values():
        if len(indices) < 2:
            continue
        values = np.array([rewards[i] for i in indices], dtype=np.float64)
        std = float(values.std())
        if std == 0.0:
            continue
        normalised = (values - values.mean()) / (std + EPS)
        for i, value in zip(indices, normalised, strict=True):
            advantages[i] = float(np.float32(value))
    return advantages
