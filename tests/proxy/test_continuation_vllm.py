"""Token-in continuation against a real vLLM (CPU build) on the generated tiny model, through the
official openai client: a multi-turn session becomes one sample whose every token is what the
engine saw or sampled, with two chat templates that are not append-only for this model.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.proxy.fixtures import ProxyFactory, RunningProxy
from trajstore.store import EventStore
from trajstore.store.samples import Sample, build_samples
from trajstore.store.sessions import rebuild_session

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
EOS = 2  # <|im_end|>: a bias makes the random model end its turns, as a real one does
SAMPLING: dict[str, Any] = {"model": "tiny", "temperature": 1.0, "max_tokens": 40, "tools": TOOLS}

# The pattern of thinking models (Qwen3's): the generation prompt opens a think block, and
# earlier replies are rendered without their reasoning, so a reply never re-renders as sampled.
THINKING_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}"
    "<|im_start|>assistant\n{{ (m.content or '').split('</think>')[-1] }}<|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ m.role }}\n{{ m.content or '' }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)

# Four turns: the new messages after each reply, and whether the turn is streamed.
PLAN = [
    ({"role": "tool", "tool_call_id": "call-1", "content": "5"}, False),
    ({"role": "user", "content": "now add 4"}, True),
    ({"role": "tool", "tool_call_id": "call-2", "content": "9"}, False),
    (None, False),
]


async def run_agent(
    proxy: RunningProxy, template: str | None
) -> tuple[str, list[tuple[list[int], list[int], list[float]]]]:
    """A tool-using agent, as an unmodified openai-client loop; what the engine returned."""
    session = await proxy.new_session(task_id="add")
    agent = proxy.agent(session)
    extra: dict[str, Any] = {"return_token_ids": True, "logit_bias": {str(EOS): 5}}
    if template is not None:
        extra["chat_template"] = template
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You add numbers with the add tool."},
        {"role": "user", "content": "add 2 and 3"},
    ]
    received = []
    for k, (new, stream) in enumerate(PLAN):
        ask = {**SAMPLING, "seed": k, "logprobs": True, "extra_body": extra}
        if stream:
            chunks = await agent.chat.completions.create(messages=messages, stream=True, **ask)
            prompt: list[int] = []
            ids: list[int] = []
            logprobs: list[float] = []
            text = ""
            async for chunk in chunks:
                prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids") or []
                for choice in chunk.choices:
                    ids += (choice.model_extra or {}).get("token_ids") or []
                    if choice.logprobs is not None:
                        logprobs += [c.logprob for c in choice.logprobs.content or []]
                    text += choice.delta.content or ""
            reply: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            answer = await agent.chat.completions.create(messages=messages, **ask)
            choice = answer.choices[0]
            prompt = answer.model_extra["prompt_token_ids"]
            ids = choice.model_extra["token_ids"]
            logprobs = [c.logprob for c in choice.logprobs.content]
            reply = choice.message.model_dump(exclude_none=True)  # as the client sends it back
        received.append((prompt, ids, logprobs))
        if new is not None:
            messages += [reply, new]
    finish = f"{proxy.url}/sessions/{session['session_id']}/finish"
    assert (await proxy.http.post(finish, json={"status": "completed"})).status_code == 200
    return session["session_id"], received


async def samples_of(database_url: str, session_id: str) -> tuple[list[Sample], list[Any]]:
    store = await EventStore.open(database_url)
    try:
        record = rebuild_session(session_id, await store.read_session(session_id), packed=True)
    finally:
        await store.close()
    return build_samples(record), record.turns


@pytest.mark.parametrize("template", [None, THINKING_TEMPLATE], ids=["tiny-chatml", "thinking"])
async def test_an_agent_session_is_one_token_exact_sample(
    start_proxy: ProxyFactory, vllm: str, database_url: str, template: str | None
) -> None:
    # Every continued turn audited, so that the drift avoided is measured on each.
    proxy = await start_proxy([vllm], continuation_audit_every=1, continuation_audit_growth=0)
    session_id, received = await run_agent(proxy, template)
    samples, turns = await samples_of(database_url, session_id)

    # Each prompt starts with the previous prompt and the completion exactly as sampled.
    for (prompt, _, _), (before, completion, _) in zip(received[1:], received, strict=False):
        assert completion[-1] == EOS
        assert prompt[: len(before) + len(completion)] == before + completion
    assert [t.prompt_source for t in turns] == ["rendered"] + ["continued"] * 3
    # The drift avoided: somewhere the template would have rendered other ids.
    assert any(t.continuation and t.continuation.drift_at is not None for t in turns[1:])

    [sample] = samples
    assert sample.divergence is None and len(sample.turns) == 4
    final_prompt, final_completion, _ = received[-1]
    assert sample.token_ids == final_prompt + final_completion
    # Mask 1 and behaviour logprobs exactly where the engine sampled, with its logprobs.
    mask, behaviour = sample.mask_array(), sample.logprob_array()
    for prompt, completion, logprobs in received:
        span = slice(len(prompt), len(prompt) + len(completion))
        assert mask[span].all()
        assert behaviour[span].tobytes() == np.array(logprobs, np.float32).tobytes()
    assert int(mask.sum()) == sum(len(c) for _, c, _ in received)


@pytest.mark.parametrize("template", [None, THINKING_TEMPLATE], ids=["tiny-chatml", "thinking"])
async def test_rendered_from_text_the_same_agent_drifts(
    start_proxy: ProxyFactory, vllm: str, database_url: str, template: str | None
) -> None:
    proxy = await start_proxy([vllm], continuation="text")
    session_id, received = await run_agent(proxy, template)
    samples, turns = await samples_of(database_url, session_id)
    assert {t.prompt_source for t in turns} == {"rendered"}
    # Some prompt does not start with the previous prompt + completion: the sample splits there.
    drifted = [
        k + 1
        for k, ((prompt, _, _), (before, completion, _)) in enumerate(
            zip(received[1:], received, strict=False)
        )
        if prompt[: len(before) + len(completion)] != before + completion
    ]
    assert drifted
    assert [t for s in samples[1:] if s.divergence for t in [s.divergence.turn]] == drifted
    if template is not None:  # every reply re-renders without the think block it followed
        assert drifted == [1, 2, 3]
