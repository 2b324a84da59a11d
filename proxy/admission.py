"""Fair admission of model calls across runs: per-run limits, and a turn each for waiting runs.

Several runs share the engines. Without admission, a run that sends a burst of a thousand
requests fills the engines' queues, and another run's next turn waits behind all of them. So
each run may be given limits (`RateLimit`, none by default):

- `requests_per_second` with a `burst`: a token bucket, refilled continuously;
- `max_in_flight`: its requests being served at once;
- `max_queued`: its requests waiting; one more is refused (`RateLimited`: 429 + Retry-After).

And the proxy may cap the requests it serves at once across all runs (`max_in_flight`, the
setting `TRAJSTORE_ADMISSION_MAX_IN_FLIGHT`, off by default): roughly what its engines can batch.

A request is admitted at once when its run has nothing waiting and it fits both the run's limits
and the global cap. Otherwise it waits in its run's FIFO queue. Whenever capacity frees (a
request ends, a token of a bucket is due), the waiting runs take turns, one request each
(`_dispatch`). The turns are start-time fair queueing with one unit per request: each run has
the number of its next turn, the lowest goes first, and a run that had nothing waiting comes
back at the turn being served now. So it is next, however long the others' queues; and it
banks no credit while idle. (Plain round-robin put a returning run behind the flooding one: its
agent, whose next turn always comes a moment after its last ended, waited two slots each
time, not one.) A run blocked by its own limits is passed over, keeping its turn, without
holding up the others. So a run with 500 requests waiting delays another run's request by at
most the one slot that frees next.

Everything here is this replica's memory (no I/O, no events): each replica enforces the limits
it was given on the requests it serves. With N replicas behind a balancer, give each 1/N of a
run's budget. A run's limits come from `PUT /admin/runs/{id}/limits`, which is the authority
(it holds until `DELETE`), or else from the newest session of the run that asked for any
(`POST /sessions` with `rate_limit`; `offer`). Runs with no limits and nothing in flight are
forgotten, so memory follows the runs active now.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trajstore.proxy.errors import RetryLater

Source = Literal["admin", "session"]


class RateLimit(BaseModel):
    """The limits of one run on one replica; a field left out is no limit."""

    model_config = ConfigDict(extra="forbid")

    requests_per_second: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    burst: int | None = Field(
        default=None, ge=1, description="Requests a full bucket admits at once "
        "(default: requests_per_second rounded up).",
    )  # fmt: skip
    max_in_flight: int | None = Field(default=None, ge=1)
    max_queued: int | None = Field(default=None, ge=0)

    @property
    def bucket_size(self) -> float:
        """How many tokens a full bucket holds."""
        if self.burst is not None:
            return float(self.burst)
        return float(max(1, math.ceil(self.requests_per_second or 1)))


class RateLimited(RetryLater):
    """The run has too many requests waiting; retry later."""

    status = 429
    type = "rate_limit_error"


@dataclass
class _Run:
    """One run's limits, bucket, requests in flight and FIFO of waiting requests."""

    run_id: str
    limits: RateLimit | None = None
    source: Source | None = None
    offered_at: float = -math.inf  # created_at of the session whose limits hold
    tokens: float = 0.0
    refilled_at: float = 0.0
    in_flight: int = 0
    queue: deque[Ticket] = field(default_factory=deque)
    turn: int = 0  # the turn of its next request (start-time fair queueing)
    waiting: bool = False  # in `Admission._waiting`

    def refill(self, now: float) -> None:
        limits = self.limits
        if limits is None or limits.requests_per_second is None:
            return
        elapsed = max(0.0, now - self.refilled_at)
        self.tokens = min(limits.bucket_size, self.tokens + elapsed * limits.requests_per_second)
        self.refilled_at = now

    def token_due_in(self) -> float:
        """Seconds until the bucket holds a whole token (0 if it does, or there is none)."""
        rate = self.limits.requests_per_second if self.limits else None
        return 0.0 if rate is None or self.tokens >= 1 else (1 - self.tokens) / rate

    def can_start(self, now: float) -> bool:
        limits = self.limits
        if limits is None:
            return True
        if limits.max_in_flight is not None and self.in_flight >= limits.max_in_flight:
            return False
        self.refill(now)
        return limits.requests_per_second is None or self.tokens >= 1

    def start(self) -> None:
        if self.limits is not None and self.limits.requests_per_second is not None:
            self.tokens -= 1
        self.in_flight += 1

    @property
    def idle(self) -> bool:
        return self.source is None and self.in_flight == 0 and not self.queue


class Ticket:
    """One request's place: admitted (`ready`), or waiting in its run's queue until `admitted`
    resolves. `release()` once the request is answered; `cancel()` if it goes away while queued.
    """

    __slots__ = ("_admission", "_done", "_run", "admitted", "enqueued_at", "started_at")

    def __init__(self, admission: Admission | None, run: _Run | None, now: float) -> None:
        self._admission = admission
        self._run = run
        self.admitted: asyncio.Future[None] | None = None
        self.enqueued_at = now
        self.started_at: float | None = now if run is None else None
        self._done = False

    @property
    def ready(self) -> bool:
        """Whether the request may go to the engine now."""
        return self.started_at is not None

    @property
    def waited(self) -> float:
        """Seconds spent queued (so far, if still queued)."""
        end = self.started_at
        if end is None:
            end = self._admission.clock() if self._admission else self.enqueued_at
        return end - self.enqueued_at

    @property
    def tracked(self) -> bool:
        """Whether admission accounted for this request (its run has limits, or a global cap)."""
        return self._run is not None

    def release(self) -> None:
        """The request is over (answered, failed, or left while queued): free its place."""
        if self._done or self._admission is None or self._run is None:
            self._done = True
            return
        self._done = True
        self._admission._release(self)

    cancel = release


#: The ticket of a request nobody accounts for: no global cap, no limits for its run.
def _untracked() -> Ticket:
    return Ticket(None, None, 0.0)


class Admission:
    """Admits model calls in fair order across runs (see the module docstring)."""

    def __init__(
        self,
        *,
        max_in_flight: int | None = None,
        max_queued: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_in_flight`: requests served at once across all runs (None: no cap);
        `max_queued`: requests a run may have waiting when its limits say none (None: no
        bound); `clock`: seconds, monotonic (tests pass their own)."""
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.clock = clock
        self.in_flight = 0  # tracked requests being served, all runs
        self._runs: dict[str, _Run] = {}
        # Runs with requests waiting, the longest since served first (ties of turns go to it).
        self._waiting: deque[_Run] = deque()
        self._turn = 0  # the turn of the last request admitted
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = math.inf

    # -- limits ---------------------------------------------------------------------------------

    def set_limits(self, run_id: str, limits: RateLimit | None) -> None:
        """The admin call: these limits hold for the run until changed; None clears them (and
        the run's sessions may set them again)."""
        run = self._run(run_id)
        self._apply(run, limits, "admin" if limits is not None else None)
        run.offered_at = -math.inf
        self._forget_if_idle(run)
        self._dispatch()

    def offer(self, run_id: str, limits: RateLimit | None, created_at: float) -> None:
        """A session's `rate_limit`: taken unless the admin set the run's limits, or a newer
        session of the run gave its own (so every replica settles on the same ones)."""
        if limits is None:
            return
        run = self._runs.get(run_id)
        if run is not None and (run.source == "admin" or created_at < run.offered_at):
            return
        run = run or self._run(run_id)
        run.offered_at = created_at
        if run.limits != limits:
            self._apply(run, limits, "session")
            self._dispatch()

    def limits_of(self, run_id: str) -> tuple[RateLimit | None, Source | None]:
        """The run's limits here, and who set them."""
        run = self._runs.get(run_id)
        return (None, None) if run is None else (run.limits, run.source)

    def _apply(self, run: _Run, limits: RateLimit | None, source: Source | None) -> None:
        run.limits, run.source = limits, source
        if limits is not None and limits.requests_per_second is not None:
            run.tokens, run.refilled_at = limits.bucket_size, self.clock()  # a full bucket

    # -- requests -------------------------------------------------------------------------------

    def request(self, run_id: str) -> Ticket:
        """A place for one request of `run_id`: ready now, or queued (await `admitted`);
        `RateLimited` when the run's queue is full."""
        run = self._runs.get(run_id)
        if run is None and self.max_in_flight is None:
            return _untracked()  # nothing to enforce: the common case costs a lookup
        if self._waiting:
            self._dispatch()  # a bucket may have refilled since the last look
        run = run or self._run(run_id)
        now = self.clock()
        ticket = Ticket(self, run, now)
        if not run.waiting:
            run.turn = max(run.turn, self._turn)  # back from idle: next, with no credit banked
        if not run.queue and self._has_room() and run.can_start(now):
            self._start(run, ticket, now)
            return ticket
        limit = run.limits.max_queued if run.limits else None
        limit = self.max_queued if limit is None else limit
        if limit is not None and len(run.queue) >= limit:
            self._forget_if_idle(run)
            raise RateLimited(
                f"run {run_id!r} has {len(run.queue)} requests waiting on this proxy, its limit;"
                " retry later",
                retry_after=self._retry_after(run),
            )
        ticket.admitted = asyncio.get_running_loop().create_future()
        run.queue.append(ticket)
        if not run.waiting:
            run.waiting = True
            self._waiting.append(run)
        self._wake_when_due()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        run = ticket._run
        assert run is not None
        if ticket.started_at is None:  # still queued: leave the queue
            with contextlib.suppress(ValueError):
                run.queue.remove(ticket)
            if not run.queue and run.waiting:
                run.waiting = False
                self._waiting.remove(run)
            if ticket.admitted is not None and not ticket.admitted.done():
                ticket.admitted.cancel()
        else:
            run.in_flight -= 1
            self.in_flight -= 1
        self._forget_if_idle(run)
        self._dispatch()

    def _start(self, run: _Run, ticket: Ticket, now: float) -> None:
        run.start()
        self._turn = run.turn
        run.turn += 1
        self.in_flight += 1
        ticket.started_at = now
        if ticket.admitted is not None and not ticket.admitted.done():
            ticket.admitted.set_result(None)

    def _has_room(self) -> bool:
        return self.max_in_flight is None or self.in_flight < self.max_in_flight

    def _dispatch(self) -> None:
        """Admit waiting requests while there is room: the run with the lowest turn first,
        passing over runs their own limits hold back (they keep their turn).

        A scan of the waiting runs per admission: they are the runs active on this replica,
        tens, not thousands.
        """
        now = self.clock()
        while self._waiting and self._has_room():
            best: _Run | None = None
            for run in self._waiting:
                if (best is None or run.turn < best.turn) and run.can_start(now):
                    best = run
            if best is None:
                break  # every waiting run is held by its own limits
            self._waiting.remove(best)
            self._start(best, best.queue.popleft(), now)
            if best.queue:
                self._waiting.append(best)
            else:
                best.waiting = False
        self._wake_when_due()

    def wake(self) -> None:
        """Look again at the waiting requests (buckets refill with time; a timer calls this)."""
        self._timer, self._timer_due = None, math.inf
        self._dispatch()

    def _wake_when_due(self) -> None:
        """Set a timer for the earliest bucket refill a waiting run needs."""
        if not self._has_room():
            return  # a release will dispatch
        due = min((d for r in self._waiting if (d := r.token_due_in()) > 0), default=math.inf)
        if due == math.inf:
            return  # none waits for a token: a release will dispatch
        at = self.clock() + due
        if self._timer is not None:
            if self._timer_due <= at:
                return
            self._timer.cancel()
        self._timer_due = at
        self._timer = asyncio.get_running_loop().call_later(due, self.wake)

    def _retry_after(self, run: _Run) -> float:
        rate = run.limits.requests_per_second if run.limits else None
        if rate is not None:
            return (len(run.queue) + 1) / rate
        return 1.0

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            run = self._runs[run_id] = _Run(run_id, refilled_at=self.clock())
        return run

    def _forget_if_idle(self, run: _Run) -> None:
        if run.idle:
            self._runs.pop(run.run_id, None)

    # -- reading --------------------------------------------------------------------------------

    def runs(self) -> Iterator[tuple[str, int, int]]:
        """(run id, requests in flight, requests waiting) of every run admission tracks."""
        for run in list(self._runs.values()):
            yield run.run_id, run.in_flight, len(run.queue)

    def describe(self, run_id: str) -> dict[str, Any]:
        """The run's limits, who set them, and its requests in flight and waiting here."""
        run = self._runs.get(run_id)
        limits = None if run is None or run.limits is None else run.limits.model_dump()
        return {
            "run_id": run_id,
            "limits": limits,
            "set_by": None if run is None else run.source,
            "in_flight": 0 if run is None else run.in_flight,
            "queued": 0 if run is None else len(run.queue),
        }
