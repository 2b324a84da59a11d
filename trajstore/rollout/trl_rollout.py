"""TRL on trajstore's samples: a `rollout_func` for `trl.GRPOTrainer`, and recorded runs as a
`datasets.Dataset`.

Online (`TrajstoreRollout`, TRL >= 1.10). TRL calls `rollout_func(prompts, trainer)` once per
generation batch with the prompts of this process (each already repeated `num_generations`
times by TRL's sampler) and wants one completion per prompt back. For each prompt the rollout:

1. creates a session on the proxy (`trajstore.client`: run id, a task id, a group id);
2. runs the agent, a coroutine `agent(base_url, api_key, prompt) -> reward | None`, against the
   session's `base_url` (or `anthropic_base_url`), as it would run against any endpoint;
3. records its reward and finishes the session (`error` or `timeout`, with the reason, when the
   agent failed);
4. reads the session's events from the store and builds its samples with the projector's own
   function (`AsyncSession.samples`, `store.recorded`), so what TRL gets is token for token the
   sample the projector writes into `samples`, without waiting for the projector.

A multi-turn session is one sample (the proxy's token-in continuation). A session whose history
diverged has several branches: the rollout takes the last one (`is_final`), the one that holds
the episode's outcome, and leaves the earlier branches to the store (`samples_dataset` and
`trainer.replay` still see them). The other choices of an `n > 1` request are left out too.

What TRL gets, per prompt, in the shape its `rollout_func` contract names:

- `prompt_ids`: the sample's tokens before its first generated token;
- `completion_ids`: every token from there on: the model's completions *and* what came between
  them (tool results, user messages, template glue);
- `logprobs`: the behaviour logprobs, aligned with `completion_ids` (0.0 on tokens the model did
  not generate, NaN on generated tokens the engine gave none for, e.g. constrained decoding);
- `env_mask`: 1 on generated tokens, 0 on the rest: TRL multiplies it into its loss mask, so
  tool and user tokens inside the completion are never trained on;
- `trajstore_reward`, `trajstore_session_id`: extra fields TRL forwards to reward functions;
  `recorded_reward` is the reward function that hands TRL the agent's recorded reward.

Offline (`trajstore.trainer.trl_dataset.samples_dataset`): the samples of a `Selection` as a
`datasets.Dataset`, one row per sample, with `input_ids` and `completion_mask` as TRL's
`SFTTrainer` reads pre-tokenised data; every lineage of a session there, when asked.

TRL, transformers and torch are never imported here: the trainer is passed in and only its
`state.global_step` and `processing_class` are read.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from trajstore.client import AsyncClient, exit_status
from trajstore.store.samples import Sample, final_branch
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.trl_dataset import run_sync

log = logging.getLogger(__name__)

#: The agent: given the session's base URL, its API key and the prompt (TRL's dataset `prompt`:
#: a string or a list of messages), it does its work through the proxy and returns its reward
#: (None: no reward; TRL then treats the completion as unscorable).
Agent = Callable[[str, str, Any], Awaitable[float | None]]


class RolloutFailed(TrainerError):
    """An agent failed, or a session left nothing to train on; the message says which."""


@dataclass(frozen=True)
class TrlSample:
    """One sample in the shape of TRL's `rollout_func` output (see the module's docstring)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    env_mask: list[int]


def trl_fields(sample: Sample) -> TrlSample:
    """A sample split where the model first generated: prompt, completion, logprobs, env mask.

    Raises `RolloutFailed` when the sample holds no generated token (TRL needs at least one).
    """
    tokens, mask, logprobs = sample.token_array(), sample.mask_array(), sample.logprob_array()
    generated = np.flatnonzero(mask)
    if generated.size == 0:
        raise RolloutFailed(
            f"session {sample.session.session_id!r}: its sample holds no generated token"
        )
    start = int(generated[0])
    return TrlSample(
        prompt_ids=tokens[:start].tolist(),
        completion_ids=tokens[start:].tolist(),
        logprobs=logprobs[start:].astype(np.float64).tolist(),
        env_mask=mask[start:].astype(np.int64).tolist(),
    )


def recorded_reward(
    prompts: Sequence[Any], trajstore_reward: Sequence[float | None], **kwargs: Any
) -> list[float | None]:
    """A TRL reward function: the reward each agent returned (and the session recorded).

    Pass it as `GRPOTrainer(reward_funcs=[recorded_reward], ...)`; None becomes NaN in TRL,
    which leaves that completion out of its group's baseline and gives it advantage 0.
    """
    del kwargs
    if len(trajstore_reward) != len(prompts):
        raise RolloutFailed(
            f"{len(trajstore_reward)} recorded rewards for {len(prompts)} prompts: "
            "was the rollout_func a TrajstoreRollout?"
        )
    return list(trajstore_reward)


def prompt_key(prompt: Any) -> str:
    """A stable short hash of a prompt (a string or a list of messages): its default task id."""
    text = json.dumps(prompt, sort_keys=True, ensure_ascii=False, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _Episode:
    """What one prompt's rollout produced."""

    session_id: str
    reward: float | None
    fields: TrlSample
    branches: int


@dataclass
class TrajstoreRollout:
    """A `rollout_func` for `trl.GRPOTrainer`: each prompt becomes a recorded agent session.

    `proxy_url`: the recording proxy (what `trajstore up` printed). `database_url`: its store,
    where the finished sessions are read back. `agent`: see `Agent`. `run_id`: the run the
    sessions belong to.

    - `api`: `"openai"` gives the agent the session's `base_url`, `"anthropic"` its
      `anthropic_base_url`.
    - `admin_key`: the proxy's `TRAJSTORE_API_KEY`, when it has one (creating sessions and
      setting the policy version need it; an open proxy needs none).
    - `task_id`: the session's task id from its prompt (default: a hash of the prompt).
    - `metadata`: added to every session's metadata (`{"tags": [...]}` tags its samples).
    - `max_concurrency`: agents run at once.
    - `agent_timeout`: seconds an agent may take (None: no limit); past it the session is
      finished as `timeout` and handled as a failure.
    - `on_agent_error`: `"raise"` (the default) finishes every session, then raises the first
      failure; `"mask"` keeps going: the failed session is finished as `error` (or `timeout`),
      gets no reward, and TRL gets its tokens (or a one-token placeholder when it has none) with
      an all-zero `env_mask` and reward None, so it adds nothing to the loss.
    - `publish_policy_version`: before each rollout, tell the proxy's engines that the policy
      version is TRL's `global_step` (`POST /admin/engines/policy-version`), so samples carry it.
      Turn it on when the engine behind the proxy gets TRL's weights (`use_vllm=True`, server
      mode); without a weight sync, the version would claim weights the engine does not have.
    - `timeout`: seconds for each call to the proxy.

    Sessions of one call that share a prompt share a group id (`{run_id}/{step}/{call}/{task_id}`,
    `step` being TRL's global step and `call` this object's count of rollouts), as they share
    TRL's GRPO group: TRL calls every process once per generation batch, so processes that split
    a group agree on it, and the step keeps a resumed training's groups apart from the last
    one's. The same prompt twice in one generation batch makes one group of both.
    """

    proxy_url: str
    database_url: str
    agent: Agent
    run_id: str
    api: Literal["openai", "anthropic"] = "openai"
    admin_key: str | None = None
    task_id: Callable[[Any], str] = prompt_key
    metadata: dict[str, Any] = field(default_factory=dict)
    max_concurrency: int = 16
    agent_timeout: float | None = None
    on_agent_error: Literal["raise", "mask"] = "raise"
    publish_policy_version: bool = False
    timeout: float = 60.0
    calls: int = 0  #: how many rollouts this object has run (names the groups)

    def __post_init__(self) -> None:
        self.proxy_url = self.proxy_url.rstrip("/")
        if self.api not in ("openai", "anthropic"):
            raise ValueError(f"api must be 'openai' or 'anthropic', got {self.api!r}")
        if self.on_agent_error not in ("raise", "mask"):
            raise ValueError(
                f"on_agent_error must be 'raise' or 'mask', got {self.on_agent_error!r}"
            )
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """TRL's entry point: `GRPOTrainer(rollout_func=TrajstoreRollout(...))`."""
        state = getattr(trainer, "state", None)
        step = getattr(state, "global_step", None)
        tokenizer = getattr(trainer, "processing_class", None)
        tokenizer = getattr(tokenizer, "tokenizer", tokenizer)  # a processor holds one
        eos = getattr(tokenizer, "eos_token_id", None)
        placeholder = eos if isinstance(eos, int) else 0
        return run_sync(
            lambda: self.rollout(
                prompts,
                step=step if isinstance(step, int) else None,
                placeholder_token_id=placeholder,
            )
        )

    async def rollout(
        self, prompts: Sequence[Any], *, step: int | None = None, placeholder_token_id: int = 0
    ) -> dict[str, list[Any]]:
        """The same as calling the object, from async code: one episode per prompt, in order.

        `step`: TRL's global step (recorded in each session's metadata, and the policy version
        when `publish_policy_version`). `placeholder_token_id`: the token of a masked-out failed
        episode that recorded no token (TRL's `__call__` passes the tokenizer's EOS).
        """
        call = self.calls
        self.calls += 1
        limit = asyncio.Semaphore(self.max_concurrency)
        client = AsyncClient(
            self.proxy_url, api_key=self.admin_key, database_url=self.database_url,
            timeout=self.timeout,
        )  # fmt: skip
        async with client:
            if self.publish_policy_version and step is not None:
                await client.set_policy_version(str(step))

            async def one(index: int, prompt: Any) -> _Episode:
                async with limit:
                    return await self._episode(
                        client, prompt, call, index, step, placeholder_token_id
                    )

            results = await asyncio.gather(
                *(one(i, p) for i, p in enumerate(prompts)), return_exceptions=True
            )
        episodes: list[_Episode] = []
        for result in results:
            if isinstance(result, BaseException):
                raise result  # the first failure, after every session was finished
            episodes.append(result)
        for episode in episodes:
            if episode.branches > 1:
                log.info(
                    "session %s has %d branches; TRL gets the last one",
                    episode.session_id,
                    episode.branches,
                )
        return {
            "prompt_ids": [e.fields.prompt_ids for e in episodes],
            "completion_ids": [e.fields.completion_ids for e in episodes],
            "logprobs": [e.fields.logprobs for e in episodes],
            "env_mask": [e.fields.env_mask for e in episodes],
            "trajstore_reward": [e.reward for e in episodes],
            "trajstore_session_id": [e.session_id for e in episodes],
        }

    async def _episode(
        self,
        client: AsyncClient,
        prompt: Any,
        call: int,
        index: int,
        step: int | None,
        placeholder_token_id: int,
    ) -> _Episode:
        task_id = self.task_id(prompt)
        session = await client.create_session(
            self.run_id,
            task_id=task_id,
            group_id=f"{self.run_id}/{'-' if step is None else step}/{call}/{task_id}",
            metadata={**self.metadata, "trl": {"step": step, "rollout": call, "index": index}},
        )
        base_url = session.base_url if self.api == "openai" else session.anthropic_base_url
        failure: BaseException | None = None
        reward: float | None = None
        try:
            value = await asyncio.wait_for(
                self.agent(base_url, session.api_key, prompt), self.agent_timeout
            )
            if value is not None:
                reward = float(value)
                if not math.isfinite(reward):
                    raise RolloutFailed(
                        f"session {session.session_id!r}: the agent returned {value!r}"
                    )
        except Exception as error:  # the agent's own failure, whatever it is
            failure = error
        if failure is None and reward is not None:
            await session.reward(reward, source="trl_rollout")
        status, _ = exit_status(failure)
        await session.close_after(failure)  # `completed`, or `error`/`timeout` with the reason

        if failure is not None and self.on_agent_error == "raise":
            raise RolloutFailed(
                f"session {session.session_id!r}: the agent failed ({status})"
            ) from failure
        samples = await session.samples()
        sample = final_branch(samples)
        branches = len([s for s in samples if s.alternative_of is None])
        if failure is None:
            if sample is None:
                raise RolloutFailed(
                    f"session {session.session_id!r}: the agent made no completed model call, "
                    "so there is nothing to train on (on_agent_error='mask' keeps going past "
                    "such agents)"
                )
            return _Episode(session.session_id, reward, trl_fields(sample), branches)
        log.warning("session %s: the agent failed (%s), masked out: %s", session.session_id,
                    status, failure)  # fmt: skip
        return _Episode(session.session_id, None, _masked(sample, placeholder_token_id), branches)


def _masked(sample: Sample | None, placeholder_token_id: int) -> TrlSample:
    """A failed episode's tokens with nothing to learn from: env mask 0 everywhere."""
    try:
        if sample is not None:
            fields = trl_fields(sample)
            return TrlSample(
                fields.prompt_ids,
                fields.completion_ids,
                fields.logprobs,
                [0] * len(fields.env_mask),
            )
    except RolloutFailed:
        pass
    return TrlSample([placeholder_token_id], [placeholder_token_id], [math.nan], [0])
