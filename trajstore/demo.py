"""`trajstore demo`: the whole loop on one machine, in a few minutes.

    the stack of `trajstore up` (database, migrations, a local vLLM on the tiny model, the proxy,
    the live projector)
    -> N toy agents at once, each a multi-turn tool loop with the official `openai` client
    -> a rule-based reward and the finish of each session, through the proxy's session API
    -> the projector turns the sessions into samples
    -> training steps on those samples (`train_on_samples`, the trainer's recipe plugs in there)
    -> a summary: sessions, tokens, rewards per task, divergences, and the SQL that answered it

The toy task: "What is 17 plus 25?" with two tools, `add` and `multiply`. The agent makes the
model call the right tool on its first turn (a named `tool_choice`, which vLLM enforces with
guided decoding), runs the call, sends the result back, and asks for the answer on later turns.
The model's weights are random, so its tool arguments are mostly invalid and its answers wrong:
the demo shows the plumbing (token-exact records, tool turns, rewards, divergences), not skill.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
from openai import APIError, AsyncOpenAI
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from trajstore.client import AsyncClient
from trajstore.proxy.options import proxy_settings
from trajstore.stack import backends, serving, viewer_settings
from trajstore.store import sample_reads
from trajstore.store.eventstore import EventStore
from trajstore.store.settings import store_settings_of
from trajstore.store.sql import print_query
from trajstore.tiny_model import arithmetic_tool

#: The tools of the toy world the tiny model's tokenizer was trained on.
TOOLS: list[dict[str, Any]] = [arithmetic_tool(name) for name in ("add", "multiply")]
SYSTEM_PROMPT = "Use the tools to compute. Then answer with the number only."
_RUN_ID = re.compile(r"^[A-Za-z0-9._:-]+$")


@dataclass(frozen=True)
class Task:
    """One question of the toy task."""

    task_id: str
    op: str  #: the tool that computes it: add | multiply
    a: int
    b: int

    @property
    def question(self) -> str:
        word = "plus" if self.op == "add" else "times"
        return f"What is {self.a} {word} {self.b}?"

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "add" else self.a * self.b


#: Agents that answer the same question: a GRPO group (a group of one has no advantage).
GROUP_SIZE = 2


def make_tasks(count: int, seed: int = 0) -> list[Task]:
    """`count` questions; the seed picks them."""
    rng = random.Random(seed)
    return [
        Task(f"task-{i}", rng.choice(["add", "multiply"]), rng.randint(2, 99), rng.randint(2, 99))
        for i in range(count)
    ]


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """Run a tool call as the model wrote it: (the tool message's content, whether it was valid).

    An invalid call gets an error message back, as real agent frameworks do, so the model could
    correct itself on the next turn.
    """
    try:
        args = json.loads(arguments)
    except ValueError:
        return 'error: the arguments are not JSON; send {"a": <int>, "b": <int>}', False
    if name not in ("add", "multiply"):
        return f"error: no tool named {name!r}; use add or multiply", False
    if not (isinstance(args, dict) and all(type(args.get(k)) is int for k in ("a", "b"))):
        return 'error: send two integers as {"a": <int>, "b": <int>}', False
    result = args["a"] + args["b"] if name == "add" else args["a"] * args["b"]
    return json.dumps({"result": result}), True


def reward(task: Task, valid_tool_call: bool, answer: str) -> tuple[float, dict[str, float]]:
    """The rule-based reward and its parts: a valid tool call, a correct answer, and a little
    credit for answering with digits at all (so that random answers are not all equal)."""
    text = answer.strip()
    parts = {
        "valid_tool_call": float(valid_tool_call),
        "correct": float(str(task.answer) in re.findall(r"-?\d+", text)),
        "numeric": sum(c.isdigit() for c in text) / len(text) if text else 0.0,
    }
    value = 0.4 * parts["valid_tool_call"] + 0.4 * parts["correct"] + 0.2 * parts["numeric"]
    return round(value, 4), parts


@dataclass
class AgentResult:
    """What one agent did, as the summary reports it."""

    task: Task
    session_id: str
    status: str = "completed"
    turns: int = 0
    tool_calls: int = 0
    valid_tool_calls: int = 0
    reward: float = 0.0
    parts: dict[str, float] = field(default_factory=dict)


async def run_agent(
    client: AsyncClient,
    run_id: str,
    task: Task,
    *,
    model: str,
    turns: int,
    max_tokens: int,
    advance: Callable[[], None],
) -> AgentResult:
    """One episode: a session, up to `turns` model calls with tools, a reward, the finish."""
    async with client.session(run_id, task_id=task.task_id, group_id=task.task_id,
                              metadata={"tags": ["demo"]}) as session:  # fmt: skip
        result = AgentResult(task, session.session_id)
        agent = AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
        try:
            answer = await _converse(agent, task, result, model=model, turns=turns,
                                     max_tokens=max_tokens, advance=advance)  # fmt: skip
        except APIError as exc:
            result.status = "error"
            await session.finish("error", reason=f"{type(exc).__name__}: {exc}")
            return result
        finally:
            for _ in range(turns - result.turns):
                advance()  # the bar counts turns; an agent that stopped early gives the rest back
            await agent.close()
        result.reward, result.parts = reward(task, result.valid_tool_calls > 0, answer)
        await session.reward(result.reward, components=result.parts, source="trajstore.demo")
    return result


async def _converse(
    agent: AsyncOpenAI,
    task: Task,
    result: AgentResult,
    *,
    model: str,
    turns: int,
    max_tokens: int,
    advance: Callable[[], None],
) -> str:
    """The agent's side of the episode: model calls and tool calls; its last answer."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": task.question},
    ]
    answer = ""
    for turn in range(turns):
        # First turn: this agent always computes with a tool, so it names the tool to call.
        choice: Any = {"type": "function", "function": {"name": task.op}} if turn == 0 else "auto"
        reply = await agent.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=max_tokens, temperature=1.0,
        )  # fmt: skip
        result.turns += 1
        advance()
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the history, as sent back
        if message.tool_calls:
            for call in message.tool_calls:
                name, arguments = call.function.name, call.function.arguments  # type: ignore[union-attr]
                content, valid = run_tool(name, arguments)
                result.tool_calls += 1
                result.valid_tool_calls += valid
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
            continue
        answer = message.content or ""
        if str(task.answer) in re.findall(r"-?\d+", answer):
            break
        messages.append({"role": "user", "content": "Answer with the number only."})
    return answer


async def wait_for_samples(
    store: EventStore, projector: asyncio.Task[None], run_id: str, sessions: int, timeout: float
) -> None:
    """Wait until the live projector has made samples of all `sessions` of the run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (done := await sample_reads.sessions_with_samples(store, run_id)) < sessions:
        if projector.done():
            projector.result()  # raise why it stopped
            raise click.ClickException("the projector stopped; see the errors above")
        if loop.time() > deadline:
            raise click.ClickException(
                f"the projector made samples of {done} of {sessions} sessions in {timeout:.0f} s; "
                "is the projection failing? (run with -v)"
            )
        await asyncio.sleep(0.2)


async def train_on_samples(
    database_url: str,
    run_id: str,
    model_dir: Path | None,
    steps: int,
    on_step: Callable[[dict[str, float]], None] | None = None,
) -> list[dict[str, float]] | None:
    """A few off-policy GRPO steps (`trainer.recipe`) on the run's samples; each step's metrics.

    None when there is nothing to train: no local model (the engine was given with --engine, so
    its weights are not here) or no completed sample in the run.
    """
    from trajstore.trainer.recipe import train_steps

    if model_dir is None:
        return None
    async with await EventStore.open(database_url) as store:
        if not await sample_reads.completed_samples(store, run_id):
            return None
    return await train_steps(
        database_url, run_id, model_dir, steps, training_run=f"{run_id}-train", on_step=on_step
    )


def summary_queries(run_id: str) -> dict[str, str]:
    """The SQL the summary shows with its answers, over the README's views (paste-able as is)."""
    run = run_id.replace("'", "''")
    return {
        "rewards per task": (
            "SELECT task_id, count(*) AS sessions, round(avg(reward)::numeric, 3) AS mean_reward,\n"
            "       sum(tool_turns) AS tool_turns, sum(prompt_tokens) AS prompt_tokens,\n"
            "       sum(completion_tokens) AS completion_tokens\n"
            f"FROM trajectories WHERE run_id = '{run}'\n"
            "GROUP BY task_id ORDER BY task_id"
        ),
        "how completions ended": (
            "SELECT finish_reason, count(*) AS turns, sum(n_tool_calls) AS tool_calls,\n"
            "       round(avg(ttft_s)::numeric, 3) AS mean_ttft_s\n"
            f"FROM turns WHERE run_id = '{run}' AND status = 'completed'\n"
            "GROUP BY finish_reason ORDER BY turns DESC"
        ),
        # One sample per session when every turn extends the last (proxy.continuation); the
        # view counts each session's samples in the served projection, alternatives left out.
        "samples and divergences": (
            "SELECT count(*) AS sessions, sum(turns) AS turns,\n"
            "       sum(continued_turns) AS continued_turns, sum(drift_avoided) AS drift_avoided,\n"
            "       sum(samples) AS samples,\n"
            "       round(sum(samples)::numeric / nullif(count(*), 0), 2) AS samples_per_session,\n"
            "       sum(divergences) AS divergences\n"
            f"FROM trajectories WHERE run_id = '{run}'"
        ),
    }


#: One line per column the summary prints, under its table.
COLUMN_MEANINGS: dict[str, dict[str, str]] = {
    "rewards per task": {
        "sessions": "sessions of the task in this run",
        "mean_reward": "their mean reward (1: the right answer, 0: wrong or none)",
        "tool_turns": "turns in which the model called a tool",
        "prompt_tokens": "tokens the engine read, summed over turns",
        "completion_tokens": "tokens the engine generated, summed over turns",
    },
    "how completions ended": {
        "finish_reason": "why the engine stopped: stop (end of answer), tool_calls, length",
        "turns": "model calls that ended so",
        "tool_calls": "tool calls they made",
        "mean_ttft_s": "mean seconds from the request to the first generated token",
    },
    "samples and divergences": {
        "turns": "model calls of the run's sessions",
        "continued_turns": "turns sent to the engine as the previous turn's tokens + the new ones",
        "drift_avoided": "of those, turns where re-rendering the text would have changed tokens",
        "samples": "training samples the projector made (one per unbroken line of turns)",
        "samples_per_session": "1.00 when every session became one sample",
        "divergences": "places where a turn's prompt did not extend the previous turn's tokens",
    },
}


async def print_summary(
    console: Console, store: EventStore, run_id: str, results: Sequence[AgentResult],
    training: list[dict[str, float]] | None,
) -> None:  # fmt: skip
    """Sessions and tools from the agents' side, then the three queries and their answers."""
    statuses = Counter(r.status for r in results)
    console.print(
        f"\n[bold]run {run_id}[/]: {len(results)} sessions "
        f"({', '.join(f'{n} {s}' for s, n in sorted(statuses.items()))}), "
        f"{sum(r.turns for r in results)} model calls, {sum(r.tool_calls for r in results)} tool "
        f"calls ({sum(r.valid_tool_calls for r in results)} valid)"
    )
    for title, sql in summary_queries(run_id).items():
        console.print(f"\n[bold]{title}[/]")
        console.print(sql, style="dim", highlight=False)
        await print_query(store, sql, console=console)
        for column, meaning in COLUMN_MEANINGS[title].items():
            console.print(f"  {column}: {meaning}", style="dim", highlight=False)
    if training is None:
        console.print("\ntraining: none (no local model, or no completed sample)")
        return
    columns = ("step", "loss", "reward_mean", "ratio_mean", "kl_k3", "missing_behaviour_fraction")
    caption = (
        "loss: the clipped policy loss; reward_mean: the batch's mean reward; ratio_mean: the "
        "mean importance ratio, current ÷ behaviour probability; kl_k3: the k3 estimate of "
        "KL(behaviour ‖ current); missing_behaviour_fraction: the share of generated tokens "
        "with no behaviour logprob, left out of the loss (turns the engine decoded under a "
        "constraint, such as a forced tool call: its logprobs are of the masked distribution)"
    )
    table = Table(title="training steps (trainer.recipe: GRPO, off-policy)", title_justify="left",
                  caption=caption, caption_justify="left")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="right")
    for metrics in training:
        table.add_row(*(f"{metrics.get(c, float('nan')):.4g}" for c in columns))
    console.print()
    console.print(table)


async def run_demo(
    console: Console,
    settings: Any,
    database_url: str,
    *,
    model: str,
    run_id: str,
    agents: int,
    turns: int,
    max_tokens: int,
    seed: int,
    model_dir: Path | None,
    train_steps: int,
    role_urls: dict[str, str] | None = None,
    ui: Any = None,
) -> str | None:
    """Serve the stack, run the agents at once, wait for their samples, summarise; with `ui`
    (`ViewerSettings`) the viewer is served meanwhile. Returns the run's page in the viewer."""
    # Each question goes to GROUP_SIZE agents (one GRPO group): advantages compare their rewards.
    questions = make_tasks((agents + GROUP_SIZE - 1) // GROUP_SIZE, seed)
    tasks = [question for question in questions for _ in range(GROUP_SIZE)][:agents]
    async with (
        serving(settings, database_url, poll_interval=0.5, **(role_urls or {}), ui=ui) as running,
        AsyncClient(running.url, api_key=settings.api_key, timeout=120) as client,
        await EventStore.open(database_url) as store,
    ):
        run_page = f"{running.ui_url}/runs/{run_id}" if running.ui_url else None
        if run_page:
            console.print(f"watch the sessions live: {run_page}")
        with Progress(console=console, transient=True) as progress:
            bar = progress.add_task(f"{agents} agents, {turns} turns each", total=agents * turns)

            def advance() -> None:
                progress.advance(bar)

            results = await asyncio.gather(*(
                run_agent(client, run_id, task, model=model, turns=turns,
                          max_tokens=max_tokens, advance=advance)
                for task in tasks
            ))  # fmt: skip
        with console.status("the projector turns the sessions into samples"):
            await wait_for_samples(store, running.projecting, run_id, len(results), timeout=60)
    with Progress(console=console, transient=True) as progress:
        bar = progress.add_task(f"training {train_steps} steps on the samples", total=train_steps)
        training = await train_on_samples(
            database_url, run_id, model_dir, train_steps, lambda _: progress.advance(bar)
        )
    async with await EventStore.open(database_url) as store:
        await print_summary(console, store, run_id, results, training)
    return run_page


@click.command("demo")
@click.option("--agents", default=4, show_default=True, help="Agents running at once.")
@click.option("--turns", default=3, show_default=True, help="Model calls per agent, at most.")
@click.option("--max-tokens", default=64, show_default=True,
              help="Tokens per model call (random models write long tool arguments).")  # fmt: skip
@click.option("--run-id", default=None, help="Run id of the sessions [default: demo-<random>].")
@click.option("--seed", default=0, show_default=True, help="Picks the questions.")
@click.option("--train-steps", default=3, show_default=True,
              help="Training steps on the samples (0: none; needs the local model).")  # fmt: skip
@click.option("--engine", "engines", multiple=True,
              help="Use this engine instead of starting a local vLLM (repeatable).")  # fmt: skip
@click.option(
    "--ui",
    is_flag=True,
    help="Serve the trajectory viewer while the demo runs; print the run's page.",
)
@click.pass_context
def demo(
    ctx: click.Context,
    agents: int,
    turns: int,
    max_tokens: int,
    run_id: str | None,
    seed: int,
    train_steps: int,
    engines: tuple[str, ...],
    ui: bool,
) -> None:
    """The whole loop: toy agents through the proxy, rewards, samples, a summary."""
    run_id = run_id or f"demo-{random.randrange(16**6):06x}"
    if not _RUN_ID.match(run_id):
        raise click.BadParameter("letters, digits and . _ : - only", param_hint="--run-id")
    if agents < 1 or turns < 1 or max_tokens < 1:
        raise click.UsageError("--agents, --turns and --max-tokens must be at least 1")
    # Not on a terminal (CI, a log file), rich would cut every table at 80 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    settings = proxy_settings(list(engines), "127.0.0.1", 8400, True, None, "0")
    with backends(store_settings_of(ctx), list(engines)) as found:
        settings.engines = found.engines
        viewer = viewer_settings("127.0.0.1", 8500, found.model_dir) if ui else None
        if ui and viewer is None:
            raise click.UsageError("--ui needs the viewer: pip install 'trajstore[ui]'")
        run_page = asyncio.run(
            run_demo(console, settings, found.database_url, model=found.model, run_id=run_id,
                     role_urls=found.role_urls(), ui=viewer,
                     agents=agents, turns=turns, max_tokens=max_tokens, seed=seed,
                     model_dir=found.model_dir if train_steps else None, train_steps=train_steps)
        )  # fmt: skip
    console.print(f"\nSQL: {found.sql_url}")
    if run_page:
        # The demo's viewer stopped with it; `trajstore ui` (or `up`) serves the page again.
        console.print(f"viewer: {run_page} (serve it again with: trajstore ui)")
