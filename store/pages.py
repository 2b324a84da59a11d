"""A session's record as JSON, written a piece at a time: what `GET /sessions/{id}` streams.

A coding agent's session runs to thousands of turns, and each turn re-sends the whole context:
an answer that gave every turn's whole prompt grew with the square of the turns (256 MB for a
750-turn opencode session, issue 35) and was built whole in memory before the first byte left.
Here each turn gives what it added to the turn it continues, as the log stores it
(`TurnRecord.as_json`), turns come in pages (`first`, `limit`), and the document is yielded a
few dozen turns at a time, so a reader holds the rebuilt session (what the log stores) plus one
piece of the answer, never the answer.

Each turn also says which conversation of the session it belongs to (`lineage`, `branch`:
`store.lineages`), and the document lists the lineages (role, parent, fork, divergences). Tools,
which an agent re-sends with every request, are given once a page: a turn whose tools are those
of the page's previous turn that gave them says which (`tools_from`) instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson

from trajstore.store.events import RecordedEvent
from trajstore.store.lineages import Forest, assign
from trajstore.store.records import SessionRecord
from trajstore.store.sessions import rebuild_session

#: Turns serialised per piece of the answer: big enough that the joins cost little, small
#: enough that a piece is a few hundred kilobytes for an agent's turns.
TURNS_PER_PIECE = 64


@dataclass(frozen=True)
class Page:
    """Which turns an answer holds: `limit` turns (None: all) from `first`; `whole`: a turn to
    give whole (its `prompt_token_ids` and all its `messages`)."""

    first: int = 0
    limit: int | None = None
    whole: int | None = None

    def end(self, n_turns: int) -> int:
        """Index after the page's last turn."""
        return n_turns if self.limit is None else min(n_turns, self.first + self.limit)


def rebuild_with_lineages(
    session_id: str, events: list[RecordedEvent]
) -> tuple[SessionRecord, Forest]:
    """The session rebuilt from its events, and its lineages (what `session_pieces` needs)."""
    record = rebuild_session(session_id, events)
    return record, assign(record)


def lineages_json(forest: Forest) -> list[dict[str, Any]]:
    """The session's lineages, as the answer lists them."""
    return [
        {
            "lineage": lineage.index,
            "role": lineage.role,
            "parent": lineage.parent,
            "fork_at": lineage.fork_at,
            "n_turns": lineage.n_turns,
            "n_branches": len(lineage.branches),
            "divergences": [b.divergence.as_json() for b in lineage.branches if b.divergence],
        }
        for lineage in forest.lineages
    ]


def branches_of(forest: Forest) -> dict[int, tuple[int, int]]:
    """turn index -> (its lineage, its branch in that lineage), for every placed turn."""
    placed = {}
    for lineage in forest.lineages:
        for number, branch in enumerate(lineage.branches):
            for step in branch.steps:
                placed[step.turn] = (lineage.index, number)
    return placed


def turn_view(
    record: SessionRecord, index: int, placed: dict[int, tuple[int, int]], *, whole: bool = False
) -> dict[str, Any]:
    """Turn `index` as a page shows it: what it added (with `whole`, also its whole prompt and
    messages), its `index`, `lineage` and `branch` (`placed`: `branches_of`), its tools given in
    full (`tools_from` None: a page may name an earlier turn's instead)."""
    view = record.turns[index].as_json(whole=whole)
    view["index"] = index
    view["lineage"], view["branch"] = placed.get(index, (None, None))
    view["tools_from"] = None
    return view


def session_pieces(
    record: SessionRecord,
    page: Page,
    next_url: str | None = None,
    forest: Forest | None = None,
    placed: dict[int, tuple[int, int]] | None = None,
) -> Iterator[bytes]:
    """The session's JSON document in pieces (their concatenation is one JSON object): its
    facts, the page's turns with their lineage, the lineages, and `next` (`next_url`, or null
    when the page reaches the last turn). `forest` and `placed` (`branches_of` it), when the
    caller kept them, make a page cost its own turns."""
    forest = assign(record) if forest is None else forest
    facts = record.as_json(turns=False)
    end = page.end(len(record.turns))
    facts.update(
        n_turns=len(record.turns),
        first_turn=page.first,
        lineages=lineages_json(forest),
        main_lineage=forest.main,  # named by the orchestrator, else found (`store.lineages`)
        next=next_url if end < len(record.turns) else None,
    )
    head = orjson.dumps(facts)
    yield head[:-1] + b',"turns":['
    placed = branches_of(forest) if placed is None else placed
    given: tuple[int, Any] | None = None  # the page's last turn that gave its tools in full
    for start in range(page.first, end, TURNS_PER_PIECE):
        views = []
        for index in range(start, min(start + TURNS_PER_PIECE, end)):
            view = turn_view(record, index, placed, whole=index == page.whole)
            # An agent sends its tools with every request (opencode: tens of KB): given once a
            # page, then `tools_from` names the turn of this page that gave them.
            if view["tools"] is not None:
                if given is not None and view["tools"] == given[1]:
                    view["tools"], view["tools_from"] = None, given[0]
                else:
                    given = (index, view["tools"])
            views.append(orjson.dumps(view))
        yield (b"," if start > page.first else b"") + b",".join(views)
    yield b"]}"
