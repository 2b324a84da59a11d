"""Sessions as the proxy sees them: created, looked up, rewarded, finished, discarded.

Session-level facts are appended to the session's own stream and awaited: they are rare and the
caller wants them durable. Model requests only read the session, from a per-replica cache filled
from the log on first use. Each session has its own API key (for its agent's model calls) and its
own orchestrator key (for its reward, finish and discard: `proxy.auth`), both derived from a
secret with HMAC, so any replica sharing the secret can check them without a lookup, and no key is
ever stored.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trajstore.proxy.admission import RateLimit
from trajstore.proxy.errors import BadRequest, Conflict, NotFound
from trajstore.proxy.replicas import Replicas
from trajstore.store import (
    ConcurrencyError,
    EventStore,
    EventType,
    EventWriter,
    ExpectedVersion,
    NewEvent,
    StoreUnavailable,
    session_stream,
)
from trajstore.store.events import MAX_ID_LENGTH
from trajstore.store.payloads import Payload
from trajstore.store.payloads_session import (
    RewardAssigned,
    SessionCreated,
    SessionDiscarded,
    SessionFinished,
)
from trajstore.store.schema import FACTS_CHANNEL
from trajstore.store.sessions import rebuild_session
from trajstore.store.subscription import wake_ups

FinishStatus = Literal["completed", "aborted", "error", "timeout"]


class CreateSession(BaseModel):
    """`POST /sessions`: a new agent episode."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    session_id: str | None = Field(
        default=None, min_length=1, max_length=MAX_ID_LENGTH, pattern=r"^[A-Za-z0-9._:-]+$"
    )
    task_id: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    group_id: str | None = Field(default=None, max_length=MAX_ID_LENGTH)
    metadata: dict[str, Any] = Field(default_factory=dict)
    deadline_s: float | None = Field(default=None, gt=0)
    rate_limit: RateLimit | None = Field(
        default=None,
        description="Limits of the session's run on each proxy replica (`proxy.admission`): "
        "the newest session's hold, unless the admin set the run's limits.",
    )


class Reward(BaseModel):
    """`POST /sessions/{id}/reward`."""

    model_config = ConfigDict(extra="forbid")

    value: float = Field(allow_inf_nan=False)
    components: dict[str, float] | None = None
    source: str | None = None


class Finish(BaseModel):
    """`POST /sessions/{id}/finish`."""

    model_config = ConfigDict(extra="forbid")

    status: FinishStatus
    reason: str | None = None
    #: The session's main conversation, by its lineage index (`GET /sessions/{id}` lists them);
    #: without it the projection decides (`store.lineages`).
    main_lineage: int | None = Field(default=None, ge=0)


class Discard(BaseModel):
    """`POST /sessions/{id}/discard`: keep the session in the log, out of training."""

    model_config = ConfigDict(extra="forbid")

    reason: str = Field(min_length=1)


@dataclass
class Session:
    """What a replica knows of a session."""

    session_id: str
    run_id: str
    task_id: str | None = None
    group_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    deadline_s: float | None = None
    created_at: float = 0.0
    status: str = "active"
    discarded: str | None = None
    #: The run's limits this session asked for; not part of its `definition()`: they are the
    #: run's, and a later session or the admin may change them.
    rate_limit: RateLimit | None = None

    def definition(self) -> dict[str, Any]:
        """What the creator asked for: two creations are the same if these are equal."""
        return {
            "run_id": self.run_id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "metadata": self.metadata,
            "deadline_s": self.deadline_s,
        }

    @property
    def past_deadline(self) -> bool:
        """True once the session has outlived its deadline."""
        return self.deadline_s is not None and time.time() > self.created_at + self.deadline_s


log = logging.getLogger(__name__)

#: Sessions a replica keeps in memory, the least recently used forgotten first (and read from
#: the log again when next needed): 100,000 take about 100 MB here.
MAX_CACHED_SESSIONS = 100_000

#: Facts of other replicas that change whether a cached session takes model calls.
_FOLLOWED = [EventType.SESSION_FINISHED.value, EventType.SESSION_DISCARDED.value]


class SessionRegistry:
    """Creates and tracks sessions; appends their facts to the log.

    Each replica caches the sessions it has seen, so a model call costs no database read. Other
    replicas may finish or discard a cached session: `follow()` tails those facts from the log
    (woken by their NOTIFY, polling as the truth) and updates the cache, so within moments every
    replica refuses model calls on a finished session. Facts that change a session (finish,
    reward, discard) always read the session fresh from the log first. A finish waits until
    every replica that served the session has its events durable (`proxy.replicas`: `writer`
    is this replica's `replica_id`'s); start `replicas` before serving.
    """

    def __init__(
        self,
        store: EventStore,
        writer: EventWriter,
        secret: bytes,
        *,
        replica_id: str,
        finish_timeout: float = 30.0,
        max_cached: int = MAX_CACHED_SESSIONS,
    ) -> None:
        self.store = store
        self.writer = writer
        self._secret = secret
        # Least recently used first. A session forgotten here is one this replica has not
        # served for a long while: its events left the writer long ago, so a finish elsewhere
        # need not wait for us (`Replicas.served`).
        self._sessions: collections.OrderedDict[str, Session] = collections.OrderedDict()
        self._max_cached = max_cached
        self._keys: dict[str, str] = {}
        #: Told the id of every session finished or discarded (here, or by another replica):
        #: what is kept for its requests can go (`proxy.lineages.PromptContexts.forget`).
        self.on_closed: list[Callable[[str], None]] = []
        #: Told once of each session this replica records the finish of (by its orchestrator,
        #: past its deadline, or idle: `proxy.reaper`), not of a retried finish: its trace's root.
        self.on_finished: list[Callable[[Session], None]] = []
        self.replicas = Replicas(
            store,
            writer,
            served=self._sessions.__contains__,
            replica_id=replica_id,
            timeout=finish_timeout,
        )

    def key_for(self, session_id: str) -> str:
        """The API key of one session."""
        key = self._keys.get(session_id)
        if key is None:  # an HMAC per model call showed in profiles: remember recent ones
            digest = hmac.new(self._secret, session_id.encode(), hashlib.sha256).hexdigest()
            key = f"tss-{digest[:48]}"
            if len(self._keys) >= 100_000:
                self._keys.clear()
            self._keys[session_id] = key
        return key

    def key_matches(self, session_id: str, presented: str) -> bool:
        """Whether `presented` is this session's key (constant-time)."""
        return hmac.compare_digest(self.key_for(session_id), presented)

    def orchestrator_key_for(self, session_id: str) -> str:
        """The key that rewards, finishes and discards one session (`proxy.auth`): given to
        whoever created the session, never to its agent."""
        message = b"orchestrator\0" + session_id.encode()
        return f"tso-{hmac.new(self._secret, message, hashlib.sha256).hexdigest()[:48]}"

    def orchestrator_key_matches(self, session_id: str, presented: str) -> bool:
        """Whether `presented` is this session's orchestrator key (constant-time)."""
        return hmac.compare_digest(self.orchestrator_key_for(session_id), presented)

    async def create(self, request: CreateSession, session_id: str) -> tuple[Session, bool]:
        """Create the session, or return the existing one if created with the same body.

        Returns the session and whether it was created now; `Conflict` when the id is taken by a
        session created differently.
        """
        wanted = Session(
            session_id=session_id,
            run_id=request.run_id,
            task_id=request.task_id,
            group_id=request.group_id,
            metadata=request.metadata,
            deadline_s=request.deadline_s,
            created_at=time.time(),
            rate_limit=request.rate_limit,
        )
        existing = await self._load(session_id)
        if existing is None:
            fields = {**wanted.definition(), "created_at": wanted.created_at}
            if request.rate_limit is not None:  # recorded, so any replica loading it applies it
                fields["rate_limit"] = request.rate_limit.model_dump(exclude_none=True)
            created = SessionCreated(**fields)
            event = NewEvent(
                EventType.SESSION_CREATED,
                session_id=session_id,
                run_id=request.run_id,
                payload=created,
            )
            try:
                await self.store.append(
                    session_stream(session_id), [event], expected_version=ExpectedVersion.NO_STREAM
                )
                self._remember(wanted)
                return wanted, True
            except ConcurrencyError:
                existing = await self._load(session_id)  # created by a racing replica
        assert existing is not None
        if existing.definition() != wanted.definition():
            raise Conflict(
                f"session {session_id!r} exists with a different definition; "
                "use a new session_id or send the same body"
            )
        return existing, False

    async def get(self, session_id: str, *, fresh: bool = False) -> Session:
        """The session, from this replica's cache (unless `fresh`) or the log; `NotFound` if
        there is none."""
        session = None if fresh else self._sessions.get(session_id)
        if session is not None:
            self._sessions.move_to_end(session_id)
        session = session or await self._load(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}; create it with POST /sessions")
        return session

    @property
    def cached(self) -> int:
        """How many sessions this replica holds in memory."""
        return len(self._sessions)

    def _remember(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)
        if len(self._sessions) > self._max_cached:
            self._sessions.popitem(last=False)

    async def follow(self, poll_interval: float = 1.0) -> None:
        """Keep cached sessions in step with finishes and discards made by other replicas."""
        # Facts below the horizon now were committed before: a session loaded later sees them.
        position = await self.store.horizon()
        steps = wake_ups(
            self.store.url,
            FACTS_CHANNEL,
            poll_interval=poll_interval,
            application_name="trajstore-sessions",
        )
        async with contextlib.aclosing(steps):  # closes the LISTEN connection when cancelled
            async for _ in steps:
                try:
                    position = await self._apply_facts(position)
                except StoreUnavailable as exc:
                    log.warning("cannot follow session facts (%s); retrying", exc)
                except Exception:  # keep following: a dead follower would go unnoticed
                    log.exception("following session facts failed; retrying")

    async def _apply_facts(self, after: tuple[int, int]) -> tuple[int, int]:
        facts = await self.store.read_types(_FOLLOWED, after=after)
        for fact in facts:
            self._closed(fact.session_id or "")  # a finish or a discard
            cached = self._sessions.get(fact.session_id or "")
            if cached is None:
                continue  # not cached here: loaded from the log, with this fact, when needed
            if fact.type == EventType.SESSION_FINISHED:
                cached.status = SessionFinished.read(fact.payload).status
            else:
                cached.discarded = SessionDiscarded.read(fact.payload).why
        return (facts[-1].tx_id, facts[-1].position) if facts else after

    async def ready_for_requests(self, session_id: str) -> Session:
        """The session, if it may take model requests now; `Conflict` saying why not."""
        session = await self.get(session_id)
        if session.status == "active" and session.past_deadline:
            await self.finish(session_id, Finish(status="timeout", reason="deadline passed"))
            raise Conflict(f"session {session_id!r} passed its deadline of {session.deadline_s}s")
        if session.status != "active":
            raise Conflict(f"session {session_id!r} is finished ({session.status})")
        if session.discarded is not None:
            raise Conflict(f"session {session_id!r} was discarded: {session.discarded}")
        return session

    async def finish(self, session_id: str, request: Finish) -> Session:
        """Make every event of the session durable, on every replica, then record that it
        finished."""
        session = await self.get(session_id, fresh=True)
        if session.status != "active":
            if session.status == request.status:
                return session  # a retried finish
            raise Conflict(f"session {session_id!r} already finished ({session.status})")
        await self.replicas.flush_everywhere(session_id)
        await self._append(session, SessionFinished(**request.model_dump(exclude_none=True)))
        session.status = request.status
        self._closed(session_id)
        for listener in self.on_finished:
            listener(session)
        return session

    async def reward(self, session_id: str, request: Reward) -> Session:
        """Record a reward (a later one corrects an earlier one)."""
        session = await self.get(session_id, fresh=True)
        await self._append(session, RewardAssigned(**request.model_dump()))
        return session

    async def discard(self, session_id: str, request: Discard) -> Session:
        """Record that the session must not be trained on; it stays in the log."""
        session = await self.get(session_id, fresh=True)
        await self._append(session, SessionDiscarded(**request.model_dump()))
        session.discarded = request.reason
        self._closed(session_id)
        return session

    def _closed(self, session_id: str) -> None:
        for listener in self.on_closed:
            listener(session_id)

    async def _append(self, session: Session, payload: Payload) -> None:
        event = NewEvent(
            EventType(payload.event_type),
            session_id=session.session_id,
            run_id=session.run_id,
            payload=payload,
        )
        await self.store.append(session_stream(session.session_id), [event])

    async def _load(self, session_id: str) -> Session | None:
        if len(session_id) > MAX_ID_LENGTH:
            raise BadRequest(f"session ids are at most {MAX_ID_LENGTH} characters")
        events = await self.store.read_stream(session_stream(session_id))
        if not events:
            return None
        record = rebuild_session(session_id, events)
        limit = record.rate_limit
        session = Session(
            session_id=session_id,
            run_id=record.run_id or "",
            task_id=record.task_id,
            group_id=record.group_id,
            metadata=record.metadata,
            deadline_s=record.deadline_s,
            created_at=record.created_at or 0.0,
            status=record.status,
            discarded=record.discarded,
            rate_limit=None if limit is None else RateLimit.model_validate(limit),
        )
        self._remember(session)
        return session
