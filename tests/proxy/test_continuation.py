"""Token-in continuation through the proxy, against the fake engine (its template is ChatML over
word ids, and it honours `kv_transfer_params.prompt_token_ids` as vLLM does).

What an agent's trainer would notice: a continued turn's prompt is the previous prompt + the
completion the engine sampled + the new messages, the turns make one sample, and each fallback
leaves the prompt to the engine's own rendering with its reason recorded.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import free_port
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.fake_tokens import EOS, NEWLINE, chat_prompt_ids
from tests.proxy.fixtures import ProxyFactory, RunningProxy, serve_proxy
from trajstore.proxy.settings import ProxySettings

# The fake engine stops with eos after 4 tokens when max_tokens allows more.
ASK: dict[str, Any] = {"model": "tiny", "max_tokens": 16, "extra_body": {"return_token_ids": True}}


@pytest.fixture
async def engine() -> Any:
    async with FakeEngine(completion_tokens=4) as fake:
        yield fake


async def take_turn(
    agent: Any, messages: list[dict[str, Any]], *, stream: bool = False, **extra: Any
) -> tuple[dict[str, Any], list[int], list[int]]:
    """One turn; the reply as the agent would send it back, the prompt and completion ids."""
    if not stream:
        answer = await agent.chat.completions.create(messages=messages, **{**ASK, **extra})
        choice = answer.choices[0]
        reply = choice.message.model_dump(exclude_none=True)
        return reply, answer.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    chunks = await agent.chat.completions.create(messages=messages, stream=True, **{**ASK, **extra})
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    async for chunk in chunks:
        prompt = prompt or (chunk.model_extra or {}).get("prompt_token_ids") or []
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
            text += choice.delta.content or ""
    return {"role": "assistant", "content": text}, prompt, ids


async def test_continued_turns_extend_the_sampled_ids_and_make_one_sample(
    proxy: RunningProxy, engine: FakeEngine, database_url: str
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    turns = []
    for k, (new, stream) in enumerate(
        [
            ({"role": "tool", "tool_call_id": "c1", "content": "5"}, True),
            ({"role": "user", "content": "thanks"}, False),
            (None, False),
        ]
    ):
        reply, prompt, completion = await take_turn(agent, messages, stream=stream)
        turns.append((prompt, completion))
        if k:
            before_prompt, before_completion = turns[k - 1]
            # The previous prompt and sampled completion, the template's newline after eos,
            # then the new messages and the generation prompt, as the template renders them.
            assert prompt[: len(before_prompt) + len(before_completion)] == (
                before_prompt + before_completion
            )
            assert before_completion[-1] == EOS and prompt[len(before_prompt) + 4] == NEWLINE
        if new is not None:
            messages += [reply, new]

    recorded = await proxy.session_record(session["session_id"])
    sources = [(t["prompt_source"], t["continuation"]) for t in recorded["turns"]]
    first, second, _ = (t["request_id"] for t in recorded["turns"])
    assert sources == [
        ("rendered", None),
        # the lineage's first: audited
        ("continued", {"request_id": first, "choice": 0, "audit": True, "drift_at": None}),
        # checked at the cost of its new messages: no drift figure
        ("continued", {"request_id": second, "choice": 0, "audit": False}),
    ]
    # The engine was sent exactly the ids it echoed.
    sent = [r.get("kv_transfer_params", {}).get("prompt_token_ids") for r in engine.requests]
    assert sent[1:] == [p for p, _ in turns[1:]]

    [sample] = await proxy.finished_samples(database_url, session["session_id"])
    assert sample.divergence is None and len(sample.turns) == 3
    assert sample.token_ids == turns[2][0] + turns[2][1]

    metrics = (await proxy.http.get(f"{proxy.url}/metrics")).text
    assert 'trajstore_chat_prompts_total{fallback="",source="continued"} 2.0' in metrics


@pytest.mark.parametrize(
    ("change", "fallback"),
    [
        ("edited_reply", "reply_changed"),
        ("truncated", "history_changed"),
        ("reordered", "history_changed"),
        ("tools_added", "render_options_changed"),
        ("assistant_injected", "new_messages_include_assistant"),
    ],
)
async def test_what_is_not_a_continuation_is_rendered_from_the_messages(
    proxy: RunningProxy, engine: FakeEngine, change: str, fallback: str
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "add 2 and 3"},
    ]
    reply, _, _ = await take_turn(agent, messages)
    extra: dict[str, Any] = {}
    if change == "edited_reply":
        messages = [*messages, {**reply, "content": reply["content"] + " (edited)"}]
    elif change == "truncated":
        messages = [messages[1], reply]
    elif change == "reordered":
        messages = [messages[1], messages[0], reply]
    elif change == "tools_added":
        messages = [*messages, reply]
        extra["tools"] = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    else:
        messages = [*messages, reply, {"role": "user", "content": "go on"}]
        messages.append({"role": "assistant", "content": "an injected reply"})
    messages.append({"role": "user", "content": "and 4?"})
    _, prompt, _ = await take_turn(agent, messages, **extra)

    turn = (await proxy.session_record(session["session_id"]))["turns"][1]
    assert (turn["prompt_source"], turn["continuation"]) == ("rendered", {"fallback": fallback})
    assert "kv_transfer_params" not in engine.requests[-1]
    assert prompt == chat_prompt_ids(messages)  # the engine's own rendering, as before


async def test_a_reply_sent_back_as_clients_reserialise_it_still_continues(
    proxy: RunningProxy, engine: FakeEngine
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add"}]
    reply, _, _ = await take_turn(agent, messages)
    # As some clients send text back: in content parts, with nulls they were given left out.
    sent = {"role": "assistant", "content": [{"type": "text", "text": reply["content"]}]}
    await take_turn(agent, [*messages, sent, {"role": "user", "content": "more"}])
    turn = (await proxy.session_record(session["session_id"]))["turns"][1]
    assert turn["prompt_source"] == "continued"


async def test_n_choices_the_one_sent_back_is_continued(
    proxy: RunningProxy, engine: FakeEngine
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "pick one"}]
    answer = await agent.chat.completions.create(messages=messages, n=2, **ASK)
    first, second = answer.choices
    assert first.message.content != second.message.content
    reply = {"role": "assistant", "content": second.message.content}
    _, prompt, _ = await take_turn(agent, [*messages, reply, {"role": "user", "content": "ok"}])
    before, turn = (await proxy.session_record(session["session_id"]))["turns"]
    continued = {"request_id": before["request_id"], "choice": 1, "audit": True, "drift_at": None}
    assert turn["continuation"] == continued
    base = answer.model_extra["prompt_token_ids"] + second.model_extra["token_ids"]
    assert prompt[: len(base)] == base


async def test_a_turn_cut_by_length_is_continued_after_the_templates_end_of_turn(
    proxy: RunningProxy, database_url: str
) -> None:
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "talk"}]
    reply, prompt, completion = await take_turn(agent, messages, max_tokens=3)  # cut before eos
    assert EOS not in completion
    _, next_prompt, _ = await take_turn(
        agent, [*messages, reply, {"role": "user", "content": "go on"}]
    )
    before, turn = (await proxy.session_record(session["session_id"]))["turns"]
    continued = {"request_id": before["request_id"], "choice": 0, "audit": True, "drift_at": None}
    assert turn["continuation"] == continued
    # The sampled ids, then the end of turn the template gives a reply, never sampled.
    cut = len(prompt) + len(completion)
    assert next_prompt[: cut + 2] == [*prompt, *completion, EOS, NEWLINE]
    [sample] = await proxy.finished_samples(database_url, session["session_id"])
    assert sample.loss_mask[cut - 3 : cut + 2] == [1, 1, 1, 0, 0]  # the end of turn: not learnt


async def test_a_restarted_replica_continues_from_the_log(
    engine: FakeEngine, database_url: str
) -> None:
    settings = ProxySettings(engines=[engine.url], port=free_port(), session_secret="shared")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "add 2 and 3"}]
    async with serve_proxy(settings, database_url) as before:
        session = await before.new_session()
        reply, prompt, completion = await take_turn(before.agent(session), messages)
    async with serve_proxy(settings.model_copy(update={"port": free_port()}), database_url) as now:
        session["base_url"] = session["base_url"].replace(before.url, now.url)
        messages += [reply, {"role": "tool", "tool_call_id": "c", "content": "5"}]
        _, next_prompt, _ = await take_turn(now.agent(session), messages)
        turn = (await now.session_record(session["session_id"]))["turns"][1]
    assert turn["prompt_source"] == "continued"
    assert next_prompt[: len(prompt) + len(completion)] == prompt + completion


async def test_an_engine_that_ignores_token_prompts_is_noticed(
    start_proxy: ProxyFactory,
) -> None:
    async with FakeEngine(
        completion_tokens=4, ignore_token_prompts=True, rewrite_replies=True
    ) as deaf:
        proxy = await start_proxy([deaf.url])
        session = await proxy.new_session()
        agent = proxy.agent(session)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for _ in range(3):
            reply, _, _ = await take_turn(agent, messages)
            messages += [reply, {"role": "user", "content": "and?"}]
        turns = (await proxy.session_record(session["session_id"]))["turns"]
        engines = (await proxy.http.get(f"{proxy.url}/admin/engines")).json()
    # Sent as ids, rendered by the engine anyway: recorded as rendered, and not tried again.
    assert [t["continuation"] for t in turns[1:]] == [
        {"fallback": "engine_ignored_token_prompt"}
    ] * 2
    assert "kv_transfer_params" in deaf.requests[1] and "kv_transfer_params" not in deaf.requests[2]
    assert engines[0]["token_prompts"] is False


async def test_drift_a_template_would_have_caused_is_avoided_and_recorded(
    start_proxy: ProxyFactory, database_url: str
) -> None:
    async with FakeEngine(completion_tokens=4, rewrite_replies=True) as rewriting:
        for mode in ("tokens", "text"):
            proxy = await start_proxy([rewriting.url], continuation=mode)
            session = await proxy.new_session()
            agent = proxy.agent(session)
            messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
            reply, first_prompt, _ = await take_turn(agent, messages)
            await take_turn(agent, [*messages, reply, {"role": "user", "content": "and?"}])
            before, turn = (await proxy.session_record(session["session_id"]))["turns"]
            samples = await proxy.finished_samples(database_url, session["session_id"])
            if mode == "tokens":
                # Rendered from text, the reply would differ right after the first prompt.
                assert turn["continuation"] == {
                    "request_id": before["request_id"],
                    "choice": 0,
                    "audit": True,
                    "drift_at": len(first_prompt),
                }
                assert len(samples) == 1
            else:
                assert turn["prompt_source"] == "rendered"
                assert [s.divergence.reason for s in samples if s.divergence] == [
                    "template_not_append_only"
                ]


async def test_continuation_text_leaves_every_prompt_to_the_engine(
    start_proxy: ProxyFactory, engine: FakeEngine
) -> None:
    proxy = await start_proxy([engine.url], continuation="text")
    session = await proxy.new_session()
    agent = proxy.agent(session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    reply, _, _ = await take_turn(agent, messages)
    await take_turn(agent, [*messages, reply, {"role": "user", "content": "and?"}])
    turns = (await proxy.session_record(session["session_id"]))["turns"]
    assert [t["prompt_source"] for t in turns] == ["rendered", "rendered"]
    assert engine.tokenized == [] and "kv_transfer_params" not in engine.requests[1]
