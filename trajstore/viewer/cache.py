"""Sessions as the viewer shows them: rebuilt once per change of their log, and kept.

A session is read and rebuilt (its turns, samples, timeline and where each turn sits in its
samples) when its log has changed since the last look, so opening turn after turn of a long
session does not read it again.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from trajstore.store.events import RecordedEvent
from trajstore.store.eventstore import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import SessionRecord, TurnRecord, rebuild_session
from trajstore.store.timeline import Entry, timeline
from trajstore.viewer import queries
from trajstore.viewer.errors import PageNotFound
from trajstore.viewer.lineages import LineageTree, lineage_tree
from trajstore.viewer.strip import TurnSpan, turn_spans

Head = tuple[int, int]  #: (events, last position): the log of a session changed when this did

#: Lineages a session's page lists (the main lineage's tree first); the rest are counted.
LINEAGES_SHOWN = 50


@dataclass
class SessionView:
    """A session rebuilt from its log, with its samples and where each turn sits in them."""

    session: SessionRecord
    head: Head
    samples: list[Sample]
    entries: list[Entry]
    spans: dict[int, TurnSpan] = field(default_factory=dict)  #: turn -> its part of its branch
    alternatives: dict[int, list[TurnSpan]] = field(default_factory=dict)  #: other choices
    branch_of: dict[int, Sample] = field(default_factory=dict)  #: turn -> its branch
    starts: dict[int, Sample] = field(default_factory=dict)  #: turn -> the branch it diverged to
    lineages: LineageTree | None = None  #: the tree the page shows (`viewer.lineages`)

    @classmethod
    def build(cls, session_id: str, events: list[RecordedEvent], head: Head) -> SessionView:
        """Rebuild the session and its samples from its events (`trajstore.store.samples`)."""
        session = rebuild_session(session_id, events)
        view = cls(session, head, build_samples(session), timeline(session, events))
        for sample in view.samples:
            for span in turn_spans(sample):
                if sample.alternative_of is None:
                    view.spans[span.turn] = span
                    view.branch_of[span.turn] = sample
                else:
                    view.alternatives.setdefault(span.turn, []).append(span)
            if sample.divergence is not None and sample.alternative_of is None:
                view.starts[sample.divergence.turn] = sample
        view.lineages = lineage_tree(view.samples, len(session.turns), LINEAGES_SHOWN)
        return view

    def turn(self, index: int) -> TurnRecord:
        """The turn with this index; `PageNotFound` when there is none."""
        if not 0 <= index < len(self.session.turns):
            raise PageNotFound(f"session {self.session.session_id!r} has no turn {index}")
        return self.session.turns[index]


class SessionCache:
    """The last few sessions looked at, each kept until its log changes."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._views: collections.OrderedDict[str, SessionView] = collections.OrderedDict()

    def clear(self) -> None:
        """Forget every session (the next look reads and rebuilds it again)."""
        self._views.clear()

    async def get(self, store: EventStore, session_id: str) -> SessionView:
        """The session as its log stands now; `PageNotFound` when it has no events."""
        head = await session_head(store, session_id)
        if head[0] == 0:
            raise PageNotFound(f"no session {session_id!r} in the store")
        cached = self._views.get(session_id)
        if cached is not None and cached.head == head:
            self._views.move_to_end(session_id)
            return cached
        events = await store.read_session(session_id)
        # The head again from these very events, so the view never claims a newer head.
        view = SessionView.build(session_id, events, (len(events), max(e.position for e in events)))
        self._views[session_id] = view
        while len(self._views) > self.size:
            self._views.popitem(last=False)
        return view


async def session_head(store: EventStore, session_id: str) -> Head:
    """How many events the session has and its last position."""
    row = await store.fetchrow(queries.SESSION_HEAD, session_id)
    assert row is not None  # an aggregate: always one row
    return int(row["n_events"]), int(row["last_position"])
