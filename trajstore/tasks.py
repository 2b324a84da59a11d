"""Task directories in the Harbor layout, their verifiers' rewards, and how their commands start.

    TASKS_DIR/                     (or TASKS_DIR itself, when it holds a task.toml)
      add-numbers/
        task.toml                  [agent] timeout_sec, [verifier] timeout_sec and env, [metadata]
        instruction.md             what the agent is asked to do
        tests/test.sh              optional verifier: its reward file, printed score or exit status
        environment/, solution/    not used here (no containers: see `Runner`)

`trajstore run` (`trajstore.trials`) runs each task's agent and verifier through a `Runner`. The
one here, `LocalRunner`, starts them as local processes: this machine has no containers. A
sandbox runner (Docker, a remote VM) implements the same one method; docs/tasks.md says how
Harbor's container paths map to the local ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import math
import os
import re
import signal
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trajstore.store.events import MAX_ID_LENGTH

#: Harbor's default for both `[agent] timeout_sec` and `[verifier] timeout_sec`.
DEFAULT_TIMEOUT_S = 600.0
#: The verifier's entry point inside a task directory, as in Harbor.
VERIFIER = Path("tests") / "test.sh"
#: Inherited variables the agent and verifier never see: the orchestrator's own keys and URLs
#: (the admin key above all: the agent is untrusted) and any other endpoint's credentials.
_WITHHELD_PREFIXES = ("TRAJSTORE_", "OPENAI_", "ANTHROPIC_", "PGPASSWORD")
#: A score printed as the verifier's last line: `0.75`, `reward: 0.75`, `score = 1`.
_PRINTED_SCORE = re.compile(
    r"^(?:(?:reward|score)\s*[:=]\s*)?([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)$", re.IGNORECASE
)


class TaskDirError(ValueError):
    """A task directory is not in the Harbor layout; the message says which file and why."""


@dataclass(frozen=True)
class Task:
    """One task directory, as `task.toml` and `instruction.md` describe it."""

    task_id: str  #: `[task] name` (Harbor's schema 1.1), else the directory's name
    path: Path  #: the task directory (absolute)
    instruction: str
    agent_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_timeout_s: float = DEFAULT_TIMEOUT_S
    verifier_env: dict[str, str] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)  #: `[metadata]`, JSON-able
    config: dict[str, Any] = field(default_factory=dict)  #: the whole task.toml, for runners

    @property
    def verifier(self) -> Path | None:
        """`tests/test.sh`, or None when the task has no verifier (its sessions get no reward)."""
        script = self.path / VERIFIER
        return script if script.is_file() else None

    @property
    def tags(self) -> list[str]:
        """The task's tags (`[metadata] tags`, or `[task] keywords`): they tag its samples."""
        task_table = self.config.get("task")
        keywords = task_table.get("keywords") if isinstance(task_table, dict) else None
        for tags in (self.metadata.get("tags"), keywords):
            if isinstance(tags, list):
                return [str(tag) for tag in tags]
        return []


def _jsonable(value: Any) -> Any:
    """TOML values as JSON: dates and times (which TOML has and JSON lacks) become ISO text."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime.date | datetime.time):
        return value.isoformat()
    return value


def _table(config: dict[str, Any], name: str, source: Path) -> dict[str, Any]:
    table = config.get(name, {})
    if not isinstance(table, dict):
        raise TaskDirError(f"{source}: [{name}] must be a table")
    return table


def _timeout(table: dict[str, Any], section: str, source: Path) -> float:
    value = table.get("timeout_sec", DEFAULT_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise TaskDirError(
            f"{source}: [{section}] timeout_sec must be a positive number of seconds"
        )
    return float(value)


def parse_task_toml(text: str, source: Path) -> dict[str, Any]:
    """`task.toml`'s fields this runner uses, checked: `agent_timeout_s`, `verifier_timeout_s`,
    `verifier_env`, `metadata`, `name` (or None), and `config` (the whole file).

    Unknown tables and keys are kept in `config`, not refused: Harbor's schema grows, and a
    sandbox runner may want `[environment]`.
    """
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise TaskDirError(f"{source}: not valid TOML ({exc})") from exc
    agent, verifier = _table(config, "agent", source), _table(config, "verifier", source)
    env = verifier.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str | int | float) for v in env.values()):
        raise TaskDirError(f"{source}: [verifier] env must be a table of strings")
    task_table = _table(config, "task", source)
    name = task_table.get("name")
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise TaskDirError(f"{source}: [task] name must be a non-empty string")
    return {
        "name": name,
        "agent_timeout_s": _timeout(agent, "agent", source),
        "verifier_timeout_s": _timeout(verifier, "verifier", source),
        "verifier_env": {str(k): str(v) for k, v in env.items()},
        "metadata": _jsonable(_table(config, "metadata", source)),
        "config": _jsonable(config),
    }


def load_task(path: Path) -> Task:
    """The task in directory `path`; `TaskDirError` if its task.toml or instruction.md is
    missing or wrong."""
    path = path.resolve()
    toml_path, instruction_path = path / "task.toml", path / "instruction.md"
    if not toml_path.is_file():
        raise TaskDirError(f"{path}: no task.toml (Harbor layout: task.toml, instruction.md)")
    if not instruction_path.is_file():
        raise TaskDirError(f"{path}: no instruction.md, the agent's instruction")
    parsed = parse_task_toml(toml_path.read_text(), toml_path)
    task_id = parsed.pop("name") or path.name
    if len(task_id) > MAX_ID_LENGTH:
        raise TaskDirError(f"{path}: the task id is longer than {MAX_ID_LENGTH} characters")
    return Task(task_id=task_id, path=path, instruction=instruction_path.read_text(), **parsed)


def load_tasks(tasks_dir: Path) -> list[Task]:
    """The tasks of a directory of task directories (sorted by name), or of a single task
    directory; `TaskDirError` when there is none or two share an id."""
    if not tasks_dir.is_dir():
        raise TaskDirError(f"{tasks_dir}: not a directory")
    if (tasks_dir / "task.toml").is_file():
        return [load_task(tasks_dir)]
    tasks = [
        load_task(child)
        for child in sorted(tasks_dir.iterdir())
        if child.is_dir() and (child / "task.toml").is_file()
    ]
    if not tasks:
        raise TaskDirError(f"{tasks_dir}: no task directories (each holds a task.toml)")
    seen: dict[str, Path] = {}
    for task in tasks:
        if task.task_id in seen:
            raise TaskDirError(
                f"{seen[task.task_id]} and {task.path} have the same task id {task.task_id!r}"
            )
        seen[task.task_id] = task.path
    return tasks


# -- rewards -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """A verifier's reward and where it was read from."""

    reward: float
    source: str  #: reward.json | reward.txt | printed score | exit status
    components: dict[str, float] | None = None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_reward(verifier_dir: Path, stdout: str, exit_code: int) -> Verdict:
    """The reward of a verifier run, from the first of these that it gave:

    1. `reward.json` in its logs directory (Harbor's named rewards, `{"reward": 0.75, ...}`):
       the value is `reward`, or the only number, or the mean of them; all are the components;
    2. `reward.txt` there (Harbor's single number);
    3. a score printed as the last non-empty line of its stdout (`0.75`, `reward: 0.75`);
    4. its exit status: 0 is 1.0, anything else 0.0.

    A reward file that is there but unreadable is an error (`TaskDirError`), not a silent 0.
    """
    json_file, txt_file = verifier_dir / "reward.json", verifier_dir / "reward.txt"
    if json_file.is_file():
        try:
            named = json.loads(json_file.read_text())
        except ValueError as exc:
            raise TaskDirError(f"{json_file}: not JSON ({exc})") from exc
        if not isinstance(named, dict):
            raise TaskDirError(f"{json_file}: want an object of named rewards")
        components = {
            str(k): float(v)
            for k, v in named.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
        if not components:
            raise TaskDirError(f"{json_file}: no numeric reward in it")
        mean = sum(components.values()) / len(components)
        value = components.get("reward", mean)
        return Verdict(value, "reward.json", components if len(components) > 1 else None)
    if txt_file.is_file():
        written = _number(txt_file.read_text().strip())
        if written is None:
            raise TaskDirError(f"{txt_file}: want one number, got {txt_file.read_text()[:80]!r}")
        return Verdict(written, "reward.txt")
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if lines and (match := _PRINTED_SCORE.match(lines[-1])):
        printed = _number(match[1])
        if printed is not None:
            return Verdict(printed, "printed score")
    return Verdict(1.0 if exit_code == 0 else 0.0, "exit status")


# -- how commands start --------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """One command of a trial, the agent's or the verifier's, as a runner is asked to start it."""

    shell: str  #: a shell command line (`sh -c`), so `$TRAJSTORE_INSTRUCTION` expands in it
    cwd: Path
    env: dict[str, str]  #: added to the runner's base environment
    timeout_s: float
    stdout: Path  #: where its standard output goes
    stderr: Path


@dataclass(frozen=True)
class Outcome:
    """How a command ended."""

    exit_code: int | None  #: None when it was stopped at its timeout
    timed_out: bool
    seconds: float


class Runner(Protocol):
    """How the commands of a trial are started: the hook for sandboxes.

    `run` starts `command`, waits for it at most `command.timeout_s` seconds, stops it (and
    whatever it started) past that, and returns how it ended; when cancelled it stops the
    command before re-raising. A container runner would start it in the task's image with the
    task's `[environment]` (`Task.config`), map `cwd` and the paths in `env` into the container
    (docs/tasks.md: Harbor's /app, /tests and /logs), and copy the logs back to `stdout` /
    `stderr` and the verifier's logs directory; the proxy's base URL must be reachable from
    inside (`--public-url` of the proxy).
    """

    async def run(self, command: Command) -> Outcome: ...


def base_environment() -> dict[str, str]:
    """This process's environment without what an agent must not see (`_WITHHELD_PREFIXES`)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(_WITHHELD_PREFIXES)}


class LocalRunner:
    """Commands as local processes, each in its own process group, as this user.

    Not a sandbox: the agent can read and write whatever this user can. It does not see the
    orchestrator's keys (`base_environment`). At the timeout, or when the run is interrupted, the
    whole group gets SIGTERM, then SIGKILL after `kill_grace_s`; after a normal exit, whatever
    the command left running in its group is killed too, so no trial outlives its turn.
    """

    def __init__(self, kill_grace_s: float = 2.0) -> None:
        self.kill_grace_s = kill_grace_s

    async def run(self, command: Command) -> Outcome:
        """Start `command`, wait for it within its timeout, stop it past that (`Runner`)."""
        command.stdout.parent.mkdir(parents=True, exist_ok=True)
        command.stderr.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with command.stdout.open("wb") as out, command.stderr.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                "/bin/sh", "-c", command.shell, cwd=command.cwd,
                env={**base_environment(), **command.env},
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=err,
                start_new_session=True,  # its own process group: killed as one
            )  # fmt: skip
            try:
                code = await asyncio.wait_for(process.wait(), command.timeout_s)
            except TimeoutError:
                await self._stop(process)
                return Outcome(None, True, time.monotonic() - started)
            except asyncio.CancelledError:
                await asyncio.shield(self._stop(process))
                raise
            _signal_group(process.pid, signal.SIGKILL)  # leftovers of a command that exited
        return Outcome(code, False, time.monotonic() - started)

    async def _stop(self, process: asyncio.subprocess.Process) -> None:
        _signal_group(process.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(process.wait(), self.kill_grace_s)
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()


def _signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
