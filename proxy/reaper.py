"""Turns lost with their replica, and sessions nobody finishes.

A proxy replica that dies (SIGKILL, out of memory, its node lost) leaves the requests it was
serving open in the log: a `request_received`, perhaps some chunks, and never a
`completion_finished` or `request_failed`. Their sessions would stay active forever, and the
projector, which builds a session when it finishes, would never see them. An orchestrator that
died leaves sessions nobody finishes, too. So every replica runs a `Reaper`, which every
`interval` seconds reads the streams of the sessions still active (`ACTIVE_SESSION_STREAMS`) and:

1. fails each open request whose replica is gone: it appends `request_failed {reason:
   replica_lost, partial_tokens}` after the request's last event, keeping the tokens that did
   reach the log. Gone means absent from the live replicas (`proxy.replicas`: their
   connections in pg_stat_activity) on every look for at least `lost_after` seconds, and the
   request unchanged for as long. Sessions finished while the reaper watches (an orchestrator
   that finished at once after the crash) are looked at for a while longer, so that their cut
   turns do not stay open for good. The bound must exceed a writer's retry time (30 s): a
   replica that is only reconnecting after a PostgreSQL restart is absent for a moment, and its
   writer still holds the request's next events;
2. finishes as `timeout` each session with no event for `idle_timeout` seconds, through the same
   `finish` (the barrier across replicas included) an orchestrator's finish takes.

Several replicas may reap at once: a failure is appended at the request's expected version, so
it lands once (and never after an event its replica did manage to write), and a repeated finish
with the same status is harmless.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from trajstore.proxy.errors import ProxyError
from trajstore.proxy.sessions import Finish, SessionRegistry
from trajstore.store import ConcurrencyError, EventStore, EventType, NewEvent, StoreError, queries
from trajstore.store.payloads_request import RequestFailed

log = logging.getLogger(__name__)


@dataclass
class Reaped:
    """What one look did."""

    requests_failed: list[str] = field(default_factory=list)  # request streams
    sessions_timed_out: list[str] = field(default_factory=list)


class Reaper:
    """Fails the open requests of dead replicas and times out idle sessions (module docstring)."""

    def __init__(
        self,
        store: EventStore,
        registry: SessionRegistry,
        *,
        interval: float = 10.0,
        lost_after: float = 60.0,
        idle_timeout: float | None = 3600.0,
    ) -> None:
        self.store = store
        self.registry = registry
        self.interval = interval
        self.lost_after = lost_after
        self.idle_timeout = idle_timeout
        self._absent_since: dict[str, float] = {}  # replica id -> first look it was absent
        # Sessions finished lately (session id -> when seen), and how far the log was read for
        # them: their requests may still be open when a replica died just before the finish.
        self._finished: dict[str, float] = {}
        self._finished_after: tuple[int, int] | None = None

    async def run(self) -> None:
        """Look every `interval` seconds until cancelled; a failed look is retried next time."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.reap()
            except (StoreError, ProxyError) as exc:
                log.warning("the reaper could not look at the log: %s", exc)

    async def reap(self) -> Reaped:
        """One look: fail what dead replicas left open, finish what was left idle."""
        done = Reaped()
        now = time.monotonic()
        recent = await self._recently_finished(now)
        rows = await self.store.fetch(queries.ACTIVE_SESSION_STREAMS, recent)
        live = await self.registry.replicas.live()
        seen_absent = {r["replica"] for r in rows if r["replica"] and r["replica"] not in live}
        self._absent_since = {
            replica: self._absent_since.get(replica, now) for replica in seen_absent
        }
        idle: dict[str, float] = {}
        for row in rows:
            session = row["session_id"]
            idle[session] = min(idle.get(session, row["idle_s"]), row["idle_s"])
            if self._lost(row, now) and await self._fail(row):
                done.requests_failed.append(row["stream_id"])
        active = {row["session_id"] for row in rows if row["active"]}
        for session, idle_s in idle.items():
            if session not in active:
                continue
            timed_out = self.idle_timeout and idle_s >= self.idle_timeout
            if timed_out and await self._time_out(session, idle_s):
                done.sessions_timed_out.append(session)
        return done

    async def _recently_finished(self, now: float) -> list[str]:
        """The sessions finished in the last few looks (from the reaper's start on)."""
        if self._finished_after is None:
            self._finished_after = await self.store.horizon()
        while True:  # the session facts index: the finishes alone, in log order
            finishes = await self.store.read_types(
                [EventType.SESSION_FINISHED.value], after=self._finished_after
            )
            for fact in finishes:
                self._finished[fact.session_id or ""] = now
                self._finished_after = (fact.tx_id, fact.position)
            if len(finishes) < 1000:  # read_types' page
                break
        keep = 2 * self.lost_after + 3 * self.interval  # long enough to see the replica gone
        self._finished = {s: t for s, t in self._finished.items() if now - t <= keep}
        return list(self._finished)

    def _lost(self, row: Any, now: float) -> bool:
        """Whether an open request's replica has been gone, and the request still, long enough."""
        replica = row["replica"]
        if row["ended"] or not replica or replica not in self._absent_since:
            return False
        gone_for = now - self._absent_since[replica]
        return bool(gone_for >= self.lost_after and row["idle_s"] >= self.lost_after)

    async def _fail(self, row: Any) -> bool:
        failed = RequestFailed(
            reason="replica_lost",
            status=None,
            message=f"proxy replica {row['replica']} went away while serving this request; "
            "the tokens that reached the log are kept",
            latency_s=None,
            partial_tokens={"0": row["tokens"]},
        )
        event = NewEvent(
            EventType.REQUEST_FAILED,
            session_id=row["session_id"],
            run_id=row["run_id"],
            payload=failed,
        )
        try:
            await self.store.append(row["stream_id"], [event], expected_version=row["version"])
        except ConcurrencyError:
            return False  # another reaper was first, or the replica wrote after all
        log.warning("%s: %s", row["stream_id"], failed.message)
        return True

    async def _time_out(self, session_id: str, idle_s: float) -> bool:
        finish = Finish(status="timeout", reason=f"no activity for {idle_s:.0f} s")
        try:
            session = await self.registry.finish(session_id, finish)
        except ProxyError as exc:  # finished meanwhile (409), or a replica did not answer (503)
            log.info("the idle session %s was not timed out: %s", session_id, exc.message)
            return False
        return session.status == "timeout"
