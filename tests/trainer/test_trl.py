"""TRL on trajstore's samples (`trajstore.rollout.trl_rollout`): the rollout_func against a real
vLLM through the proxy, one GRPOTrainer step on the tiny model, and recorded samples as a Dataset.

The vLLM tests share the session's real vLLM (CPU build) on the generated tiny model; TRL trains
the same checkpoint, found through the engine's `/v1/models`.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import numpy as np
import pytest
from openai import AsyncOpenAI

from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fixtures import ProxyFactory
from tests.trainer.rows import branched_session, insert_samples, rollout_rows, sample_row
from trajstore.rollout.trl_rollout import (
    Agent,
    RolloutFailed,
    TrajstoreRollout,
    recorded_reward,
    trl_fields,
)
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.store.samples import build_samples, final_branch
from trajstore.store.sessions import rebuild_session
from trajstore.store.tokens import decode_logprobs, decode_token_ids
from trajstore.trainer.selection import Selection
from trajstore.trainer.trl_dataset import DATASET_COLUMNS, samples_dataset

EOS = 2  # <|im_end|>: a bias makes the random model end its turns, as a real one does
Turn = tuple[list[int], list[int], list[float]]  # what the engine returned: prompt, ids, logprobs


def two_turn_agent(seen: list[list[Turn]], *, seeded: bool = True) -> Agent:
    """An unmodified openai-client agent: a question, the reply, a user follow-up, a reply."""

    async def agent(base_url: str, api_key: str, prompt: Any) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages: list[Any] = [{"role": "user", "content": prompt}]
        turns: list[Turn] = []
        try:
            for k, follow_up in enumerate(["now add 4", None]):
                answer = await client.chat.completions.create(
                    model="tiny",
                    messages=messages,
                    max_tokens=16,
                    temperature=1.0,
                    logprobs=True,
                    extra_body={"return_token_ids": True, "logit_bias": {str(EOS): 4}},
                    seed=k if seeded else None,
                )
                choice = answer.choices[0]
                assert answer.model_extra is not None and choice.model_extra is not None
                assert choice.logprobs is not None and choice.logprobs.content is not None
                turns.append(
                    (
                        answer.model_extra["prompt_token_ids"],
                        choice.model_extra["token_ids"],
                        [c.logprob for c in choice.logprobs.content],
                    )
                )
                if follow_up is not None:
                    reply = choice.message.model_dump(exclude_none=True)
                    messages += [reply, {"role": "user", "content": follow_up}]
        finally:
            await client.close()
        seen.append(turns)
        return float(sum(len(ids) for _, ids, _ in turns) % 5)  # differs between episodes

    return agent


async def tiny_model_dir(vllm: str) -> str:
    """The checkpoint the engine serves (vLLM reports it as the model's root)."""
    async with AsyncOpenAI(base_url=f"{vllm}/v1", api_key="none") as client:
        models = await client.models.list()
    root = models.data[0].model_extra.get("root") if models.data[0].model_extra else None
    assert isinstance(root, str), models
    return root


@pytest.mark.vllm
@pytest.mark.slow
async def test_the_rollout_of_a_two_turn_session_is_its_recorded_sample(
    start_proxy: ProxyFactory, vllm: str, database_url: str
) -> None:
    proxy = await start_proxy([vllm])
    seen: list[list[Turn]] = []
    rollout = TrajstoreRollout(proxy.url, database_url, two_turn_agent(seen), run_id="trl-a")
    out = await rollout.rollout(["add 2 and 3"])

    [prompt], [completion], [logprobs], [env_mask] = (
        out["prompt_ids"], out["completion_ids"], out["logprobs"], out["env_mask"],
    )  # fmt: skip
    [session_id] = out["trajstore_session_id"]
    # The sample the projector writes, read back from `samples`.
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
        rows = await store.pool.fetch(
            "SELECT token_ids, loss_mask, logprobs, reward, n_turns, divergence, group_id "
            "FROM samples WHERE session_id = $1",
            session_id,
        )
    [row] = rows  # two turns, one sample: the proxy continued the second from token ids
    assert row["n_turns"] == 2 and row["divergence"] is None
    tokens = np.asarray(decode_token_ids(row["token_ids"])).tolist()
    mask = list(row["loss_mask"])
    behaviour = np.asarray(decode_logprobs(row["logprobs"]), np.float32)

    # Token for token: ids, mask (TRL's env_mask on the completion), behaviour logprobs.
    assert prompt + completion == tokens
    assert [0] * len(prompt) + env_mask == mask
    assert np.array(logprobs, np.float32).tobytes() == behaviour[len(prompt) :].tobytes()
    assert mask[len(prompt)] == 1 and not any(mask[: len(prompt)])
    assert out["trajstore_reward"] == [row["reward"]]
    assert row["group_id"] == f"trl-a/-/0/{rollout.task_id('add 2 and 3')}"

    # ... and what the engine saw and returned to the agent: the user's follow-up is masked.
    [[(p1, c1, l1), (p2, c2, l2)]] = seen
    glue = p2[len(p1) + len(c1) :]
    assert prompt == p1 and p2[: len(p1) + len(c1)] == p1 + c1
    assert completion == c1 + glue + c2
    assert env_mask == [1] * len(c1) + [0] * len(glue) + [1] * len(c2) and glue
    generated = np.array(logprobs, np.float32)[np.array(env_mask, bool)]
    assert generated.tobytes() == np.array(l1 + l2, np.float32).tobytes()


@pytest.mark.vllm
@pytest.mark.slow
async def test_one_grpo_trainer_step_on_the_tiny_model_through_the_proxy(
    start_proxy: ProxyFactory,
    vllm: str,
    database_url: str,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset  # type: ignore[import-untyped,unused-ignore]
    from trl.trainer.grpo_config import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    proxy = await start_proxy([vllm])
    seen: list[list[Turn]] = []
    rollout = TrajstoreRollout(
        proxy.url,
        database_url,
        two_turn_agent(seen, seeded=False),
        run_id="trl-b",
        publish_policy_version=True,
    )
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-3,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        off_policy_mask_threshold=0.5,  # the one CPU path where TRL reads behaviour logprobs
    )
    trainer = GRPOTrainer(
        model=await tiny_model_dir(vllm),
        reward_funcs=[recorded_reward],
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["add 2 and 3", "add 4 and 5"]}),
        rollout_func=rollout,
    )
    # TRL's loop is synchronous; the proxy serves from this event loop, so train on a thread.
    await asyncio.to_thread(trainer.train)

    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(math.isfinite(entry["loss"]) for entry in logged)
    assert len(seen) == 2  # one prompt, two generations, two recorded agent sessions
    async with await EventStore.open(database_url) as store:
        rows = await store.pool.fetch(
            "SELECT session_id, group_id, metadata FROM trajectories WHERE run_id = 'trl-b'"
        )
        events = [await store.read_session(r["session_id"]) for r in rows]
    assert len(rows) == 2 and len({r["group_id"] for r in rows}) == 1
    records = [rebuild_session(r["session_id"], e) for r, e in zip(rows, events, strict=True)]
    assert {r.status for r in records} == {"completed"}
    assert {t.policy_version for r in records for t in r.turns} == {"0"}  # TRL's step 0


async def test_samples_dataset_has_one_row_per_selected_sample(
    store: EventStore, database_url: str
) -> None:
    rows = [
        sample_row(session_id="s-1", prompt=(1, 2, 3), completion=(4, 5), reward=1.0),
        sample_row(session_id="s-2", prompt=(1, 2), completion=(7, 8, 9), reward=0.0),
        sample_row(session_id="s-3", prompt=(1,), completion=(6,), run_id="other-run"),
    ]
    async with store.pool.acquire() as conn:
        await insert_samples(conn, rows)

    dataset = samples_dataset(database_url, Selection(runs=("run-1",)))
    assert dataset.num_rows == 2 and tuple(dataset.column_names) == DATASET_COLUMNS
    by_session = {r["session_id"]: r for r in dataset}
    first = by_session["s-1"]
    assert first["input_ids"] == [1, 2, 3, 4, 5]
    assert first["completion_mask"] == [0, 0, 0, 1, 1]
    assert np.array(first["logprobs"], np.float32).tolist() == pytest.approx(
        [0.0, 0.0, 0.0, -0.1, -0.2]
    )
    assert (first["prompt_len"], first["reward"], first["run_id"]) == (3, 1.0, "run-1")
    assert (first["group_id"], first["is_final"], first["status"]) == ("g-1", True, "completed")
    assert by_session["s-2"]["input_ids"] == [1, 2, 7, 8, 9]
    assert samples_dataset(database_url, Selection(runs=("nobody",))).num_rows == 0


async def test_a_rollout_s_lineages_are_dataset_rows_sharing_the_session_s_advantage(
    store: EventStore, database_url: str
) -> None:
    async with store.pool.acquire() as conn:
        await insert_samples(conn, rollout_rows())
    dataset = samples_dataset(database_url, Selection(rollouts=True))
    rows = sorted((r["session_id"], r["lineage"], r["role"], r["advantage"]) for r in dataset)
    assert rows == [
        ("plain", 0, "main", pytest.approx(-1.0, abs=1e-5)),
        ("rich", 0, "main", pytest.approx(1.0, abs=1e-5)),
        ("rich", 1, "subagent", pytest.approx(1.0, abs=1e-5)),
        ("rich", 2, "side", pytest.approx(1.0, abs=1e-5)),
    ]


@pytest.mark.vllm
@pytest.mark.slow
async def test_sft_trainer_trains_on_the_generated_tokens_of_a_recorded_run(
    start_proxy: ProxyFactory, vllm: str, database_url: str, tmp_path: Any
) -> None:
    from trl.trainer.sft_config import SFTConfig
    from trl.trainer.sft_trainer import SFTTrainer

    proxy = await start_proxy([vllm])
    agent = two_turn_agent([], seeded=False)
    await TrajstoreRollout(proxy.url, database_url, agent, run_id="trl-c").rollout(["a", "b"])
    async with await EventStore.open(database_url) as store:
        await Projector(store).run_once()
    dataset = samples_dataset(database_url, Selection(runs=("trl-c",), final_only=True))
    assert dataset.num_rows == 2

    config = SFTConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        completion_only_loss=True,  # learn from `completion_mask`: the generated tokens only
    )
    trainer = SFTTrainer(model=await tiny_model_dir(vllm), args=config, train_dataset=dataset)
    prepared_rows: Any = trainer.train_dataset  # with its `labels` column, as it trains on it
    for row, prepared in zip(dataset, prepared_rows, strict=True):
        pairs = zip(row["input_ids"], row["completion_mask"], strict=True)
        expected = [t if m else -100 for t, m in pairs]
        assert prepared["labels"] == expected and -100 in expected
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(math.isfinite(entry["loss"]) for entry in logged)


# -- without vLLM: the shape rules, and failing agents (the fake engine) --------------------------


def test_a_session_with_branches_gives_trl_its_last_branch() -> None:
    samples = build_samples(branched_session(EOS))
    assert len(samples) == 2
    fields = trl_fields(final_branch(samples))  # type: ignore[arg-type]
    assert (fields.prompt_ids, fields.completion_ids) == ([1, 10], [50, 51, EOS])
    assert fields.env_mask == [1, 1, 1] and fields.logprobs == [-0.5] * 3
    first = trl_fields(samples[0])
    assert first.completion_ids == [20, EOS, 30, 40, EOS] and first.env_mask == [1, 1, 0, 1, 1]


@pytest.mark.slow
async def test_a_failing_agent_is_finished_as_error_and_raised_or_masked(
    start_proxy: ProxyFactory, engine: FakeEngine, database_url: str
) -> None:
    proxy = await start_proxy([engine.url])

    async def crashes_after_one_call(base_url: str, api_key: str, prompt: Any) -> float:
        client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        async with client:
            await client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4
            )
        raise RuntimeError("the agent's tool crashed")

    raising = TrajstoreRollout(proxy.url, database_url, crashes_after_one_call, run_id="r")
    with pytest.raises(RolloutFailed, match="the agent failed"):
        await raising.rollout(["hello"])
    masking = TrajstoreRollout(
        proxy.url, database_url, crashes_after_one_call, run_id="r", on_agent_error="mask"
    )
    out = await masking.rollout(["hello"])
    assert out["trajstore_reward"] == [None] and out["completion_ids"][0]
    assert set(out["env_mask"][0]) == {0}  # nothing of it is trained on
    async with await EventStore.open(database_url) as store:
        statuses = await store.pool.fetch("SELECT status, finish_reason FROM trajectories")
    assert [(r["status"], r["finish_reason"]) for r in statuses] == [
        ("error", "RuntimeError: the agent's tool crashed")
    ] * 2
    assert recorded_reward(["p"], [None]) == [None]
