"""`trajstore run TASKS_DIR --agent CMD --run-id R`: the command, over the trials of
`trajstore.trials`, against a given proxy or a local stack of its own; then its summary: pass
rate, mean reward and tokens per task, and what failed (docs/tasks.md).
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trajstore.client import AsyncClient
from trajstore.tasks import LocalRunner, Task, TaskDirError, load_tasks
from trajstore.trials import RUN_ID, Trial, TrialLoop, check_proxy, run_trials

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
    if not RUN_ID.match(run_id) or run_id.strip(".") == "":
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
