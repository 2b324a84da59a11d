"""A session's history: what happened, in order, and its state as of any point of the log.

Time travel needs no snapshot: the log is the truth, so the state "as of position P" is the fold
of every event up to P. "Up to P" means the log's global order, `(tx_id, position)`, not the bare
position: a transaction that started earlier may commit a smaller position after P was written
(see `store.queries.READ_ALL`). As of P we therefore keep the events ordered at or before the event
at P, which is exactly what a reader whose checkpoint is P had seen. P must be the position of an
event (any session's); the timeline prints every event's position to pick from. Unlike the
projector, time travel does not wait below the horizon: a transaction older than P's that is still
open may yet add events before P, so the answer for P is final once those have ended (at once, in
practice: writers keep transactions short).

- `session_as_of`: the session as `store.sessions.rebuild_session` makes it, from its events up
  to P (or all of them).
- `samples_as_of`: what the samples projection holds for the log up to P: the samples of each
  session finished by P, built from that session's events up to P (a reward assigned after P is
  not there yet).
- `timeline`: a session's events turned into entries people read (requests, tool results,
  completions, rewards, failures, timings), the data behind `trajstore replay session`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trajstore.store import queries
from trajstore.store.connection import unavailable_as_store_error
from trajstore.store.errors import SessionNotFound
from trajstore.store.events import EventType, RecordedEvent, request_stream
from trajstore.store.eventstore import EventStore
from trajstore.store.payloads import upcast
from trajstore.store.payloads_request import ImageRecorded
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import SessionRecord, TurnRecord, rebuild_session

LogPoint = tuple[int, int]  #: (tx_id, position): a place in the log's global order


async def log_point(store: EventStore, position: int) -> LogPoint:
    """The place in the log's order of the event at `position` (`BadEvent` if there is none)."""
    async with unavailable_as_store_error(), store.pool.acquire() as conn:
        return await queries.tx_id_of(conn, position), position


def up_to(events: list[RecordedEvent], point: LogPoint | None) -> list[RecordedEvent]:
    """The events (in log order) at or before `point`; all of them when `point` is None."""
    if point is None:
        return events
    return [e for e in events if (e.tx_id, e.position) <= point]


async def session_events(
    store: EventStore, session_id: str, as_of: int | None = None
) -> list[RecordedEvent]:
    """A session's events in log order, up to the event at position `as_of` (None: all).

    Raises `SessionNotFound` when there are none, so a typo never reads as an empty session.
    """
    point = None if as_of is None else await log_point(store, as_of)
    events = up_to(await store.read_session(session_id), point)
    if not events:
        when = "" if as_of is None else f" as of position {as_of}"
        raise SessionNotFound(f"no session {session_id!r} in the store{when}")
    return events


async def session_as_of(
    store: EventStore, session_id: str, as_of: int | None = None
) -> SessionRecord:
    """The session as it stood once the log reached position `as_of` (None: now)."""
    return rebuild_session(session_id, await session_events(store, session_id, as_of))


async def sessions_with_facts_up_to(store: EventStore, point: LogPoint) -> list[str]:
    """Sessions with a finish, discard or reward at or before `point`, in order of first fact."""
    async with unavailable_as_store_error():
        rows = await store.pool.fetch(queries.SESSIONS_WITH_FACTS_UP_TO, point[0], point[1])
    return [row["session_id"] for row in rows]


async def samples_as_of(store: EventStore, as_of: int) -> list[Sample]:
    """The samples the projection held once it had read the log up to position `as_of`.

    The same rules as `store.projection.Projector`: a session has samples once it is finished and
    not discarded; they are built from its events up to `as_of`. Sessions come in the order of
    their first finish, discard or reward.
    """
    point = await log_point(store, as_of)
    samples: list[Sample] = []
    for session_id in await sessions_with_facts_up_to(store, point):
        session = rebuild_session(session_id, up_to(await store.read_session(session_id), point))
        if session.status != "active" and session.discarded is None:
            samples.extend(build_samples(session))
    return samples


# -- the timeline people read ------------------------------------------------------------------


@dataclass
class Entry:
    """One line of a session's timeline: what happened, when, and its details."""

    position: int  #: the event's position: pass it to `--as-of` to see the session then
    at_s: float  #: seconds since the session's first event (when the store recorded them)
    #: created | request | completion | failure | reward | finished | discarded | image | other
    kind: str
    turn: int | None = None  #: index of the model request, for request/completion/failure
    details: dict[str, Any] = field(default_factory=dict)
    lineage: int | None = None  #: the turn's conversation (`store.lineages`), once it completed

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {
            "position": self.position,
            "at_s": round(self.at_s, 6),
            "kind": self.kind,
            "turn": self.turn,
            "lineage": self.lineage,
            **self.details,
        }


def _new_messages(turn: TurnRecord, previous: TurnRecord | None) -> list[dict[str, Any]]:
    """The messages a chat request adds to the previous request's (tool results, user turns).

    Agents resend the whole history each turn; what is new is what follows the messages of the
    request it continues (the log stores it so: `messages_prefix`) and the assistant reply to
    them, else what follows the previous request's. The first request shows all its messages.
    """
    if turn.messages_prefix is not None:
        rest = turn.messages_added or []  # stored as what it added to the request it continues
        if rest and isinstance(rest[0], dict) and rest[0].get("role") == "assistant":
            rest = rest[1:]
        return rest
    messages = turn.messages
    if not isinstance(messages, list):
        return []
    # The previous request's messages are made whole only when they can be a prefix of these
    # (counted first): a side call after turn 4,000 of a main loop must not rebuild its history.
    fits = previous is not None and (previous.n_messages or 0) <= len(messages)
    before = previous.messages if previous is not None and fits else None
    if not isinstance(before, list) or messages[: len(before)] != before:
        return messages
    rest = messages[len(before) :]
    if rest and isinstance(rest[0], dict) and rest[0].get("role") == "assistant":
        rest = rest[1:]  # the reply to the previous request, shown as its completion
    return rest


def _request_details(turn: TurnRecord, previous: TurnRecord | None) -> dict[str, Any]:
    details: dict[str, Any] = {
        "request_id": turn.request_id,
        "api": turn.api,
        "engine": turn.engine,
        "policy_version": turn.policy_version,
        "stream": turn.stream,
        "sampling": turn.sampling,
        "prompt_tokens": turn.n_prompt_tokens or 0,
        "n_tools": len(turn.body.get("tools") or []),
    }
    if turn.api == "chat":
        details["new_messages"] = _new_messages(turn, previous)
    else:
        details["prompt"] = turn.body.get("prompt")
    return details


def _choice_details(turn: TurnRecord) -> list[dict[str, Any]]:
    choices = []
    for index in sorted(turn.choices):
        choice = turn.choices[index]
        message = choice.message or {}
        logprobs = choice.logprobs
        choices.append(
            {
                "index": index,
                # The text streamed in chunks; with tools vLLM's parser may hold it back, so the
                # final message's content is preferred when there is one.
                "text": message.get("content") or choice.text,
                "tool_calls": message.get("tool_calls") or [],
                "tokens": len(choice.token_ids),
                "finish_reason": choice.finish_reason,
                "mean_logprob": sum(logprobs) / len(logprobs) if logprobs else None,
            }
        )
    return choices


def _outcome_details(turn: TurnRecord) -> dict[str, Any]:
    return {
        "request_id": turn.request_id,
        "prompt_tokens": turn.n_prompt_tokens or 0,
        "completion_tokens": sum(len(c.token_ids) for c in turn.choices.values()),
        "latency_s": turn.latency_s,
        "ttft_s": turn.ttft_s,
        "choices": _choice_details(turn),
    }


def _entry(
    event: RecordedEvent, session: SessionRecord, turn: tuple[int, TurnRecord] | None
) -> tuple[str, dict[str, Any]] | None:
    """The kind and details of the entry an event makes, or None when it makes none."""
    match event.type:
        case EventType.SESSION_CREATED:
            return "created", {"run_id": event.run_id, **upcast(event.type, event.payload)}
        case EventType.REQUEST_RECEIVED if turn is not None:
            index, record = turn
            previous = session.turns[index - 1] if index > 0 else None
            return "request", {**_request_details(record, previous), "status": record.status}
        case EventType.COMPLETION_FINISHED if turn is not None:
            return "completion", {**_outcome_details(turn[1]), "usage": turn[1].usage}
        case EventType.REQUEST_FAILED if turn is not None:
            return "failure", {**_outcome_details(turn[1]), **upcast(event.type, event.payload)}
        case EventType.REWARD_ASSIGNED:
            return "reward", upcast(event.type, event.payload)
        case EventType.SESSION_FINISHED:
            return "finished", upcast(event.type, event.payload)
        case EventType.SESSION_DISCARDED:
            return "discarded", upcast(event.type, event.payload)
        case EventType.PROMPT_TOKENS | EventType.COMPLETION_CHUNK:
            return None  # folded into the request's completion or failure entry
        case EventType.IMAGE_RECORDED:  # what it is, not its bytes
            return "image", ImageRecorded.read(event.payload).without_data()
        case _:
            return "other", {"type": event.type, **upcast(event.type, event.payload)}


def timeline(
    session: SessionRecord,
    events: Sequence[RecordedEvent],
    lineage_of: Mapping[int, int] | None = None,
) -> list[Entry]:
    """The entries people read, from a session's events and the session rebuilt from them;
    with `lineage_of` (turn -> lineage: `store.lineages.Forest`), each turn's entries say its
    lineage.

    Prompt tokens and completion chunks are folded into their request's completion (or failure)
    entry: a chunk per few tokens is the record, not something to read. A request still in
    progress (as of an earlier position) shows as a request whose status is `in_progress`.
    Each entry costs what its turn added (`_new_messages`): linear in the session's turns.
    """
    lineage_of = lineage_of or {}
    if not events:
        return []
    start: datetime = events[0].recorded_at
    turns = {request_stream(t.request_id): (i, t) for i, t in enumerate(session.turns)}
    entries: list[Entry] = []
    for event in events:
        turn = turns.get(event.stream_id)
        made = _entry(event, session, turn)
        if made is not None:
            at_s = (event.recorded_at - start).total_seconds()
            index = turn[0] if turn is not None and made[0] != "other" else None
            lineage = None if index is None else lineage_of.get(index)
            entries.append(Entry(event.position, at_s, made[0], index, made[1], lineage))
    return entries
