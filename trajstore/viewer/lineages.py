"""A session's lineages as the page shows them: a tree (which conversation forked from which),
and a strip each, showing when in the session that conversation spoke.

A session is several conversations (`store.lineages`): the main loop, sub-agents, side calls.
The tree is laid out depth first, iteratively (a chain of forks thousands deep is a list, not a
recursion), and shown a bounded number of rows at a time: a session used as a plain endpoint
holds thousands of one-call lineages, and its page must stay small. A strip is drawn over
`STRIP_CELLS` cells of the session's turns, so it costs the same at 10 or 10,000 turns.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from trajstore.store.lineages import Divergence
from trajstore.store.samples import Sample

#: Cells a lineage's strip divides the session's turns into.
STRIP_CELLS = 400


@dataclass
class LineageRow:
    """One lineage, where the tree puts it, and what its strip draws."""

    lineage: int
    role: str
    parent: int | None
    fork_at: int | None
    depth: int = 0
    turns: list[int] = field(default_factory=list)  #: its turns, in order (all branches)
    samples: list[Sample] = field(default_factory=list)  #: its branches and alternatives
    #: (left, width) in percent of the session's turns: where it spoke
    segments: list[tuple[float, float]] = field(default_factory=list)
    #: (left in percent, what) for each divergence in it
    marks: list[tuple[float, str]] = field(default_factory=list)


@dataclass
class LineageTree:
    """The rows shown, in tree order, and how many lineages were left out, by role."""

    rows: list[LineageRow]
    hidden: dict[str, int]
    total: int


def lineage_tree(samples: list[Sample], n_turns: int, limit: int) -> LineageTree:
    """The session's lineages from its samples, as a tree in depth-first order; at most `limit`
    rows (the main lineage's tree first), the rest counted by role."""
    rows: dict[int, LineageRow] = {}
    for sample in samples:
        row = rows.get(sample.lineage)
        if row is None:
            row = rows[sample.lineage] = LineageRow(
                sample.lineage, sample.role, sample.parent, sample.fork_at
            )
        row.samples.append(sample)
        if sample.alternative_of is None:
            row.turns += sample.turns
        if sample.divergence is not None:
            row.marks.append(_mark(sample.divergence, n_turns))
    children: dict[int | None, list[LineageRow]] = {}
    for row in rows.values():
        parent = row.parent if row.parent in rows else None
        children.setdefault(parent, []).append(row)
    roots = sorted(children.get(None, []), key=lambda r: (r.role != "main", r.lineage))
    ordered: list[LineageRow] = []
    stack = [(root, 0) for root in reversed(roots)]
    while stack:  # depth first, without recursion
        row, depth = stack.pop()
        row.depth = depth
        ordered.append(row)
        below = sorted(children.get(row.lineage, []), key=lambda r: r.lineage)
        stack += [(child, depth + 1) for child in reversed(below)]
    shown = ordered[:limit]
    for row in shown:
        row.segments = _segments(row.turns, n_turns)
    hidden = Counter(row.role for row in ordered[limit:])
    return LineageTree(shown, dict(hidden), len(ordered))


def _segments(turns: list[int], n_turns: int) -> list[tuple[float, float]]:
    """Runs of strip cells holding at least one of the turns, as (left, width) percentages."""
    cells = max(1, min(n_turns, STRIP_CELLS))
    filled = sorted({turn * cells // max(n_turns, 1) for turn in turns})
    runs: list[list[int]] = []
    for cell in filled:
        if runs and runs[-1][1] == cell:
            runs[-1][1] = cell + 1
        else:
            runs.append([cell, cell + 1])
    return [(100 * lo / cells, 100 * (hi - lo) / cells) for lo, hi in runs]


def _mark(divergence: Divergence, n_turns: int) -> tuple[float, str]:
    where = 100 * divergence.turn / max(n_turns, 1)
    return where, f"turn {divergence.turn}, position {divergence.position}: {divergence.reason}"
