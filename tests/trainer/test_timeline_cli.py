"""`trajstore replay session ID` through the real `trajstore` entry point, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from click.testing import CliRunner, Result

from tests.conftest import free_port
from tests.store.test_timeline import Recorder, record_tool_session
from trajstore.cli import main
from trajstore.store import EventStore


def record(database_url: str) -> dict[str, int]:
    """The session of tests/store/test_timeline.py, stored; the positions of its events."""

    async def write() -> Recorder:
        async with await EventStore.open(database_url) as store:
            return await record_tool_session(store)

    return asyncio.run(write()).positions


def replay(database_url: str, *args: str) -> Result:
    runner = CliRunner(env={"COLUMNS": "200"})  # rich wraps at 80 columns when not on a tty
    return runner.invoke(main, ["--database-url", database_url, "replay", "session", *args])


@pytest.fixture
def positions(database_url: str) -> dict[str, int]:
    return record(database_url)


def test_the_timeline_shows_what_happened_in_order(database_url: str, positions: Any) -> None:
    result = replay(database_url, "s1")
    assert result.exit_code == 0, result.output
    out = result.output
    assert "status completed  reward 1.0  turns 3" in out
    # the tool result that came between the turns, the completions, the failure, the reward
    assert "tool: 5" in out
    assert "call add" in out and "five" in out
    assert "FAILED engine_error (502): engine went away" in out
    assert "reward 1.0" in out
    assert "250 ms  ttft 10 ms" in out  # the recorded timings of a turn
    table = out[out.index("┏") :]  # below the header
    order = [table.index(s) for s in ("call add", "tool: 5", "five", "FAILED", "reward 1.0")]
    assert order == sorted(order)
    assert str(positions["finished"]) in out  # positions to travel back to


def test_as_of_shows_the_session_as_it_stood(database_url: str, positions: Any) -> None:
    result = replay(database_url, "s1", "--as-of", str(positions["first chunk 1"]))
    assert result.exit_code == 0, result.output
    assert f"as of position {positions['first chunk 1']}" in result.output
    assert "status active  reward None  turns 2" in result.output
    assert "in_progress" in result.output
    assert "FAILED" not in result.output


def test_json_is_the_same_timeline_for_programs(database_url: str, positions: Any) -> None:
    result = replay(database_url, "s1", "--json")
    assert result.exit_code == 0, result.output
    document = orjson.loads(result.output)
    assert [e["kind"] for e in document["timeline"]] == [
        "created", "request", "completion", "request", "completion", "request", "failure",
        "reward", "finished",
    ]  # fmt: skip
    assert document["session"]["turns"][1]["choices"][0]["token_ids"] == [40, 41, 2]
    assert "mismatch" not in document

    earlier = orjson.loads(
        replay(database_url, "s1", "--json", "--as-of", str(positions["end 0"])).output
    )
    assert earlier["as_of"] == positions["end 0"]
    assert [e["kind"] for e in earlier["timeline"]] == ["created", "request", "completion"]


def test_unknown_sessions_and_positions_get_a_clear_message(
    database_url: str, positions: Any
) -> None:
    unknown = replay(database_url, "nope")
    assert unknown.exit_code == 1
    assert "Error: no session 'nope' in the store" in unknown.output
    assert "Traceback" not in unknown.output

    nowhere = replay(database_url, "s1", "--as-of", "999999")
    assert nowhere.exit_code == 1
    assert "no event at position 999999" in nowhere.output

    too_early = replay(database_url, "s1", "--as-of", "0")
    assert too_early.exit_code == 2  # a usage error: positions start at 1


def test_turns_that_name_no_model_are_not_sent(database_url: str, positions: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: nothing may be sent there
    result = replay(database_url, "s1", "--against", url, "--json")
    assert result.exit_code == 0, result.output
    mismatch = orjson.loads(result.output)["mismatch"]
    assert {t["note"] for t in mismatch["turns"]} == {"the turn names no model; pass one (--model)"}
    assert mismatch["overall"]["tokens"] == 0


def test_an_unreachable_engine_is_named(database_url: str, positions: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = replay(database_url, "s1", "--against", url, "--model", "tiny")
    assert result.exit_code == 1
    assert f"cannot reach the engine at {url}/v1/completions" in result.output
