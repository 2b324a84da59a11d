"""The admission scheduler on its own: fair turns across runs, per-run limits, queue bounds,
leaving the queue, who sets a run's limits. No I/O; time is a clock the tests move."""

from __future__ import annotations

import asyncio

import pytest

from trajstore.proxy.admission import Admission, RateLimit, RateLimited, Ticket


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def admitted(tickets: list[tuple[str, Ticket]]) -> list[str]:
    return [name for name, ticket in tickets if ticket.ready]


async def test_nothing_is_tracked_without_a_cap_or_limits() -> None:
    admission = Admission()
    tickets = [admission.request("run-a") for _ in range(1000)]
    assert all(t.ready and not t.tracked for t in tickets)
    assert list(admission.runs()) == []


async def test_a_flooding_run_delays_another_by_at_most_one_slot_under_a_global_cap() -> None:
    admission = Admission(max_in_flight=1)
    flood = [(f"a{i}", admission.request("run-a")) for i in range(20)]
    late = [(f"b{i}", admission.request("run-b")) for i in range(3)]
    order: list[str] = []
    waiting = flood + late
    while waiting:
        [(name, ticket)] = [(n, t) for n, t in waiting if t.ready]
        order.append(name)
        waiting.remove((name, ticket))
        ticket.release()
    # a0 was serving when run-b arrived: run-b goes next, then the runs take turns.
    assert order[:7] == ["a0", "b0", "a1", "b1", "a2", "b2", "a3"]
    assert order[7:] == [f"a{i}" for i in range(4, 20)]


async def test_a_run_back_from_idle_is_next_but_banks_no_credit() -> None:
    admission = Admission(max_in_flight=1)
    serving = admission.request("run-a")
    flood = [admission.request("run-a") for _ in range(10)]
    for ticket in [serving, *flood[:5]]:  # run-b idle all along: no turns owed to it
        ticket.release()
    late = [admission.request("run-b") for _ in range(3)]
    flood[5].release()
    assert late[0].ready  # next, not behind run-a's backlog
    late[0].release()
    assert flood[6].ready and not late[1].ready  # then turn about, no catching up
    flood[6].release()
    assert late[1].ready


async def test_a_run_held_by_its_own_limit_does_not_hold_up_the_others() -> None:
    admission = Admission(max_in_flight=4)
    admission.set_limits("run-a", RateLimit(max_in_flight=1))
    a = [admission.request("run-a") for _ in range(5)]
    b = [admission.request("run-b") for _ in range(3)]
    assert [t.ready for t in a] == [True, False, False, False, False]
    assert all(t.ready for t in b)  # three free slots, and run-a may not take them
    a[0].release()
    assert a[1].ready and not a[2].ready
    assert dict((run, (f, q)) for run, f, q in admission.runs()) == {
        "run-a": (1, 3),
        "run-b": (3, 0),
    }


async def test_per_run_in_flight_cap_holds_without_a_global_cap() -> None:
    admission = Admission()
    admission.set_limits("run-a", RateLimit(max_in_flight=2))
    tickets = [admission.request("run-a") for _ in range(6)]
    served = 0
    while tickets:
        ready = [t for t in tickets if t.ready]
        assert len(ready) <= 2
        ready[0].release()
        tickets.remove(ready[0])
        served += 1
    assert served == 6


async def test_a_token_bucket_admits_a_burst_then_at_its_rate() -> None:
    clock = Clock()
    admission = Admission(clock=clock)
    admission.set_limits("run-a", RateLimit(requests_per_second=2, burst=2))
    tickets = [admission.request("run-a") for _ in range(4)]
    assert [t.ready for t in tickets] == [True, True, False, False]
    clock.now += 0.4
    admission.wake()
    assert not tickets[2].ready
    clock.now += 0.1  # one token is due after 0.5 s
    admission.wake()
    assert tickets[2].ready and not tickets[3].ready
    assert tickets[2].waited == pytest.approx(0.5)
    clock.now += 0.5
    admission.wake()
    assert tickets[3].ready


async def test_a_timer_is_set_for_a_run_waiting_on_its_bucket_beside_one_at_its_cap() -> None:
    admission = Admission()
    admission.set_limits("run-capped", RateLimit(max_in_flight=1))
    admission.set_limits("run-paced", RateLimit(requests_per_second=50, burst=1))
    capped = [admission.request("run-capped") for _ in range(2)]
    paced = [admission.request("run-paced") for _ in range(2)]
    assert capped[0].ready and paced[0].ready and not paced[1].ready
    assert paced[1].admitted is not None
    await asyncio.wait_for(paced[1].admitted, 1)  # the bucket's timer, at 50/s: 20 ms
    assert not capped[1].ready


async def test_a_full_queue_is_refused_with_a_retry_after() -> None:
    admission = Admission()
    admission.set_limits("run-a", RateLimit(requests_per_second=1, max_queued=2))
    first = admission.request("run-a")
    queued = [admission.request("run-a") for _ in range(2)]
    assert first.ready and not any(t.ready for t in queued)
    with pytest.raises(RateLimited) as refused:
        admission.request("run-a")
    assert refused.value.status == 429
    assert int(refused.value.headers()["Retry-After"]) == 3  # two ahead of it, at 1/s
    admission.request("run-b")  # other runs are not refused


async def test_the_default_queue_bound_applies_to_runs_without_their_own() -> None:
    admission = Admission(max_in_flight=1, max_queued=1)
    admission.request("run-a")
    admission.request("run-a")
    with pytest.raises(RateLimited):
        admission.request("run-a")
    admission.set_limits("run-b", RateLimit(max_queued=0))
    with pytest.raises(RateLimited):
        admission.request("run-b")  # no room now, and no queue


async def test_a_request_leaving_the_queue_frees_its_place_and_no_slot() -> None:
    admission = Admission(max_in_flight=1)
    serving = admission.request("run-a")
    gone = admission.request("run-a")
    kept = admission.request("run-b")
    gone.cancel()
    assert gone.admitted is not None and gone.admitted.cancelled()
    assert dict((run, q) for run, _, q in admission.runs()) == {"run-a": 0, "run-b": 1}
    serving.release()
    assert kept.ready and not gone.ready
    assert admission.in_flight == 1


async def test_releasing_twice_frees_one_slot() -> None:
    admission = Admission(max_in_flight=1)
    first = admission.request("run-a")
    second = admission.request("run-a")
    third = admission.request("run-a")
    first.release()
    first.release()
    assert second.ready and not third.ready


async def test_idle_runs_without_limits_are_forgotten() -> None:
    admission = Admission(max_in_flight=2)
    ticket = admission.request("run-a")
    ticket.release()
    assert list(admission.runs()) == []
    admission.set_limits("run-b", RateLimit(max_in_flight=1))
    assert [run for run, _, _ in admission.runs()] == ["run-b"]
    admission.set_limits("run-b", None)
    assert list(admission.runs()) == []


async def test_the_newest_session_sets_a_run_limits_unless_the_admin_did() -> None:
    admission = Admission()
    older, newer = RateLimit(max_in_flight=1), RateLimit(max_in_flight=3)
    admission.offer("run-a", newer, created_at=2.0)
    admission.offer("run-a", older, created_at=1.0)  # an older session, loaded later
    assert admission.limits_of("run-a") == (newer, "session")
    admin = RateLimit(max_in_flight=8)
    admission.set_limits("run-a", admin)
    admission.offer("run-a", older, created_at=3.0)
    assert admission.limits_of("run-a") == (admin, "admin")
    admission.set_limits("run-a", None)  # the admin lets the sessions decide again
    admission.offer("run-a", older, created_at=1.0)
    assert admission.limits_of("run-a") == (older, "session")
