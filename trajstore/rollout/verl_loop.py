"""A verl agent loop that records through trajstore: `agent_name: trajstore`.

verl (https://github.com/volcengine/verl) runs one agent loop per prompt of a rollout
(`verl.experimental.agent_loop`). This one does not drive the model itself. Per prompt it:

1. creates a trajstore session (`trajstore.client`: run_id, task_id, and group_id = verl's
   `uid`, which the n rollouts of one prompt share, so GRPO groups are trajstore groups);
2. runs the configured agent against the session: a Python coroutine
   `agent(base_url, api_key, prompt) -> reward | None`, or a command with `OPENAI_BASE_URL`,
   `OPENAI_API_KEY`, `ANTHROPIC_BASE_URL`, `ANTHROPIC_API_KEY`, `TRAJSTORE_SESSION_ID` and
   `TRAJSTORE_PROMPT` (the prompt's messages as JSON, also on its stdin) in its environment,
   whose reward is the last line of its stdout (a number, or JSON with a `reward`);
3. assigns the reward and finishes the session (`completed`; an
   agent that raised or exited non-zero: `error`; past `timeout_s`: `timeout`; cancelled:
   `aborted`), both with the session's orchestrator key;
4. reads the recorded session back from PostgreSQL and returns verl's `AgentLoopOutput` built
   from its sample (`store.samples`), token for token: prompt_ids are the tokens before the first
   generated one, response_ids the rest, response_mask the sample's loss mask over them (tool
   results and user messages 0), response_logprobs the engine's behaviour logprobs,
   reward_score the session's reward. When a history diverged the session has several
   branches: the final one is returned, and `extra_fields` says how many there were.

The model calls never go through verl's `server_manager`: the agent talks to the proxy, and the
proxy to the engines (on a GPU machine, the vLLM servers verl started for its rollout).

Configuration: keyword arguments in verl's agent loop config file
(`actor_rollout_ref.rollout.agent.agent_loop_config_path`), each falling back to an environment
variable (set it in Ray's `runtime_env` so that every agent loop worker sees it):

    proxy_url        TRAJSTORE_PROXY_URL        the proxy, e.g. http://127.0.0.1:8400
    database_url     TRAJSTORE_DATABASE_URL     the store the proxy records into
    agent            TRAJSTORE_VERL_AGENT       "package.module:function" (or a callable)
    command          TRAJSTORE_VERL_COMMAND     a command line (instead of `agent`)
    run_id           TRAJSTORE_RUN_ID           default "verl"
    api_key          TRAJSTORE_API_KEY          the proxy's admin key, if it has one
    timeout_s        TRAJSTORE_VERL_TIMEOUT     seconds per episode (None: no limit)
    failure_reward   TRAJSTORE_VERL_FAILURE_REWARD  reward of a failed or timed-out episode
                                                (default 0.0; "none": raise, failing the step)

The conversion (`output_fields`) is a plain function of the recorded session, testable without
verl's workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import shlex
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    register,
)

from trajstore.client import AsyncClient, AsyncSession, SessionClosed
from trajstore.store import EventStore
from trajstore.store.recorded import recorded_session
from trajstore.store.samples import build_samples, final_branch
from trajstore.store.sessions import SessionRecord
from trajstore.trainer.verl_batch import split_sample

log = logging.getLogger(__name__)

#: What an agent is: (base_url, api_key, prompt messages) -> reward, or None for no reward.
Agent = Callable[[str, str, Any], Awaitable[float | None] | float | None]

#: How much of a failed command's stderr goes into the session's finish reason.
_REASON_CHARS = 500


@dataclass(frozen=True)
class TrajstoreSettings:
    """Where the agent loop records and what it runs (see the module docstring)."""

    proxy_url: str
    database_url: str
    agent: str | Agent | None = None
    command: tuple[str, ...] | None = None
    run_id: str = "verl"
    api_key: str | None = None
    timeout_s: float | None = None
    failure_reward: float | None = 0.0
    tags: tuple[str, ...] = ("verl",)
    http_timeout_s: float = 60.0  #: each call to the proxy (a finish waits for durability)
    extra_env: Mapping[str, str] = field(default_factory=dict)  #: for a command agent

    def __post_init__(self) -> None:
        if (self.agent is None) == (self.command is None):
            raise ValueError("configure exactly one of agent (a coroutine) and command")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @classmethod
    def from_options(
        cls, options: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> TrajstoreSettings:
        """Settings from keyword options (None or absent: the environment variable)."""
        env = os.environ if environ is None else environ

        def pick(name: str, variable: str) -> Any:
            value = options.get(name)
            return env.get(variable) if value is None else value

        proxy_url = pick("proxy_url", "TRAJSTORE_PROXY_URL")
        database_url = pick("database_url", "TRAJSTORE_DATABASE_URL")
        if not proxy_url or not database_url:
            raise ValueError(
                "the trajstore agent loop needs proxy_url and database_url (agent loop config "
                "options, or TRAJSTORE_PROXY_URL / TRAJSTORE_DATABASE_URL)"
            )
        # What to run: from the options when they name it, else from the environment.
        if options.get("agent") is not None or options.get("command") is not None:
            agent, command = options.get("agent"), options.get("command")
        else:
            agent = env.get("TRAJSTORE_VERL_AGENT") or None
            command = env.get("TRAJSTORE_VERL_COMMAND") or None
        if isinstance(command, str):
            command = tuple(shlex.split(command))
        elif command is not None:
            command = tuple(str(part) for part in command)  # a list, or an OmegaConf ListConfig
        if agent is not None and command is not None:
            raise ValueError("configure exactly one of agent (a coroutine) and command")
        timeout = pick("timeout_s", "TRAJSTORE_VERL_TIMEOUT")
        failure = pick("failure_reward", "TRAJSTORE_VERL_FAILURE_REWARD")
        if isinstance(failure, str):
            failure = None if failure.strip().lower() in ("none", "raise") else float(failure)
        elif "failure_reward" not in options and failure is None:
            failure = 0.0
        tags = options.get("tags")
        return cls(
            proxy_url=str(proxy_url).rstrip("/"),
            database_url=str(database_url),
            agent=agent,
            command=command or None,
            run_id=str(pick("run_id", "TRAJSTORE_RUN_ID") or "verl"),
            api_key=pick("api_key", "TRAJSTORE_API_KEY") or None,
            timeout_s=None if timeout in (None, "") else float(timeout),
            failure_reward=None if failure is None else float(failure),
            tags=("verl",) if tags is None else tuple(str(t) for t in tags),
        )


def resolve_agent(agent: str | Agent) -> Agent:
    """A callable agent, importing "package.module:function" when given as a string."""
    if not isinstance(agent, str):
        return agent
    module, _, name = agent.partition(":")
    if not module or not name:
        raise ValueError(f"agent must be 'package.module:function', got {agent!r}")
    resolved: Agent = getattr(importlib.import_module(module), name)
    return resolved


# -- the conversion --------------------------------------------------------------------------


def output_fields(
    session: SessionRecord,
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """`AgentLoopOutput`'s fields for a recorded session (its final branch), as plain values.

    Over-long samples are cut as verl's own agent loops cut theirs: the prompt keeps its last
    `prompt_length` tokens, the response its first `response_length`; `extra_fields` counts
    what was cut. A generated token without a behaviour logprob gets response_mask 0
    (`trainer.verl_batch`). `metrics`: generate_sequences is the time the engine spent on the
    session's turns (recorded latencies), tool_calls the rest of `wall_s`.
    """
    samples = build_samples(session)
    chosen = final_branch(samples)
    branches = sum(1 for s in samples if s.alternative_of is None)
    empty = np.zeros(0, dtype=np.int64)
    if chosen is None:  # no completed model call: nothing to train on
        prompt, response, mask = empty, empty, empty
        logprobs = np.zeros(0, dtype=np.float32)
        missing, turns = 0, 0
    else:
        split = split_sample(chosen.token_array(), chosen.mask_array(), chosen.logprob_array())
        prompt, response = split.prompt_ids, split.response_ids
        mask, logprobs = split.response_mask, split.response_logprobs
        missing, turns = split.missing_logprobs, len(chosen.turns)
    cut_prompt = cut_response = 0
    if prompt_length is not None and len(prompt) > prompt_length:
        cut_prompt = len(prompt) - prompt_length
        prompt = prompt[cut_prompt:]
    if response_length is not None and len(response) > response_length:
        cut_response = len(response) - response_length
        response, mask = response[:response_length], mask[:response_length]
        logprobs = logprobs[:response_length]
    if cut_prompt or cut_response:
        log.warning(
            "session %s: sample cut to fit verl's lengths (%d prompt, %d response tokens dropped)",
            session.session_id, cut_prompt, cut_response,
        )  # fmt: skip
    generate = sum(t.latency_s or 0.0 for t in session.turns)
    return {
        "prompt_ids": prompt.tolist(),
        "response_ids": response.tolist(),
        "response_mask": mask.tolist(),
        "response_logprobs": logprobs.astype(np.float64).tolist(),
        "reward_score": session.reward,
        # As verl's ToolAgentLoop counts: the first prompt, then per model call its reply and
        # the tool results or user message before the next call.
        "num_turns": 2 * turns,
        "metrics": {
            "generate_sequences": generate,
            "tool_calls": max(0.0, (wall_s or 0.0) - generate),
            "compute_score": 0.0,
            "num_preempted": -1,
        },
        "extra_fields": {
            "turn_scores": [],
            "tool_rewards": [],
            "trajstore_session_id": session.session_id,
            "trajstore_sample_id": None if chosen is None else str(chosen.sample_id),
            "trajstore_status": session.status,
            "trajstore_branches": branches,
            "trajstore_divergence": (
                None if chosen is None or chosen.divergence is None else chosen.divergence.as_json()
            ),
            "trajstore_policy_versions": [] if chosen is None else list(chosen.policy_versions),
            "trajstore_missing_logprobs": missing,
            "trajstore_cut": {"prompt": cut_prompt, "response": cut_response},
        },
    }


def agent_loop_output(session: SessionRecord, **options: Any) -> AgentLoopOutput:
    """verl's `AgentLoopOutput` for a recorded session (`output_fields`' options)."""
    fields = output_fields(session, **options)
    fields["metrics"] = AgentLoopMetrics(**fields["metrics"])
    return AgentLoopOutput(**fields)


# -- one episode -----------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """numpy and OmegaConf values (as verl hands dataset fields over) as plain JSON-able ones."""
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _session_body(settings: TrajstoreSettings, sample: Mapping[str, Any]) -> dict[str, Any]:
    """The session of one prompt of verl's batch (its dataset fields in `sample`), as
    `AsyncClient.create_session`'s arguments."""
    extra = _plain(sample.get("extra_info")) or {}
    index = _plain(sample.get("index"))
    task = extra.get("task_id") if isinstance(extra, dict) else None
    if task is None:
        task = index
    uid = _plain(sample.get("uid"))
    metadata: dict[str, Any] = {"tags": list(settings.tags), "source": "verl"}
    for key in ("data_source", "index"):
        if sample.get(key) is not None:
            metadata[key] = _plain(sample.get(key))
    body: dict[str, Any] = {
        "run_id": settings.run_id,
        "task_id": None if task is None else str(task),
        "group_id": None if uid is None else str(uid),
        "metadata": metadata,
    }
    if settings.timeout_s is not None:
        body["deadline_s"] = settings.timeout_s
    return body


def _parse_reward(stdout: str) -> float | None:
    """A command's reward: its last non-empty stdout line, a number or JSON with `reward`."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    if not lines:
        return None
    last = lines[-1]
    try:
        value = json.loads(last)
    except ValueError:
        return None
    if isinstance(value, dict):
        value = value.get("reward")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


class AgentFailed(Exception):
    """The agent raised, or its command exited non-zero."""


async def _run_command(
    settings: TrajstoreSettings, session: AsyncSession, prompt: Any
) -> float | None:
    assert settings.command is not None
    prompt_json = json.dumps(prompt)
    env = {**os.environ, **settings.extra_env, **session.env(), "TRAJSTORE_PROMPT": prompt_json}
    process = await asyncio.create_subprocess_exec(
        *settings.command,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        stdout, stderr = await process.communicate(prompt_json.encode())
    except BaseException:  # timed out or cancelled: the command goes with it
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if process.returncode != 0:
        tail = stderr.decode(errors="replace").strip()[-_REASON_CHARS:]
        raise AgentFailed(f"command exited with {process.returncode}: {tail}")
    return _parse_reward(stdout.decode(errors="replace"))


async def _run_agent(
    settings: TrajstoreSettings, session: AsyncSession, prompt: Any
) -> float | None:
    if settings.command is not None:
        return await _run_command(settings, session, prompt)
    assert settings.agent is not None
    agent = resolve_agent(settings.agent)
    if inspect.iscoroutinefunction(agent):
        result = await agent(session.base_url, session.api_key, prompt)
    else:  # a plain function: off the event loop, which other episodes share
        result = await asyncio.to_thread(agent, session.base_url, session.api_key, prompt)
        if inspect.isawaitable(result):
            result = await result
    return None if result is None else float(result)


async def read_recorded_session(database_url: str, session_id: str) -> SessionRecord:
    """The session as recorded (every event durable once the proxy answered its finish)."""
    async with await EventStore.open(database_url, min_size=1, max_size=1) as store:
        return await recorded_session(store, session_id)


async def run_episode(
    settings: TrajstoreSettings,
    sample: Mapping[str, Any],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
) -> AgentLoopOutput:
    """One prompt of verl's batch (its dataset fields: `raw_prompt`, `uid`, `index`, ...) run
    as a recorded trajstore session; the module docstring says how."""
    prompt = _plain(sample.get("raw_prompt"))
    started = time.perf_counter()
    client = AsyncClient(
        settings.proxy_url, api_key=settings.api_key, database_url=settings.database_url,
        timeout=settings.http_timeout_s,
    )  # fmt: skip
    async with client:
        session = await client.create_session(**_session_body(settings, sample))
        sid = session.session_id
        status, reason, reward = "completed", None, None
        failure: Exception | None = None
        try:
            reward = await asyncio.wait_for(
                _run_agent(settings, session, prompt), settings.timeout_s
            )
        except asyncio.CancelledError:
            await asyncio.shield(session.finish("aborted", reason="cancelled by verl"))
            raise
        except TimeoutError as exc:
            status, reason, failure = "timeout", f"agent ran past {settings.timeout_s}s", exc
        except Exception as exc:
            status, reason = "error", f"{type(exc).__name__}: {exc}"[:_REASON_CHARS]
            failure = exc
        if failure is not None:
            log.warning("trajstore session %s: %s (%s)", sid, status, reason)
            reward = settings.failure_reward
        if reward is not None:
            source = "agent" if failure is None else f"trajstore.rollout.verl_loop:{status}"
            await session.reward(reward, source=source)
        with contextlib.suppress(SessionClosed):  # the proxy finished it (its deadline) first
            await session.finish(status, reason=reason)
        if failure is not None and settings.failure_reward is None:
            raise AgentFailed(f"trajstore session {sid}: {status}: {reason}") from failure
        recorded = await session.record()
    return agent_loop_output(
        recorded,
        prompt_length=prompt_length,
        response_length=response_length,
        wall_s=time.perf_counter() - started,
    )


# -- the agent loop --------------------------------------------------------------------------

_OPTIONS = (
    "proxy_url", "database_url", "agent", "command", "run_id", "api_key", "timeout_s",
    "failure_reward", "tags",
)  # fmt: skip


@register("trajstore")
class TrajstoreAgentLoop(AgentLoopBase):  # type: ignore[misc]  # verl is untyped here
    """verl's agent loop `trajstore` (the module docstring); options as keyword arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        options = {name: kwargs.pop(name) for name in _OPTIONS if name in kwargs}
        kwargs.pop("name", None)  # the agent loop config file's entry name
        super().__init__(*args, **kwargs)
        self.settings = TrajstoreSettings.from_options(options)
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """One episode; the agent picks its own sampling (`sampling_params` is not used)."""
        return await run_episode(
            self.settings,
            kwargs,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
        )
