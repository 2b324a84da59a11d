"""The trials of `trajstore run TASKS_DIR --agent CMD`: each agent through the proxy, graded.

For each attempt of each task (a trial), in the order attempt 1 of every task, then attempt 2...:

    a session (`trajstore.client`: run id, task id, group `<run id>/<task id>`, deadline: the
       agent's timeout)
    -> the agent command, with the session's base URL and key and the instruction in its
       environment, in a fresh workspace, stopped at `[agent] timeout_sec`
    -> the verifier (`tests/test.sh`) in the task directory, stopped at `[verifier] timeout_sec`
    -> its reward (the verifier's), its finish
       (`completed`; `timeout` when the agent or verifier ran out of time; `error` when the agent
       exited non-zero)

The command and its summary (pass rate, mean reward and tokens per task, what failed) are
`trajstore.run_cli`. The task layout, the reward rules and the runner hook live in
`trajstore.tasks`; docs/tasks.md is the user's page.
"""

from __future__ import annotations

import asyncio
import json
import re
import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx

from trajstore.client import AsyncClient, AsyncSession, ClientError, SessionClosed
from trajstore.tasks import (
    Command,
    Runner,
    Task,
    TaskDirError,
    Verdict,
    read_reward,
)

#: What a run id may be (it names a directory of the jobs folder).
RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
#: A task id as a directory name (Harbor's ids are `org/name`).
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]|^\.+$")
#: How much of a verifier's stdout is read for a printed score (its last line).
_STDOUT_TAIL_BYTES = 64 * 1024


@dataclass
class Trial:
    """One attempt of one task: its session and how it went."""

    task: Task
    attempt: int  #: 1-based
    dir: Path  #: workspace/, logs/agent/, logs/verifier/, instruction.md
    session_id: str | None = None
    status: str = "not started"  #: the session's finish status, once finished
    reward: float | None = None
    reward_source: str | None = None
    failures: list[str] = field(default_factory=list)  #: what went wrong, for the summary
    recorded: bool = False  #: the session was created and finished on the proxy
    agent_exit: int | None = None
    agent_s: float = 0.0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def workspace(self) -> Path:
        """The agent's working directory, which the verifier checks."""
        return self.dir / "workspace"

    @property
    def agent_logs(self) -> Path:
        return self.dir / "logs" / "agent"

    @property
    def verifier_logs(self) -> Path:
        """Where the verifier writes reward.txt / reward.json (Harbor's /logs/verifier)."""
        return self.dir / "logs" / "verifier"

    def result(self) -> dict[str, Any]:
        """One line of results.jsonl."""
        row = {k: v for k, v in asdict(self).items() if k not in ("task", "dir")}
        return {"task_id": self.task.task_id, "dir": str(self.dir), **row}


async def check_proxy(client: AsyncClient) -> None:
    """Fail early, with one clear line, when the proxy cannot be reached."""
    url = client.calls.url
    try:
        (await client.http.get(f"{url}/health")).raise_for_status()
    except httpx.HTTPError as exc:
        raise click.ClickException(f"the proxy at {url} does not answer: {exc}") from exc


async def served_model(client: AsyncClient, session: AsyncSession) -> str | None:
    """The first model the engines serve, asked as the session's agent would."""
    try:
        response = await client.http.get(
            f"{session.base_url}/models", headers={"Authorization": f"Bearer {session.api_key}"}
        )
        return str(response.raise_for_status().json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None


def agent_environment(trial: Trial, session: AsyncSession, model: str | None) -> dict[str, str]:
    """What the agent finds in its environment: the variables agents already read, and ours."""
    env = {
        **session.env(),
        "TRAJSTORE_TASK_ID": trial.task.task_id,
        "TRAJSTORE_INSTRUCTION": trial.task.instruction,
        "TRAJSTORE_INSTRUCTION_FILE": str(trial.dir / "instruction.md"),
        "TRAJSTORE_WORKSPACE": str(trial.workspace),
        "TRAJSTORE_AGENT_LOGS_DIR": str(trial.agent_logs),
    }
    if model:
        env["TRAJSTORE_MODEL"] = model
    return env


def verifier_environment(trial: Trial) -> dict[str, str]:
    """What the verifier finds: where the agent worked and where to write its reward."""
    return {
        **trial.task.verifier_env,
        "TRAJSTORE_TASK_ID": trial.task.task_id,
        "TRAJSTORE_WORKSPACE": str(trial.workspace),
        "TRAJSTORE_TESTS_DIR": str(trial.task.path / "tests"),
        "TRAJSTORE_VERIFIER_DIR": str(trial.verifier_logs),
        "TRAJSTORE_AGENT_LOGS_DIR": str(trial.agent_logs),
    }


def _tail(path: Path) -> str:
    with path.open("rb") as file:
        file.seek(max(0, path.stat().st_size - _STDOUT_TAIL_BYTES))
        return file.read().decode(errors="replace")


@dataclass
class TrialLoop:
    """Runs trials against one proxy: the session calls, the agent, the verifier."""

    client: AsyncClient  #: the proxy's session API
    agent: str  #: the agent's shell command
    run_id: str
    runner: Runner
    model: str | None = None  #: given to the agent as TRAJSTORE_MODEL; None: asked of the proxy
    timeout_multiplier: float = 1.0

    async def run(self, trial: Trial) -> Trial:
        """One trial, start to finish; what failed is in `trial.failures`, never raised."""
        task = trial.task
        agent_timeout = task.agent_timeout_s * self.timeout_multiplier
        try:
            created = await self.client.create_session(
                self.run_id, task_id=task.task_id,
                group_id=f"{self.run_id}/{task.task_id}",  # the attempts of a task: one group
                metadata={"tags": task.tags, "attempt": trial.attempt,
                          "task_metadata": task.metadata, "source": "trajstore run"},
                deadline_s=agent_timeout,  # the proxy refuses the agent's calls past it, too
            )  # fmt: skip
        except ClientError as exc:
            trial.failures.append(f"no session: {exc}")
            return trial
        trial.session_id = created.session_id
        if self.model is None:
            self.model = await served_model(self.client, created) or ""
        try:
            status, reason, verdict = await self._agent_then_verifier(trial, created)
        except asyncio.CancelledError:
            # Interrupted: the runner stopped the processes; record why the session ended.
            await asyncio.shield(self._close(trial, created, "aborted", "interrupted", None))
            raise
        await self._close(trial, created, status, reason, verdict)
        return trial

    async def _agent_then_verifier(
        self, trial: Trial, created: AsyncSession
    ) -> tuple[str, str | None, Verdict | None]:
        task = trial.task
        trial.workspace.mkdir(parents=True, exist_ok=True)
        (trial.dir / "instruction.md").write_text(task.instruction)
        agent = await self.runner.run(Command(
            self.agent, trial.workspace, agent_environment(trial, created, self.model),
            task.agent_timeout_s * self.timeout_multiplier,
            trial.agent_logs / "stdout.txt", trial.agent_logs / "stderr.txt",
        ))  # fmt: skip
        trial.agent_exit, trial.agent_s = agent.exit_code, agent.seconds
        status, reason = "completed", None
        if agent.timed_out:
            status, reason = "timeout", f"agent timed out after {agent.seconds:.0f} s"
        elif agent.exit_code != 0:
            status, reason = "error", f"agent exited with status {agent.exit_code}"
        if reason:
            trial.failures.append(f"{reason} (log: {trial.agent_logs / 'stderr.txt'})")
        # The verifier runs whatever the agent's end: the work it left may still earn a reward.
        verifier = task.verifier
        if verifier is None:
            return status, reason, None
        trial.verifier_logs.mkdir(parents=True, exist_ok=True)
        outcome = await self.runner.run(Command(
            f"bash {shlex.quote(str(verifier))}", task.path, verifier_environment(trial),
            task.verifier_timeout_s * self.timeout_multiplier,
            trial.verifier_logs / "test-stdout.txt", trial.verifier_logs / "test-stderr.txt",
        ))  # fmt: skip
        if outcome.timed_out:
            why = f"verifier timed out after {outcome.seconds:.0f} s"
            trial.failures.append(f"{why} (log: {trial.verifier_logs / 'test-stdout.txt'})")
            return "timeout", reason or why, None
        assert outcome.exit_code is not None
        try:
            stdout = _tail(trial.verifier_logs / "test-stdout.txt")
            return status, reason, read_reward(trial.verifier_logs, stdout, outcome.exit_code)
        except (TaskDirError, OSError) as exc:
            trial.failures.append(f"no reward: {exc}")
            return status, reason, None

    async def _close(
        self, trial: Trial, created: AsyncSession, status: str, reason: str | None,
        verdict: Verdict | None,
    ) -> None:  # fmt: skip
        """Reward, finish, then read the recorded tokens back.

        The proxy may have finished the session first, as `timeout`, when the agent called past
        its deadline: that refusal is no failure, the recorded status stands.
        """
        try:
            if verdict is not None:
                await created.reward(verdict.reward, components=verdict.components,
                                     source=f"trajstore run: {verdict.source}")  # fmt: skip
                trial.reward, trial.reward_source = verdict.reward, verdict.source
            try:
                trial.status = await created.finish(status, reason=reason)
            except SessionClosed:
                trial.status = str((await created.turns())["status"])
            trial.recorded = True
            recorded = await created.turns()
        except ClientError as exc:
            trial.failures.append(f"not recorded: {exc}")
            return
        for turn in recorded.get("turns", []):
            trial.turns += 1
            trial.prompt_tokens += turn.get("n_prompt_tokens") or 0
            trial.completion_tokens += sum(len(c.get("token_ids") or []) for c in turn["choices"])


async def run_trials(
    tasks: Sequence[Task], loop: TrialLoop, *, attempts: int, concurrency: int, jobs_dir: Path,
    on_done: Callable[[Trial], None] | None = None,
) -> list[Trial]:  # fmt: skip
    """Every attempt of every task, `concurrency` at once; the trials in the order they were
    planned. Each trial's directory is `jobs_dir/<run id>/<task id>/<attempt>`, and
    `jobs_dir/<run id>/results.jsonl` gets a line per trial as it ends."""
    run_dir = jobs_dir / loop.run_id
    trials = [
        Trial(task, attempt, run_dir / _SAFE_NAME.sub("_", task.task_id) / str(attempt))
        for attempt in range(1, attempts + 1)
        for task in tasks
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    limit = asyncio.Semaphore(concurrency)
    with (run_dir / "results.jsonl").open("a") as results:

        async def one(trial: Trial) -> None:
            async with limit:
                await loop.run(trial)
            results.write(json.dumps(trial.result()) + "\n")
            results.flush()
            if on_done is not None:
                on_done(trial)

        await asyncio.gather(*(one(trial) for trial in trials))
    return trials
