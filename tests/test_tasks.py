"""`trajstore run`: task.toml and rewards (unit), trials through a real proxy (integration), the
command in a subprocess, and a toy agent against a real vLLM."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory
from trajstore.client import AsyncClient
from trajstore.run_cli import print_summary
from trajstore.store import EventStore
from trajstore.tasks import (
    Command,
    LocalRunner,
    TaskDirError,
    load_task,
    load_tasks,
    parse_task_toml,
    read_reward,
)
from trajstore.trials import TrialLoop, run_trials

# -- task.toml -----------------------------------------------------------------------------------

HARBOR_1_0 = """\
version = "1.0"

[metadata]
author_name = "Ada"
difficulty = "easy"
category = "programming"
tags = ["trivial", "alpine"]
created = 2025-01-02

[verifier]
timeout_sec = 120.0
env = { MODE = "strict", LEVEL = 2 }

[agent]
timeout_sec = 300

[environment]
build_timeout_sec = 600.0
cpus = 1
memory_mb = 2048
"""


def test_harbor_task_toml_gives_timeouts_metadata_and_the_verifier_env() -> None:
    parsed = parse_task_toml(HARBOR_1_0, Path("task.toml"))
    assert parsed["agent_timeout_s"] == 300.0
    assert parsed["verifier_timeout_s"] == 120.0
    assert parsed["verifier_env"] == {"MODE": "strict", "LEVEL": "2"}
    assert parsed["metadata"]["tags"] == ["trivial", "alpine"]
    assert parsed["metadata"]["created"] == "2025-01-02"  # TOML dates become JSON text
    assert parsed["config"]["environment"]["memory_mb"] == 2048  # kept for sandbox runners
    assert parsed["name"] is None


def test_an_empty_task_toml_takes_harbors_defaults_and_schema_1_1_names_the_task() -> None:
    assert parse_task_toml("", Path("t"))["agent_timeout_s"] == 600.0
    assert parse_task_toml("", Path("t"))["verifier_timeout_s"] == 600.0
    named = parse_task_toml('schema_version = "1.1"\n[task]\nname = "org/add"\n'
                            'keywords = ["math"]\n', Path("t"))  # fmt: skip
    assert named["name"] == "org/add"


@pytest.mark.parametrize(
    "text",
    [
        "[agent]\ntimeout_sec = 0\n",
        "[agent]\ntimeout_sec = -1\n",
        '[verifier]\ntimeout_sec = "10"\n',
        "[verifier]\ntimeout_sec = inf\n",
        "[verifier]\nenv = { A = [1] }\n",
        "agent = 3\n",
        '[task]\nname = ""\n',
        "[agent\n",
    ],
)
def test_a_wrong_task_toml_is_refused_with_its_path(text: str) -> None:
    with pytest.raises(TaskDirError, match=r"task\.toml"):
        parse_task_toml(text, Path("some/task.toml"))


def write_task(
    root: Path, name: str, instruction: str, *, toml: str = "", verifier: str | None = None
) -> Path:
    """A task directory in the Harbor layout; `verifier` is the body of tests/test.sh."""
    path = root / name
    path.mkdir(parents=True)
    (path / "task.toml").write_text(toml)
    (path / "instruction.md").write_text(instruction)
    if verifier is not None:
        (path / "tests").mkdir()
        (path / "tests" / "test.sh").write_text(textwrap.dedent(verifier))
    return path


def test_tasks_are_the_subdirectories_with_a_task_toml_or_the_directory_itself(
    tmp_path: Path,
) -> None:
    write_task(tmp_path, "b-task", "do b", verifier="exit 0\n")
    write_task(tmp_path, "a-task", "do a", toml='[task]\nname = "org/a"\n[metadata]\ntags = ["x"]')
    (tmp_path / "notes").mkdir()  # no task.toml: not a task
    tasks = load_tasks(tmp_path)
    assert [t.task_id for t in tasks] == ["org/a", "b-task"]
    assert tasks[0].verifier is None and tasks[0].tags == ["x"]
    assert tasks[1].verifier == tmp_path.resolve() / "b-task" / "tests" / "test.sh"
    assert [t.instruction for t in load_tasks(tmp_path / "b-task")] == ["do b"]


def test_task_directories_that_cannot_run_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskDirError, match="no task directories"):
        load_tasks(tmp_path)
    (tmp_path / "lonely").mkdir()
    (tmp_path / "lonely" / "task.toml").write_text("")
    with pytest.raises(TaskDirError, match=r"no instruction\.md"):
        load_task(tmp_path / "lonely")
    write_task(tmp_path / "dup", "one", "x", toml='[task]\nname = "same"\n')
    write_task(tmp_path / "dup", "two", "y", toml='[task]\nname = "same"\n')
    with pytest.raises(TaskDirError, match="same task id"):
        load_tasks(tmp_path / "dup")


# -- rewards -------------------------------------------------------------------------------------


def test_reward_json_beats_reward_txt_beats_a_printed_score_beats_the_exit_status(
    tmp_path: Path,
) -> None:
    assert read_reward(tmp_path, "collected 3 items\n3 passed\n", 0).reward == 1.0
    assert read_reward(tmp_path, "", 1).source == "exit status"
    assert read_reward(tmp_path, "", 1).reward == 0.0
    for printed in ["0.25", "score: 0.25", "Reward = .25", "2.5e-1"]:
        verdict = read_reward(tmp_path, f"running\n{printed}\n\n", 1)
        assert (verdict.reward, verdict.source) == (0.25, "printed score"), printed
    (tmp_path / "reward.txt").write_text("0.5\n")
    assert (read_reward(tmp_path, "0.25", 0).reward, read_reward(tmp_path, "", 0).source) == (
        0.5,
        "reward.txt",
    )
    (tmp_path / "reward.json").write_text('{"reward": 0.75, "style": 0.5, "note": "ok"}')
    verdict = read_reward(tmp_path, "0.25", 1)
    assert (verdict.reward, verdict.source) == (0.75, "reward.json")
    assert verdict.components == {"reward": 0.75, "style": 0.5}
    (tmp_path / "reward.json").write_text('{"tests": 1, "style": 0.5}')
    assert read_reward(tmp_path, "", 0).reward == 0.75  # no `reward`: the mean of them


@pytest.mark.parametrize(("name", "text"), [("reward.txt", "passed"), ("reward.txt", "nan"),
                                        ("reward.json", "[1]"), ("reward.json", '{"a": "b"}'),
                                        ("reward.json", "{")])  # fmt: skip
def test_an_unreadable_reward_file_is_an_error_not_a_zero(
    tmp_path: Path, name: str, text: str
) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(TaskDirError, match=name):
        read_reward(tmp_path, "1.0", 0)


# -- the local runner ----------------------------------------------------------------------------


def _command(tmp_path: Path, shell: str, timeout_s: float = 10.0, **env: str) -> Command:
    return Command(shell, tmp_path, env, timeout_s, tmp_path / "out.txt", tmp_path / "err.txt")


def _gone(pid: int) -> bool:
    """The process is no more, or a zombie its new parent has not reaped yet."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


async def test_the_local_runner_stops_a_command_and_its_children_at_the_timeout(
    tmp_path: Path,
) -> None:
    started = time.monotonic()
    outcome = await LocalRunner(kill_grace_s=0.5).run(
        _command(tmp_path, "sleep 30 & echo $! > child.pid; sleep 30", timeout_s=0.5)
    )
    assert outcome.timed_out and outcome.exit_code is None
    assert time.monotonic() - started < 5
    child = int((tmp_path / "child.pid").read_text())
    await asyncio.sleep(0.1)
    assert _gone(child)  # the background child was killed with its group


async def test_the_agent_never_sees_the_orchestrators_keys(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAJSTORE_API_KEY", "admin-secret")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-real")
    outcome = await LocalRunner().run(
        _command(tmp_path, "env; exit 4", OPENAI_API_KEY="tss-session")
    )
    assert (outcome.exit_code, outcome.timed_out) == (4, False)
    env = (tmp_path / "out.txt").read_text()
    assert "admin-secret" not in env and "sk-real" not in env
    assert "OPENAI_API_KEY=tss-session" in env and "PATH=" in env


# -- trials through a real proxy -----------------------------------------------------------------

#: A toy agent: one model call with the official client, configured only by its environment.
TOY_AGENT = """\
import os, pathlib, sys, time
from openai import OpenAI

assert "TRAJSTORE_API_KEY" not in os.environ, "the admin key leaked to the agent"
instruction = os.environ["TRAJSTORE_INSTRUCTION"]
assert pathlib.Path(os.environ["TRAJSTORE_INSTRUCTION_FILE"]).read_text() == instruction
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY
reply = client.chat.completions.create(
    model=os.environ.get("TRAJSTORE_MODEL") or "tiny",
    messages=[{"role": "user", "content": instruction}], max_tokens=8,
)
pathlib.Path("answer.txt").write_text(os.environ["TRAJSTORE_SESSION_ID"] + " " +
                                      (reply.choices[0].message.content or ""))
if "SLEEP" in instruction:
    time.sleep(60)
if "CRASH" in instruction:
    sys.exit(3)
"""

#: The verifier of the passing task: the agent left an answer in its workspace.
ANSWERED = 'test -s "$TRAJSTORE_WORKSPACE/answer.txt"\n'


def write_suite(root: Path) -> Path:
    """Six tasks: passing, failing (agent crash), agent timeout, printed score, no verifier,
    verifier timeout."""
    long = "[agent]\ntimeout_sec = 60\n[verifier]\ntimeout_sec = 30\n"
    write_task(root, "passes", "Say hi.", toml=long + '[metadata]\ntags = ["easy"]\n',
               verifier=ANSWERED)  # fmt: skip
    write_task(root, "fails", "CRASH now.", toml=long, verifier="echo no; exit 1\n")
    write_task(root, "slow-agent", "SLEEP forever.", verifier="""\
        mkdir -p "$TRAJSTORE_VERIFIER_DIR"
        echo 0 > "$TRAJSTORE_VERIFIER_DIR/reward.txt"
    """, toml="[agent]\ntimeout_sec = 4\n[verifier]\ntimeout_sec = 30\n")  # fmt: skip
    write_task(root, "scored", "Say a number.", toml=long, verifier="echo 'score: 0.25'\n")
    write_task(root, "unverified", "Say anything.", toml=long)
    write_task(root, "slow-verifier", "Say slowly.", verifier="sleep 30\n",
               toml="[agent]\ntimeout_sec = 60\n[verifier]\ntimeout_sec = 1\n")  # fmt: skip
    return root


@pytest.fixture
def toy_agent(tmp_path: Path) -> str:
    """The toy agent's command line."""
    script = tmp_path / "toy_agent.py"
    script.write_text(TOY_AGENT)
    return f"{sys.executable} {script}"


async def trajectories(database_url: str, run_id: str) -> dict[str, list[dict[str, Any]]]:
    """The run's sessions from the store's `trajectories` view, by task."""
    async with await EventStore.open(database_url) as store:
        rows = await store.pool.fetch(
            "SELECT * FROM trajectories WHERE run_id = $1 ORDER BY created_at", run_id
        )
    by_task: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        session = {**row, "metadata": json.loads(row["metadata"])}
        by_task.setdefault(row["task_id"], []).append(session)
    return by_task


@pytest.mark.slow
async def test_every_attempt_is_a_session_with_its_status_reward_and_group(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str, tmp_path: Path,
    toy_agent: str, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("TRAJSTORE_API_KEY", "admin-secret")  # must not reach the agent
    proxy = await start_proxy([engine.url], api_key="admin-secret")
    tasks = load_tasks(write_suite(tmp_path / "tasks"))
    async with AsyncClient(proxy.url, api_key="admin-secret", timeout=30) as client:
        loop = TrialLoop(client, toy_agent, "run-tasks", LocalRunner(kill_grace_s=0.5))
        trials = await run_trials(
            tasks, loop, attempts=2, concurrency=2, jobs_dir=tmp_path / "jobs"
        )

    assert [(t.task.task_id, t.attempt) for t in trials[:2]] == [("fails", 1), ("passes", 1)]
    sessions = await trajectories(database_url, "run-tasks")
    assert sorted(sessions) == sorted(t.task_id for t in tasks)
    expected = {  # task: (status, reward)
        "passes": ("completed", 1.0),
        "fails": ("error", 0.0),
        "slow-agent": ("timeout", 0.0),
        "scored": ("completed", 0.25),
        "unverified": ("completed", None),
        "slow-verifier": ("timeout", None),
    }
    for task_id, (status, reward) in expected.items():
        rows = sessions[task_id]
        assert len(rows) == 2, task_id
        assert {(r["status"], r["reward"]) for r in rows} == {(status, reward)}, task_id
        assert {r["group_id"] for r in rows} == {f"run-tasks/{task_id}"}
        assert {r["metadata"]["attempt"] for r in rows} == {1, 2}
    # Every agent made its call (the sleeping one before its timeout) and it was recorded.
    assert all(r["turns"] == 1 for r in sessions["passes"] + sessions["scored"])
    assert sessions["passes"][0]["metadata"]["tags"] == ["easy"]

    by_id = {t.session_id: t for t in trials}
    for rows in sessions.values():
        for row in rows:
            trial = by_id[row["session_id"]]
            assert (trial.status, trial.reward) == (row["status"], row["reward"])
            assert trial.prompt_tokens == row["prompt_tokens"]
            assert trial.completion_tokens == row["completion_tokens"]
            answer = (trial.workspace / "answer.txt").read_text()
            assert answer.startswith(row["session_id"])  # each agent had its own session
    assert all(t.recorded for t in trials)
    results = (tmp_path / "jobs" / "run-tasks" / "results.jsonl").read_text().splitlines()
    assert len(results) == 12 and {json.loads(r)["task_id"] for r in results} == set(expected)

    console = Console(record=True, width=160)
    print_summary(console, "run-tasks", trials, threshold=1.0)
    text = console.export_text()
    assert "passes" in text and "100%" in text and "no verifier" in text
    assert "agent timed out" in text and "verifier timed out" in text
    assert "agent exited with status 3" in text


@pytest.mark.slow
async def test_the_command_runs_a_task_directory_against_a_proxy(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str, tmp_path: Path,
    toy_agent: str,
) -> None:  # fmt: skip
    proxy = await start_proxy([engine.url])
    task = write_task(tmp_path, "passes", "Say hi.", verifier=ANSWERED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "run", str(task), "--agent", toy_agent,
        "--proxy", proxy.url, "--run-id", "cli-run", "--attempts", "2", "--concurrency", "2",
        "--jobs-dir", str(tmp_path / "jobs"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (b.decode() for b in await asyncio.wait_for(child.communicate(), 120))
    assert child.returncode == 0, out + err
    assert "local processes" in out
    assert "passes" in out and "100%" in out
    sessions = await trajectories(database_url, "cli-run")
    assert [(r["status"], r["reward"]) for r in sessions["passes"]] == [("completed", 1.0)] * 2

    again = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "run", str(task), "--agent", toy_agent,
        "--proxy", proxy.url, "--run-id", "cli-run", "--jobs-dir", str(tmp_path / "jobs"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err_again = await asyncio.wait_for(again.communicate(), 60)
    assert again.returncode != 0 and b"already has results" in err_again


@pytest.mark.vllm
@pytest.mark.slow
async def test_a_toy_agent_runs_tasks_against_the_real_vllm(
    vllm: str, database_url: str, tmp_path: Path, toy_agent: str
) -> None:
    """No --proxy: the command starts the stack (here on the given engine) and projects the
    finished sessions into samples before it returns."""
    tasks = tmp_path / "tasks"
    write_task(tasks, "passes", "What is 2 plus 3?", verifier=ANSWERED)
    write_task(tasks, "scored", "What is 4 times 5?", verifier="echo 0.5\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJSTORE_")}
    env["TRAJSTORE_DATA_DIR"] = str(tmp_path / "data")
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajstore", "--database-url", database_url, "run", str(tasks),
        "--agent", toy_agent, "--engine", vllm, "--run-id", "vllm-run", "--attempts", "2",
        "--concurrency", "2", "--jobs-dir", str(tmp_path / "jobs"),
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = (b.decode() for b in await asyncio.wait_for(child.communicate(), 300))
    assert child.returncode == 0, out + err
    sessions = await trajectories(database_url, "vllm-run")
    assert {task: [(r["status"], r["reward"]) for r in rows] for task, rows in sessions.items()} \
        == {"passes": [("completed", 1.0)] * 2, "scored": [("completed", 0.5)] * 2}  # fmt: skip
    assert all(r["turns"] == 1 and r["completion_tokens"] > 0 for r in sessions["passes"])
    async with await EventStore.open(database_url) as store:
        sampled = await store.pool.fetchval(
            "SELECT count(DISTINCT session_id) FROM samples WHERE run_id = 'vllm-run'"
        )
    assert sampled == 4
