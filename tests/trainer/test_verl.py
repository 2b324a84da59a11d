"""verl consuming trajstore's samples: the `trajstore` agent loop and recorded runs as batches.

(a) verl's own `AgentLoopWorker` (built on the CPU from verl's generated PPO config and the
generated tiny model; no Ray, no GPU, no verl rollout server) runs the `trajstore` agent loop on a
prompt: a toy agent holds a two-turn conversation through the proxy (fake engine), and the batch
verl's post-processing makes of it holds the recorded sample token for token. The same sample
read back as a recorded run (`trainer.verl_batch`) gives the very same tensors.

(b) A recorded run as a verl batch: fields, shapes, padding, determinism; then verl's GRPO
advantage and PPO policy loss (`verl.trainer.ppo.core_algos`) on it, with logprobs from the tiny
model, are finite and give finite gradients.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from openai import AsyncOpenAI
from verl.protocol import DataProto

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory
from tests.trainer.rows import branched_session, insert_samples, rollout_rows, sample_row
from trajstore.rollout.verl_loop import (
    AgentFailed,
    TrajstoreSettings,
    output_fields,
    read_recorded_session,
    run_episode,
)
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.store.samples import build_samples, final_branch
from trajstore.store.tokens import encode_logprobs, encode_token_ids
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer.errors import BadSelection
from trajstore.trainer.selection import Selection
from trajstore.trainer.verl_batch import TENSOR_FIELDS, split_sample, verl_batch, verl_batches

pytestmark = pytest.mark.slow  # imports verl (~10 s) and generates the tiny model

PROMPT_LENGTH = RESPONSE_LENGTH = 64
MESSAGES = [{"role": "user", "content": "add 2 and 3"}]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def two_turn_agent(base_url: str, api_key: str, prompt: Any) -> float:
    """The toy agent: a question, the model's reply, a follow-up; reward 1."""
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(prompt)
    first = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "and now multiply them"})
    await client.chat.completions.create(model="tiny", messages=messages, max_tokens=6)
    return 1.0


def verl_worker(tiny_model: Path, tmp_path: Path, options: dict[str, Any]) -> Any:
    """verl's AgentLoopWorker, as its Ray actor would build it, with `trajstore` configured."""
    import verl
    import yaml
    from omegaconf import OmegaConf
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    loops = tmp_path / "agent_loops.yaml"
    entry = {
        "name": "trajstore",
        "_target_": "trajstore.rollout.verl_loop.TrajstoreAgentLoop",
        **options,
    }
    loops.write_text(yaml.safe_dump([entry]))
    config = OmegaConf.load(
        Path(verl.__file__).parent / "trainer/config/_generated_ppo_trainer.yaml"
    )
    config.actor_rollout_ref.model.path = str(tiny_model)
    rollout = config.actor_rollout_ref.rollout
    rollout.name = "vllm"
    rollout.prompt_length, rollout.response_length = PROMPT_LENGTH, RESPONSE_LENGTH
    rollout.agent.agent_loop_config_path = str(loops)
    return AgentLoopWorker(config, None)  # no LLM client: the agent talks to the proxy


def prompts_batch(uid: str, task_id: str) -> DataProto:
    """One prompt as verl's dataset and trainer hand it to the agent loop worker."""
    raw_prompt = np.empty(1, dtype=object)
    raw_prompt[0] = MESSAGES
    extra_info = np.empty(1, dtype=object)
    extra_info[0] = {"index": 0, "task_id": task_id}
    return DataProto.from_dict(
        non_tensors={
            "raw_prompt": raw_prompt,
            "agent_name": np.array(["trajstore"], dtype=object),
            "uid": np.array([uid], dtype=object),
            "index": np.array([0]),
            "extra_info": extra_info,
            "data_source": np.array(["toy"], dtype=object),
        }
    )


def unpadded(batch: DataProto, row: int = 0) -> dict[str, list[Any]]:
    """A row's prompt and response as verl laid them out, padding removed."""
    width = batch.batch["prompts"].shape[1]
    attention = batch.batch["attention_mask"][row].bool()
    on_response = attention[width:]
    return {
        "prompt": batch.batch["prompts"][row][attention[:width]].tolist(),
        "response": batch.batch["responses"][row][on_response].tolist(),
        "mask": batch.batch["response_mask"][row][on_response].tolist(),
        "logprobs": batch.batch["rollout_log_probs"][row][on_response].tolist(),
    }


# -- (a) the agent loop, through verl's own post-processing -------------------------------------


async def test_the_agent_loop_output_is_the_recorded_sample_token_for_token(
    start_proxy: ProxyFactory, database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    async with FakeEngine() as engine:
        await agent_loop_through_verl(engine.url, start_proxy, database_url, tiny_model, tmp_path)


@pytest.mark.vllm
async def test_the_agent_loop_on_a_real_vllm_is_the_recorded_sample_token_for_token(
    start_proxy: ProxyFactory, vllm: str, database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    # the `vllm` fixture serves the tiny model of the same seed: the same tokenizer
    await agent_loop_through_verl(vllm, start_proxy, database_url, tiny_model, tmp_path)


async def agent_loop_through_verl(
    engine_url: str,
    start_proxy: ProxyFactory,
    database_url: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """verl's worker runs the `trajstore` loop on one prompt; its batch is the recorded sample."""
    proxy = await start_proxy([engine_url])
    worker = verl_worker(
        tiny_model,
        tmp_path,
        {
            "proxy_url": proxy.url,
            "database_url": database_url,
            "agent": "tests.trainer.test_verl:two_turn_agent",
            "run_id": "verl-a",
        },
    )
    output = await worker.generate_sequences(prompts_batch("prompt-7", "task-7"))

    session_id = output.non_tensor_batch["trajstore_session_id"][0]
    session = await read_recorded_session(database_url, session_id)
    assert (session.status, session.reward, session.run_id) == ("completed", 1.0, "verl-a")
    assert (session.group_id, session.task_id) == ("prompt-7", "task-7")
    assert len(session.turns) == 2
    samples = build_samples(session)
    sample = final_branch(samples)
    assert sample is not None and len(samples) == 1 and sample.divergence is None

    tokens, mask = sample.token_ids, sample.loss_mask
    logprobs = sample.logprob_array()
    start = sample.prompt_len
    got = unpadded(output)
    assert got["prompt"] == tokens[:start]
    assert got["response"] == tokens[start:]
    assert got["mask"] == mask[start:]
    assert 0 in got["mask"]  # the reply and the follow-up between the two completions
    assert np.array_equal(np.array(got["logprobs"], np.float32), logprobs[start:])
    # verl's fixed widths, left-padded prompt, right-padded response, reward on the last token
    b = output.batch
    assert b["prompts"].shape == (1, PROMPT_LENGTH) and b["responses"].shape == (1, RESPONSE_LENGTH)
    assert b["input_ids"].shape == (1, PROMPT_LENGTH + RESPONSE_LENGTH)
    assert b["attention_mask"][0, PROMPT_LENGTH - start :].sum() == len(tokens)
    n_response = len(tokens) - start
    assert b["rm_scores"][0, n_response - 1] == 1.0 and b["rm_scores"].sum() == 1.0
    assert b["position_ids"][0, PROMPT_LENGTH - start :].tolist()[: len(tokens)] == list(
        range(len(tokens))
    )
    assert output.non_tensor_batch["__num_turns__"].tolist() == [4]
    assert output.non_tensor_batch["trajstore_branches"].tolist() == [1]

    # The same sample, projected and read back as a recorded run: the very same tensors.
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
    batch = await verl_batch(
        database_url,
        Selection(runs=("verl-a",)),
        prompt_length=PROMPT_LENGTH,
        response_length=RESPONSE_LENGTH,
        pad_token_id=worker.tokenizer.pad_token_id,
    )
    assert batch is not None
    for name in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                 "position_ids", "rollout_log_probs", "rm_scores"):  # fmt: skip
        assert torch.equal(batch.batch[name], output.batch[name]), name
    assert batch.non_tensor_batch["uid"].tolist() == ["prompt-7"]


async def test_a_command_agent_gets_the_session_in_its_environment(
    proxy: Any, database_url: str
) -> None:
    script = textwrap.dedent(
        """
        import json, os, sys, httpx
        prompt = json.load(sys.stdin)
        assert prompt == json.loads(os.environ["TRAJSTORE_PROMPT"])
        assert os.environ["ANTHROPIC_API_KEY"] == os.environ["OPENAI_API_KEY"]
        assert os.environ["ANTHROPIC_BASE_URL"]
        answer = httpx.post(
            os.environ["OPENAI_BASE_URL"] + "/chat/completions",
            json={"model": "tiny", "messages": prompt, "max_tokens": 4},
            headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]},
            timeout=30,
        )
        answer.raise_for_status()
        print("some log line")
        print(json.dumps({"reward": 0.5}))
        """
    )
    settings = TrajstoreSettings.from_options(
        {"proxy_url": proxy.url, "database_url": database_url, "command": [sys.executable, "-c",
         script], "run_id": "verl-cmd"}
    )  # fmt: skip
    output = await run_episode(settings, {"raw_prompt": MESSAGES, "uid": "g", "index": 3})
    assert output.reward_score == 0.5
    assert len(output.response_ids) > 0 and all(output.response_mask)
    assert output.num_turns == 2
    session = await read_recorded_session(database_url, output.extra_fields["trajstore_session_id"])
    assert (session.status, session.task_id, session.group_id) == ("completed", "3", "g")


async def test_a_failed_or_late_agent_finishes_its_session_with_the_failure_reward(
    proxy: Any, database_url: str
) -> None:
    base = {"proxy_url": proxy.url, "database_url": database_url, "run_id": "verl-fail"}
    late = TrajstoreSettings.from_options(
        {**base, "command": [sys.executable, "-c", "import time; time.sleep(60)"], "timeout_s": 1}
    )
    output = await run_episode(late, {"raw_prompt": MESSAGES})
    assert (output.reward_score, output.response_ids, output.prompt_ids) == (0.0, [], [])
    assert output.extra_fields["trajstore_status"] == "timeout"

    broken = TrajstoreSettings.from_options(
        {**base, "command": [sys.executable, "-c", "raise SystemExit(3)"], "failure_reward": None}
    )
    with pytest.raises(AgentFailed, match=r"session (\S+): error: AgentFailed: .*exited with 3"):
        await run_episode(broken, {"raw_prompt": MESSAGES})
    late_session = await read_recorded_session(
        database_url, output.extra_fields["trajstore_session_id"]
    )
    assert (late_session.status, late_session.reward) == ("timeout", 0.0)
    async with await EventStore.open(database_url) as store:
        finished = await store.pool.fetch(
            "SELECT session_id, status FROM trajectories WHERE run_id = 'verl-fail'"
        )
    assert sorted(r["status"] for r in finished) == ["error", "timeout"]


# -- (b) a recorded run as a verl batch ---------------------------------------------------------


def stored(
    session_id: str,
    group_id: str,
    reward: float,
    segments: list[tuple[list[int], bool]],
    *,
    versions: tuple[int, ...] = (0,),
    nan_at: int | None = None,
) -> dict[str, Any]:
    """A `samples` row from segments (tokens, generated?): logprobs -0.1, -0.2, ... on the
    generated tokens, NaN at position `nan_at`."""
    tokens = [t for seg, _ in segments for t in seg]
    mask = [int(gen) for seg, gen in segments for _ in seg]
    logprobs = [-0.1 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    if nan_at is not None:
        logprobs[nan_at] = float("nan")
    row = sample_row(session_id=session_id, run_id="run-v", group_id=group_id, reward=reward,
                     policy_versions=versions)  # fmt: skip
    prompt_len = mask.index(1)
    return row | {
        "token_ids": encode_token_ids(np.array(tokens, dtype=np.int32)),
        "loss_mask": bytes(mask),
        "logprobs": encode_logprobs(np.array(logprobs, dtype=np.float32)),
        "prompt_len": prompt_len,
        "response_len": sum(mask),
    }


ROWS = [
    # two turns: completion, a tool result (mask 0), completion
    stored("s-a", "g-1", 1.0, [([1, 2, 3], False), ([10, 11], True), ([20, 21], False),
                               ([12], True)]),
    stored("s-b", "g-1", 0.0, [([1, 2, 3, 4, 5], False), ([13, 14, 15], True)]),
    stored("s-c", "g-2", 1.0, [([6], False), ([16, 17], True)], versions=(3,), nan_at=2),
    stored("s-d", "g-2", 0.0, [([7, 8], False), ([18], True)], versions=(4, 5)),
]  # fmt: skip
SELECTION = Selection(runs=("run-v",), current_policy_version=5)


async def test_a_recorded_run_is_a_verl_batch(
    store: EventStore, database_url: str, tiny_model: Path
) -> None:
    async with store.pool.acquire() as conn:
        await insert_samples(conn, ROWS)
    batch = await verl_batch(database_url, SELECTION)
    assert batch is not None and len(batch) == 4
    assert set(TENSOR_FIELDS) <= set(batch.batch.keys())
    assert batch.batch["prompts"].shape == (4, 5)  # the longest prompt (s-b)
    assert batch.batch["responses"].shape == (4, 5)  # the longest response (s-a)
    assert batch.batch["input_ids"].shape == batch.batch["position_ids"].shape == (4, 10)
    for name in ("prompts", "responses", "response_mask", "input_ids", "attention_mask",
                 "position_ids"):  # fmt: skip
        assert batch.batch[name].dtype == torch.int64, name
    assert batch.batch["rollout_log_probs"].dtype == torch.float32
    assert batch.meta_info["trajstore"]["missing_behaviour_tokens"] == 1

    row = {s: i for i, s in enumerate(batch.non_tensor_batch["session_id"].tolist())}
    b = batch.batch
    a = row["s-a"]
    assert b["prompts"][a].tolist() == [0, 0, 1, 2, 3]  # left-padded
    assert b["responses"][a].tolist() == [10, 11, 20, 21, 12]
    assert b["response_mask"][a].tolist() == [1, 1, 0, 0, 1]  # the tool result is not trained
    assert b["attention_mask"][a].tolist() == [0, 0] + [1] * 8
    assert b["position_ids"][a].tolist() == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7]
    assert b["rollout_log_probs"][a].tolist() == pytest.approx([-0.4, -0.5, 0.0, 0.0, -0.8])
    assert b["token_level_rewards"][a].tolist() == [0, 0, 0, 0, 1.0]
    c = row["s-c"]
    assert b["responses"][c].tolist() == [16, 17, 0, 0, 0]  # right-padded
    assert b["response_mask"][c].tolist() == [1, 0, 0, 0, 0]  # no behaviour logprob: left out
    assert b["rollout_log_probs"][c].tolist() == pytest.approx([-0.2, 0, 0, 0, 0])
    assert b["rm_scores"][c].tolist() == [0, 1.0, 0, 0, 0]  # on the last response token
    assert torch.equal(b["rm_scores"], b["token_level_scores"])
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    nt = batch.non_tensor_batch
    assert [nt["uid"][row[s]] for s in ("s-a", "s-b", "s-c", "s-d")] == ["g-1", "g-1", "g-2", "g-2"]
    assert [nt["staleness"][row[s]] for s in ("s-a", "s-c", "s-d")] == [5, 2, 1]
    assert nt["policy_version"][row["s-d"]] == 4

    # deterministic: the same batch twice, and in batches of 3 the same rows in the same order
    again = await verl_batch(database_url, SELECTION)
    assert again is not None
    for name in TENSOR_FIELDS:
        assert torch.equal(batch.batch[name], again.batch[name]), name
    for name, values in batch.non_tensor_batch.items():
        assert values.tolist() == again.non_tensor_batch[name].tolist(), name
    parts = [p async for p in verl_batches(database_url, SELECTION, batch_size=3)]
    assert [len(p) for p in parts] == [3, 1]
    in_parts = [i for p in parts for i in p.non_tensor_batch["sample_id"].tolist()]
    assert in_parts == nt["sample_id"].tolist()
    fixed = await verl_batch(database_url, SELECTION, prompt_length=8, response_length=6)
    assert fixed is not None and fixed.batch["input_ids"].shape == (4, 14)
    with pytest.raises(BadSelection, match="response_length=4"):
        await verl_batch(database_url, SELECTION, response_length=4)
    assert await verl_batch(database_url, Selection(runs=("nothing",))) is None

    await verl_policy_loss_is_finite(batch, tiny_model)


async def test_a_rollout_s_lineages_are_rows_of_one_group_member(
    store: EventStore, database_url: str
) -> None:
    async with store.pool.acquire() as conn:
        await insert_samples(conn, rollout_rows())
    batch = await verl_batch(database_url, Selection(rollouts=True), shuffle=False)
    assert batch is not None and len(batch) == 4  # rich: main, sub-agent, side call; plain
    sessions = batch.non_tensor_batch["session_id"].tolist()
    assert sorted(sessions) == ["plain", "rich", "rich", "rich"]
    assert set(batch.non_tensor_batch["uid"].tolist()) == {"g-r"}
    b = batch.batch
    for row, session in enumerate(sessions):
        # One advantage per session (+1 / -1: two members), on the trained tokens only.
        expected = 1.0 if session == "rich" else -1.0
        trained = b["response_mask"][row] == 1
        assert b["advantages"][row][trained].tolist() == pytest.approx(
            [expected] * int(trained.sum()), abs=1e-5
        )
        assert b["advantages"][row][~trained].abs().sum() == 0
    assert torch.equal(b["advantages"], b["returns"])


async def verl_policy_loss_is_finite(batch: DataProto, model_path: Path) -> None:
    """verl's GRPO advantages and vanilla PPO loss on the batch, logprobs from the tiny model."""
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo import core_algos
    from verl.utils.torch_functional import logprobs_from_logits
    from verl.workers.config import ActorConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    b = batch.batch
    width = b["responses"].shape[1]
    logits = model(
        input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
    ).logits
    # as verl's dp_actor: the logits before each response token score it
    log_prob = logprobs_from_logits(logits[:, -width - 1 : -1], b["responses"])
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        index=batch.non_tensor_batch["uid"],
    )
    assert torch.isfinite(advantages).all()
    assert advantages[b["response_mask"] == 0].abs().sum() == 0
    config = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=1)
    loss_fn = core_algos.get_policy_loss_fn("vanilla")
    loss, metrics = loss_fn(
        old_log_prob=b["rollout_log_probs"],
        log_prob=log_prob,
        advantages=advantages,
        response_mask=b["response_mask"],
        loss_agg_mode="token-mean",
        config=config,
    )
    assert torch.isfinite(loss) and all(np.isfinite(v) for v in metrics.values())
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_a_session_with_branches_gives_verl_its_final_branch_and_counts_the_others() -> None:
    eos = 2
    fields = output_fields(branched_session(eos))
    assert (fields["prompt_ids"], fields["response_ids"]) == ([1, 10], [50, 51, eos])
    assert fields["response_mask"] == [1, 1, 1]
    assert fields["extra_fields"]["trajstore_branches"] == 2
    divergence = fields["extra_fields"]["trajstore_divergence"]
    assert divergence is not None  # where and why the history split, for the metrics


def test_split_sample_cuts_at_the_first_generated_token() -> None:
    split = split_sample(
        np.array([1, 2, 3, 4, 5, 6]),
        np.array([0, 0, 1, 0, 1, 1], dtype=np.uint8),
        np.array([0, 0, -0.5, 0, np.nan, -0.25], dtype=np.float32),
    )
    assert split.prompt_ids.tolist() == [1, 2]
    assert split.response_ids.tolist() == [3, 4, 5, 6]
    assert split.response_mask.tolist() == [1, 0, 0, 1]
    assert split.response_logprobs.tolist() == [-0.5, 0.0, 0.0, -0.25]
    assert split.missing_logprobs == 1
    nothing = split_sample(np.array([1, 2]), np.zeros(2, np.uint8), np.zeros(2, np.float32))
    assert (nothing.prompt_ids.tolist(), nothing.response_ids.tolist()) == ([1, 2], [])
    with pytest.raises(ValueError, match="differ in length"):
        split_sample(np.array([1]), np.zeros(2, np.uint8), np.zeros(1, np.float32))


def test_settings_come_from_options_then_the_environment() -> None:
    env = {
        "TRAJSTORE_PROXY_URL": "http://127.0.0.1:8400/",
        "TRAJSTORE_DATABASE_URL": "postgresql://db/x",
        "TRAJSTORE_VERL_COMMAND": "my-agent --fast 'two words'",
        "TRAJSTORE_VERL_TIMEOUT": "30",
        "TRAJSTORE_VERL_FAILURE_REWARD": "none",
    }
    settings = TrajstoreSettings.from_options({"run_id": "r"}, env)
    assert settings.proxy_url == "http://127.0.0.1:8400"
    assert settings.command == ("my-agent", "--fast", "two words") and settings.agent is None
    assert (settings.timeout_s, settings.failure_reward, settings.run_id) == (30.0, None, "r")
    agent = TrajstoreSettings.from_options({"agent": "pkg.mod:fn"}, env)  # options win
    assert (agent.agent, agent.command, agent.failure_reward) == ("pkg.mod:fn", None, None)
    defaults = TrajstoreSettings.from_options(
        {"agent": "pkg.mod:fn", "proxy_url": "http://p", "database_url": "postgresql://d"}, {}
    )
    assert (defaults.failure_reward, defaults.run_id, defaults.timeout_s) == (0.0, "verl", None)
    with pytest.raises(ValueError, match="proxy_url and database_url"):
        TrajstoreSettings.from_options({"agent": "pkg.mod:fn"}, {})
    with pytest.raises(ValueError, match="exactly one of agent"):
        TrajstoreSettings.from_options({"proxy_url": "http://p", "database_url": "d"}, {})
