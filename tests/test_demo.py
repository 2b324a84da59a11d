"""`trajstore demo`: its rules (unit) and the whole loop against a real vLLM (a subprocess)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from trajstore.demo import COLUMN_MEANINGS, Task, make_tasks, reward, run_tool
from trajstore.store import EventStore, EventType


def test_a_valid_tool_call_is_computed_and_an_invalid_one_is_told_what_to_send() -> None:
    assert run_tool("add", '{"a": 17, "b": 25}') == ('{"result": 42}', True)
    assert run_tool("multiply", '{"a": 6, "b": 7}') == ('{"result": 42}', True)
    for name, arguments in [
        ("add", "-Infinity"),  # what a random model writes under guided decoding
        ("add", '{"a": 1.5, "b": 2}'),
        ("add", '{"a": true, "b": 2}'),
        ("add", "{"),
        ("divide", '{"a": 1, "b": 2}'),
    ]:
        content, valid = run_tool(name, arguments)
        assert not valid
        assert content.startswith("error: ")


def test_the_reward_rule() -> None:
    task = Task("t", "add", 17, 25)
    assert reward(task, True, "42") == (1.0, {"valid_tool_call": 1.0, "correct": 1.0,
                                               "numeric": 1.0})  # fmt: skip
    assert reward(task, False, "43")[0] == 0.2  # a number, the wrong one
    assert reward(task, True, "it is 42")[0] == pytest.approx(0.4 + 0.4 + 0.2 * 2 / 8)
    assert reward(task, False, "")[0] == 0.0
    assert reward(task, False, "420")[1]["correct"] == 0.0  # the number, not a substring


def test_tasks_are_reproducible() -> None:
    assert make_tasks(5, seed=1) == make_tasks(5, seed=1)
    assert all(t.answer == (t.a + t.b if t.op == "add" else t.a * t.b) for t in make_tasks(20))


@pytest.mark.vllm
@pytest.mark.slow
async def test_demo_runs_agents_through_the_proxy_and_summarises_them(
    vllm: str, database_url: str, tmp_path: Path
) -> None:
    env = {**os.environ, "TRAJSTORE_DATA_DIR": str(tmp_path)}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "--database-url", database_url, "demo",
        "--engine", vllm, "--agents", "2", "--turns", "2", "--run-id", "demo-test",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out_bytes, err_bytes = await asyncio.wait_for(child.communicate(), 300)
    out, err = out_bytes.decode(), err_bytes.decode()
    assert child.returncode == 0, err
    assert "2 sessions (2 completed), 4 model calls" in " ".join(out.split())
    for title in ("rewards per task", "how completions ended", "samples and divergences"):
        assert title in out
    assert "FROM trajectories WHERE run_id = 'demo-test'" in out  # the SQL, as a reader pastes it
    assert "training: none" in out  # the engine was given: no local weights to train
    # Every column the summary prints is explained under its table, in one line.
    for meanings in COLUMN_MEANINGS.values():
        for column, meaning in meanings.items():
            assert f"{column}: {meaning}" in out
    samples_table = out[out.index("samples_per_session") :]
    assert "1.00" in samples_table.split("samples_per_session: ")[0]  # one sample a session

    # What the summary reports is in the store: both sessions, rewarded by the rule, projected.
    async with await EventStore.open(database_url) as store:
        sessions = await store.pool.fetchval(
            "SELECT count(DISTINCT session_id) FROM samples WHERE run_id = 'demo-test'"
        )
        samples, divergences = await store.pool.fetchrow(
            "SELECT (SELECT count(*) FROM samples WHERE run_id = 'demo-test'), "
            "sum(divergences) FROM trajectories WHERE run_id = 'demo-test'"
        )
        rewards = await store.pool.fetch(
            "SELECT payload FROM events WHERE run_id = 'demo-test' AND event_type = $1",
            EventType.REWARD_ASSIGNED.value,
        )
    assert sessions == 2
    assert len(rewards) == 2
    # The toy agents send back what they were given: each session is one sample, continued.
    assert samples == 2 and divergences == 0
    for row in rewards:
        payload = json.loads(row["payload"])
        assert set(payload["components"]) == {"valid_tool_call", "correct", "numeric"}
        assert payload["source"] == "trajstore.demo"
