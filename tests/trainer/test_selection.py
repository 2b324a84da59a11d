"""Selection: which samples a trainer gets, checked against a real `samples` table."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tests.trainer.rows import insert_samples, sample_row
from trajstore.store import EventStore
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.selection import Selection

T0 = datetime(2026, 1, 1, tzinfo=UTC)


async def selected(store: EventStore, selection: Selection) -> list[str]:
    where, arguments = selection.where()
    async with store.pool.acquire() as conn:
        rows = await conn.fetch(
            f"SELECT session_id FROM samples WHERE {where} ORDER BY session_id", *arguments
        )
    return [row["session_id"] for row in rows]


@pytest.fixture
async def rows(store: EventStore) -> None:
    async with store.pool.acquire() as conn:
        await insert_samples(
            conn,
            [
                sample_row(session_id="a", run_id="run-1", reward=1.0, tags=["math", "easy"],
                           finished_at=T0, policy_versions=[3, 4]),
                sample_row(session_id="b", run_id="run-1", reward=0.0, tags=["math"],
                           finished_at=T0 + timedelta(hours=1), policy_versions=[1]),
                sample_row(session_id="c", run_id="run-2", reward=None, tags=[],
                           finished_at=T0 + timedelta(hours=2), policy_versions=[5]),
                sample_row(session_id="d", run_id="run-1", status="timeout", reward=0.5,
                           finished_at=T0, policy_versions=[4]),
                sample_row(session_id="e", run_id="run-1", is_final=False, reward=0.5,
                           finished_at=T0, policy_versions=[]),
                sample_row(session_id="old", run_id="run-1", projection_version=7),
            ],
        )  # fmt: skip


@pytest.mark.usefixtures("rows")
async def test_default_selects_completed_samples_of_the_served_version(store: EventStore) -> None:
    assert await selected(store, Selection()) == ["a", "b", "c", "e"]


@pytest.mark.usefixtures("rows")
@pytest.mark.parametrize(
    ("selection", "expected"),
    [
        (Selection(runs=("run-2",)), ["c"]),
        (Selection(runs="run-2"), ["c"]),  # a lone string is one run, not its characters
        (Selection(statuses=("completed", "timeout")), ["a", "b", "c", "d", "e"]),
        (Selection(statuses=("timeout",)), ["d"]),
        (Selection(since=T0 + timedelta(hours=1)), ["b", "c"]),
        (Selection(until=T0 + timedelta(hours=1)), ["a", "e"]),  # half-open window
        (Selection(min_reward=0.5), ["a", "e"]),  # no reward yet: left out by a reward range
        (Selection(max_reward=0.5), ["b", "e"]),
        (Selection(tags=("math",)), ["a", "b"]),
        (Selection(tags=("math", "easy")), ["a"]),  # every tag must be present
        (Selection(final_only=True), ["a", "b", "c"]),
        (Selection(min_policy_version=3), ["a", "c"]),  # every turn's version in the range
        (Selection(max_policy_version=4), ["a", "b"]),
        (Selection(max_staleness=1, current_policy_version=5), ["c"]),
        (Selection(max_staleness=2, current_policy_version=5), ["a", "c"]),
        (Selection(projection_version=7), ["old"]),
    ],
)
async def test_each_criterion_narrows_the_selection(
    store: EventStore, selection: Selection, expected: list[str]
) -> None:
    assert await selected(store, selection) == expected


@pytest.mark.usefixtures("rows")
async def test_the_served_version_is_read_after_a_rebuild_switches_it(store: EventStore) -> None:
    async with store.pool.acquire() as conn:
        await conn.execute("INSERT INTO projection_serving (name, version) VALUES ('samples', 7)")
    assert await selected(store, Selection()) == ["old"]


def test_parameters_are_numbered_from_the_given_one_and_values_never_enter_the_text() -> None:
    where, arguments = Selection(runs=("x'; DROP TABLE samples; --",), min_reward=0.5).where(4)
    assert "DROP" not in where
    assert "$4::" in where
    assert f"${4 + len(arguments) - 1}::" in where
    assert f"${4 + len(arguments)}" not in where


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"since": datetime(2026, 1, 1)}, "timezone-aware"),
        ({"min_reward": 1.0, "max_reward": 0.0}, "nothing fits"),
        ({"min_policy_version": "3"}, "integer"),
        ({"max_staleness": 2}, "needs current_policy_version"),
        ({"max_staleness": -1, "current_policy_version": 3}, ">= 0"),
        ({"statuses": ()}, "statuses is empty"),
        ({"tags": ("math", "")}, "non-empty strings"),
        ({"min_reward": True}, "must be a number"),
    ],
)
def test_bad_selections_say_what_to_fix(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BadSelection, match=message):
        Selection(**kwargs)  # type: ignore[arg-type]


def test_a_selection_round_trips_through_json() -> None:
    selection = Selection(runs=("run-1",), since=T0, tags=("a",), max_staleness=1,
                          current_policy_version=3)  # fmt: skip
    assert Selection.from_json(selection.as_json()) == selection
