"""A toy task with a rule-based reward, and a run of it recorded as the proxy would record it.

The task: asked for a number, answer with digits. The reward of a completion is the share of its
tokens that are digit tokens ("0" ... "9" and any digit-only token), a rule a random model
scores low on (about 10 of its 512 tokens are digits) but not zero, so GRPO has a signal from
the first step.

`record_toy_run` samples completions from the model itself (transformers, temperature 1, no
top-k/top-p, so the behaviour logprobs are the model's own) and appends them as the events the
proxy records for a chat session (`store.sessions` documents them), then runs the samples
projection. It stands in for agents talking to vLLM through the proxy: same events, no engine,
so the recipe and its test run in seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream
from trajstore.store.payloads import Payload
from trajstore.store.payloads_request import (
    CompletionChunk,
    CompletionFinished,
    FinishedChoice,
    PromptTokens,
    RequestReceived,
)
from trajstore.store.payloads_session import RewardAssigned, SessionCreated, SessionFinished
from trajstore.store.projection import Projector
from trajstore.trainer.loss import token_logprobs

SUBJECTS = (
    "apples", "stars", "birds", "chairs", "books", "trees", "ships", "coins", "lamps", "cats",
    "doors", "clouds", "rivers", "stones", "cups", "maps",
)  # fmt: skip


def questions(subjects: Sequence[str] = SUBJECTS) -> list[str]:
    """The task's questions about these subjects (keep training and held-out subjects apart)."""
    return [f"How many {subject} are there? Answer with a number." for subject in subjects]


def digit_token_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that decode to digits only (what the reward counts)."""
    ids = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text and text.strip() == text and text.isdigit():
            ids.append(token_id)
    return ids


def reward(completion: Sequence[int], digits: set[int]) -> float:
    """The share of the completion's tokens that are digit tokens (0 for an empty completion)."""
    return sum(t in digits for t in completion) / len(completion) if completion else 0.0


def load(model_dir: Path) -> tuple[Any, Any]:
    """The model (float32, CPU) and tokenizer in `model_dir` (see `trajstore.tiny_model`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(model_dir)


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    """The chat prompt of one question, as the engine would see it."""
    messages = [{"role": "user", "content": question}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def sample_completions(
    model: Any, prompt: list[int], n: int, max_new_tokens: int, generator: torch.Generator
) -> list[tuple[list[int], list[float]]]:
    """`n` completions of `prompt` sampled at temperature 1, each with its tokens' logprobs.

    Sampled by hand (one token at a time, all `n` at once, with a KV cache) so that nothing but
    the model's own distribution decides. The logprobs come from one full forward pass over the
    result, as a trainer computes them; they differ from the sampling pass's only by float
    rounding (a real, tiny, train-inference mismatch).
    """
    eos = model.config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    sequences = torch.tensor([prompt] * n)
    finished = torch.zeros(n, dtype=torch.bool)
    step_input, cache = sequences, None
    for _ in range(max_new_tokens):
        out = model(step_input, past_key_values=cache, use_cache=True)
        cache = out.past_key_values  # only the new token goes through the model next time
        probs = torch.softmax(out.logits[:, -1].float(), dim=-1)
        token = torch.multinomial(probs, 1, generator=generator)
        sequences = torch.cat([sequences, token], dim=1)
        step_input = token
        finished |= torch.tensor([t in stop for t in token[:, 0].tolist()])
        if finished.all():
            break
    logprobs = token_logprobs(model(sequences).logits, sequences)
    out = []
    for row, row_logprobs in zip(sequences.tolist(), logprobs.tolist(), strict=True):
        completion = row[len(prompt) :]
        end = next((i + 1 for i, t in enumerate(completion) if t in stop), len(completion))
        out.append((completion[:end], row_logprobs[len(prompt) : len(prompt) + end]))
    return out


async def record_toy_run(
    store: EventStore,
    model_dir: Path,
    run_id: str,
    *,
    subjects: Sequence[str] = SUBJECTS[:12],
    group_size: int = 8,
    max_new_tokens: int = 16,
    seed: int = 0,
    policy_version: int = 0,
) -> list[float]:
    """Record `group_size` sessions per subject (one GRPO group each), project them.

    Returns the rewards, in recording order.
    """
    model, tokenizer = load(model_dir)
    model.eval()
    digits = set(digit_token_ids(tokenizer))
    generator = torch.Generator().manual_seed(seed)
    rewards = []
    for p, question in enumerate(questions(subjects)):
        prompt = prompt_ids(tokenizer, question)
        completions = sample_completions(model, prompt, group_size, max_new_tokens, generator)
        for g, (completion, logprobs) in enumerate(completions):
            session_id = f"{run_id}-{p}-{g}"
            value = reward(completion, digits)
            rewards.append(value)
            await _record_session(
                store, run_id, session_id, f"{run_id}-q{p}", question, prompt,
                completion, logprobs, value, policy_version, max_new_tokens,
            )  # fmt: skip
    await Projector(store).run_once()
    return rewards


async def _record_session(
    store: EventStore,
    run_id: str,
    session_id: str,
    group_id: str,
    question: str,
    prompt: list[int],
    completion: list[int],
    logprobs: list[float],
    value: float,
    policy_version: int,
    max_new_tokens: int,
) -> None:
    def event(payload: Payload, **arrays: Any) -> NewEvent:
        kind = EventType(payload.event_type)
        return NewEvent(kind, session_id=session_id, run_id=run_id, payload=payload, **arrays)

    request_id = f"{session_id}-r0"
    # The sampler stops at an end-of-turn token; without one the completion hit the length cap.
    ending = "stop" if len(completion) < max_new_tokens else "length"
    body = {"messages": [{"role": "user", "content": question}]}
    created = SessionCreated(task_id=group_id, group_id=group_id, metadata={"tags": ["toy"]})
    await store.append(session_stream(session_id), [event(created)])
    await store.append(
        request_stream(request_id),
        [
            event(
                RequestReceived(
                    request_id=request_id, api="chat", body=body, policy_version=str(policy_version)
                )
            ),
            event(PromptTokens(choice=None), token_ids=prompt),
            event(CompletionChunk(choice=0, text=""), token_ids=completion, logprobs=logprobs),
            event(CompletionFinished(choices=[FinishedChoice(index=0, finish_reason=ending)])),
        ],
    )
    await store.append(
        session_stream(session_id),
        [
            event(RewardAssigned(value=value, source="toy_task.reward")),
            event(SessionFinished(status="completed")),
        ],
    )


@torch.no_grad()
def expected_reward(model: Any, batch: Any, digits: Sequence[int]) -> float:
    """The policy's expected reward per token on a batch's completions (teacher-forced).

    At each generated position of the batch, the probability the model now gives to a digit
    token; averaged. It is the reward a completion would earn in expectation at those contexts,
    measured without sampling noise, so two models compare exactly on the same held-out batch.
    """
    logits = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"].long(),
        position_ids=batch["position_ids"],
    ).logits[:, :-1]
    digit_mass = torch.softmax(logits.float(), dim=-1)[..., list(digits)].sum(-1)
    mask = batch["loss_mask"][:, 1:]
    return float(digit_mass[mask].mean())
