"""`trajstore run TASKS_DIR --agent CMD --run-id R`: every task's agent through the proxy, graded.

For each attempt of each task (a trial), in the order attempt 1 of every task, then attempt 2...:

    a session (`trajstore.client`: run id, task id, group `<run id>/<task id>`, deadline: the
       agent's timeout)
    -> the agent command, with the session's base URL and key and the instruction in its
       environment, in a fresh workspace, stopped at `[agent] timeout_sec`
    -> the verifier (`tests/test.sh`) in the task directory, stopped at `[verifier] timeout_sec`
    -> its reward (the verifier's), its finish
       (`completed`; `timeout` when the agent or verifier ran out of time; `error` when the agent
       exited non-zero)

then a summary: pass rate, mean reward and tokens per task, and what failed. The task layout, the
reward rules and the runner hook live in `trajstore.tasks`; docs/tasks.md is the user's page.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click
import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trajstore.client import AsyncClient, AsyncSession, ClientError, SessionClosed
from trajstore.tasks import (
    Command,
    LocalRunner,
    Runner,
    Task,
    TaskDirError,
    Verdict,
    load_tasks,
    read_reward,
)

_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]{1,100}$")
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


# -- the summary ---------------------------------------------------------------------------------


def passed(trial: Trial, threshold: float) -> bool:
    """A trial passes when its reward reaches the threshold."""
    return trial.reward is not None and trial.reward >= threshold


def print_summary(console: Console, run_id: str, trials: Sequence[Trial], threshold: float) -> None:
    """Per task: attempts, passes, pass rate, mean reward, statuses, tokens; then the failures."""
    table = Table(title=f"run {run_id}: pass = reward >= {threshold:g}", title_justify="left")
    for column, justify in [
        ("task", "left"), ("attempts", "right"), ("passed", "right"), ("pass rate", "right"),
        ("mean reward", "right"), ("statuses", "left"), ("turns", "right"),
        ("prompt tokens", "right"), ("completion tokens", "right"),
    ]:  # fmt: skip
        table.add_column(column, justify=justify)  # type: ignore[arg-type]
    by_task: dict[str, list[Trial]] = {}
    for trial in trials:
        by_task.setdefault(trial.task.task_id, []).append(trial)
    for task_id, group in [*by_task.items(), ("all", list(trials))]:
        rewards = [t.reward for t in group if t.reward is not None]
        wins = sum(passed(t, threshold) for t in group)
        statuses = Counter(t.status for t in group)
        table.add_row(
            task_id, str(len(group)), str(wins),
            f"{wins / len(group):.0%}" if any(t.task.verifier for t in group) else "no verifier",
            f"{sum(rewards) / len(rewards):.3f}" if rewards else "-",
            ", ".join(f"{n} {s}" for s, n in sorted(statuses.items())),
            str(sum(t.turns for t in group)), str(sum(t.prompt_tokens for t in group)),
            str(sum(t.completion_tokens for t in group)),
            end_section=task_id == list(by_task)[-1],
        )  # fmt: skip
    console.print(table)
    failed = [t for t in trials if t.failures]
    if failed:
        console.print(f"\n[bold]failures[/] ({len(failed)} of {len(trials)} trials)")
        for trial in failed:
            for failure in trial.failures:
                console.print(
                    f"  {trial.task.task_id} #{trial.attempt} {trial.session_id or ''}: {failure}",
                    highlight=False,
                )


# -- the command ---------------------------------------------------------------------------------


async def run_against(
    console: Console, proxy_url: str, admin_key: str | None, tasks: list[Task],
    loop_args: dict[str, Any], *, attempts: int, concurrency: int, jobs_dir: Path,
) -> list[Trial]:  # fmt: skip
    """All trials against the proxy at `proxy_url`, under a progress bar."""
    async with AsyncClient(proxy_url, api_key=admin_key) as client:
        await check_proxy(client)
        loop = TrialLoop(client, runner=LocalRunner(), **loop_args)
        total = len(tasks) * attempts
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=console, transient=True) as progress:
            bar = progress.add_task(f"{len(tasks)} tasks x {attempts}", total=total)
            counts: Counter[str] = Counter()

            def done(trial: Trial) -> None:
                counts[trial.status] += 1
                described = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
                progress.update(bar, advance=1, description=f"trials: {described}")

            return await run_trials(tasks, loop, attempts=attempts, concurrency=concurrency,
                                    jobs_dir=jobs_dir, on_done=done)  # fmt: skip


async def _in_local_stack(
    console: Console, settings: Any, found: Any, model: str | None, **kwargs: Any
) -> list[Trial]:
    """`run_against` a proxy of our own (`trajstore.stack.serving`); then project what is left,
    so every finished session is a sample when the command returns."""
    from trajstore.stack import serving
    from trajstore.store.eventstore import EventStore
    from trajstore.store.projection import Projector

    async with serving(settings, found.database_url, poll_interval=0.5,
                       **found.role_urls()) as running:  # fmt: skip
        kwargs["loop_args"]["model"] = model or found.model
        trials = await run_against(console, running.url, settings.api_key, **kwargs)
    # The live projector stopped with the stack; one more pass catches the last finishes.
    async with await EventStore.open(found.projector_url or found.database_url) as store:
        await Projector(store).run_once()
    return trials


@click.command("run")
@click.argument("tasks_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--agent",
    "agent",
    required=True,
    help="The agent's shell command; its environment holds the session's "
    "OPENAI_BASE_URL/OPENAI_API_KEY (and ANTHROPIC_*) and TRAJSTORE_INSTRUCTION.",
)
@click.option("--run-id", default=None, help="Run id of the sessions [default: run-<random>].")
@click.option(
    "--attempts",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Attempts per task (one GRPO group per task).",
)
@click.option(
    "--concurrency",
    default=4,
    show_default=True,
    type=click.IntRange(1),
    help="Trials running at once.",
)
@click.option(
    "--proxy",
    "proxy_url",
    envvar="TRAJSTORE_PROXY_URL",
    show_envvar=True,
    help="The recording proxy's URL. Unset: start the local stack, as `trajstore up`.",
)
@click.option(
    "--api-key",
    envvar="TRAJSTORE_API_KEY",
    show_envvar=True,
    help="The proxy's admin key, if it has one (creating sessions needs it).",
)
@click.option(
    "--engine",
    "engines",
    multiple=True,
    help="Without --proxy: use this engine instead of a local vLLM (repeatable).",
)
@click.option(
    "--model",
    envvar="TRAJSTORE_MODEL",
    show_envvar=True,
    help="Model name given to the agent as TRAJSTORE_MODEL [default: the engine's].",
)
@click.option(
    "--jobs-dir",
    default=Path("jobs"),
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Where each trial's workspace and logs go (JOBS_DIR/RUN_ID/TASK/ATTEMPT).",
)
@click.option(
    "--timeout-multiplier",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0, min_open=True),
    help="Scales every task's agent and verifier timeouts.",
)
@click.option(
    "--pass-threshold",
    default=1.0,
    show_default=True,
    type=float,
    help="A trial passes when its reward is at least this.",
)
@click.pass_context
def run(
    ctx: click.Context, tasks_dir: Path, agent: str, run_id: str | None, attempts: int,
    concurrency: int, proxy_url: str | None, api_key: str | None, engines: tuple[str, ...],
    model: str | None, jobs_dir: Path, timeout_multiplier: float, pass_threshold: float,
) -> None:  # fmt: skip
    """Run an agent on task directories (Harbor layout), record and grade every attempt.

    Agents and verifiers run as local processes (no containers here): see docs/tasks.md.
    """
    try:
        tasks = load_tasks(tasks_dir)
    except TaskDirError as exc:
        raise click.ClickException(str(exc)) from exc
    run_id = run_id or f"run-{random.randrange(16**6):06x}"
    if not _RUN_ID.match(run_id) or run_id.strip(".") == "":
        raise click.BadParameter("letters, digits and . _ : - only", param_hint="--run-id")
    if (jobs_dir / run_id / "results.jsonl").exists():
        raise click.ClickException(
            f"run {run_id} already has results in {jobs_dir / run_id}; "
            "choose another --run-id or remove that directory"
        )
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(f"run {run_id}: {len(tasks)} tasks x {attempts} attempts, agents and "
                  "verifiers as local processes (no sandbox)", highlight=False)  # fmt: skip
    kwargs: dict[str, Any] = {
        "tasks": tasks, "attempts": attempts, "concurrency": concurrency,
        "jobs_dir": jobs_dir.resolve(),
        "loop_args": {"agent": agent, "run_id": run_id, "model": model,
                      "timeout_multiplier": timeout_multiplier},
    }  # fmt: skip
    started = time.monotonic()
    if proxy_url:
        trials = asyncio.run(run_against(console, proxy_url, api_key, **kwargs))
    else:
        from trajstore.proxy.options import engine_urls, proxy_settings
        from trajstore.stack import backends
        from trajstore.store.settings import store_settings_of

        urls = engine_urls(engines)
        settings = proxy_settings(urls, "127.0.0.1", 8400, True, None, "0")
        settings.api_key = api_key or settings.api_key
        with backends(store_settings_of(ctx), urls) as found:
            settings.engines = found.engines
            trials = asyncio.run(_in_local_stack(console, settings, found, model, **kwargs))
    print_summary(console, run_id, trials, pass_threshold)
    console.print(f"\n{len(trials)} trials in {time.monotonic() - started:.0f} s; logs and "
                  f"results.jsonl in {kwargs['jobs_dir'] / run_id}", highlight=False)  # fmt: skip
    lost = sum(not t.recorded for t in trials)
    if lost:
        raise click.ClickException(f"{lost} trials were not recorded by the proxy (see above)")
