"""Building training samples from a recorded session: token-exact, with loss masks (no I/O)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trajstore.store.payloads_session import RewardAssigned
from trajstore.store.samples import build_samples, sample_id
from trajstore.store.sessions import ChoiceRecord, SessionRecord, TurnRecord

EOS = 2


def turn(
    prompt: list[int],
    *choices: list[int],
    finish: str = "stop",
    status: str = "completed",
    tools: bool = False,
    index: int = 0,
) -> TurnRecord:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}]}
    # `tools`: the completion calls a tool, as the recorder keeps it in the choice's message.
    call = {"type": "function", "function": {"name": "add", "arguments": "{}"}}
    message = {"role": "assistant", "tool_calls": [call]} if tools else None
    record = TurnRecord(
        request_id=f"r{index}-{len(prompt)}",
        api="chat",
        body=body,
        engine="http://e1",
        policy_version="v1",
        logprobs_mode="raw_logprobs",
        stream=False,
        sampling={},
        prompt_added=prompt,
        status=status,
    )
    for i, ids in enumerate(choices):
        record.choices[i] = ChoiceRecord(
            index=i,
            token_ids=ids,
            logprobs=[-0.5] * len(ids),
            finish_reason=finish,
            message=message,
        )
    return record


def session(*turns: TurnRecord) -> SessionRecord:
    record = SessionRecord("s1", run_id="r", status="completed")
    record.turns = list(turns)
    record.rewards = [RewardAssigned(value=1.0)]
    return record


def test_turns_that_extend_make_one_sample_with_masks_and_logprobs() -> None:
    t1 = turn([1, 10, 11], [20, 21, EOS], tools=True)
    t2 = turn([1, 10, 11, 20, 21, EOS, 30, 31], [40, EOS])
    [sample] = build_samples(session(t1, t2))
    assert sample.token_ids == [1, 10, 11, 20, 21, EOS, 30, 31, 40, EOS]
    assert sample.loss_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert sample.logprobs == [0.0] * 3 + [-0.5] * 3 + [0.0] * 2 + [-0.5] * 2
    assert (sample.prompt_len, sample.response_len) == (3, 5)
    assert sample.turns == [0, 1] and sample.tool_turns == 1
    assert sample.divergence is None and sample.is_final
    assert sample.policy_versions == ["v1"] and sample.engines == ["http://e1"]


def test_an_end_of_turn_token_the_next_prompt_does_not_repeat_is_kept_once() -> None:
    t1 = turn([1, 10], [20, EOS])
    t2 = turn([1, 10, 20, 30], [40])  # the template re-rendered the turn without its EOS
    [sample] = build_samples(session(t1, t2))
    assert sample.token_ids == [1, 10, 20, EOS, 30, 40]
    assert sample.loss_mask == [0, 0, 1, 1, 0, 1]


def test_a_length_cut_completion_is_followed_by_the_templates_glue() -> None:
    t1 = turn([1, 10], [20, 21], finish="length")
    t2 = turn([1, 10, 20, 21, EOS, 30], [40])
    [sample] = build_samples(session(t1, t2))
    assert sample.loss_mask == [0, 0, 1, 1, 0, 0, 1]


def test_a_rewritten_history_starts_a_branch_and_says_where_and_why() -> None:
    system, reply = list(range(200, 220)), list(range(100, 116))
    t1 = turn([1, *system, 11], reply)
    t2 = turn([1, *system, 99, *reply, 30], [40])  # a message changed, the reply kept
    first, second = build_samples(session(t1, t2))
    assert (second.lineage, second.branch) == (0, 1)
    assert second.token_ids == [1, *system, 99, *reply, 30, 40]
    assert second.divergence is not None
    assert second.divergence.as_json() == {"turn": 1, "position": 21, "reason": "history_rewritten"}
    assert not first.is_final and second.is_final


def test_a_re_rendered_completion_is_a_template_that_is_not_append_only() -> None:
    t1 = turn([1, 10], [20, 21, 22])
    t2 = turn([1, 10, 20, 77, 22, 30], [40])  # e.g. a tool call re-serialised
    _, second = build_samples(session(t1, t2))
    assert second.divergence is not None
    assert second.divergence.reason == "template_not_append_only"
    assert second.divergence.position == 3


def test_a_truncated_context_is_named_so() -> None:
    t1 = turn([1, 10, 11, 12], [20])
    t2 = turn([1, 10], [40])
    _, second = build_samples(session(t1, t2))
    assert second.divergence is not None and second.divergence.reason == "history_truncated"


def test_failed_turns_and_turns_without_choices_are_left_out() -> None:
    t1 = turn([1, 10], [20], status="failed")
    t2 = turn([1, 10], [21])  # the retry
    [sample] = build_samples(session(t1, t2))
    assert sample.turns == [1] and sample.token_ids == [1, 10, 21]


def test_an_empty_completion_extends_by_nothing() -> None:
    t1 = turn([1, 10], [])
    t2 = turn([1, 10, 30], [40])
    [sample] = build_samples(session(t1, t2))
    assert sample.token_ids == [1, 10, 30, 40] and sample.loss_mask == [0, 0, 0, 1]


def test_with_n_choices_the_continued_one_stays_and_the_others_stand_alone() -> None:
    t1 = turn([1, 10], [20], [21])
    t2 = turn([1, 10, 21, 30], [40])  # the agent continued from choice 1
    samples = build_samples(session(t1, t2))
    main = [s for s in samples if s.alternative_of is None]
    alternatives = [s for s in samples if s.alternative_of is not None]
    assert [s.token_ids for s in main] == [[1, 10, 21, 30, 40]]
    assert [(s.token_ids, s.loss_mask, s.alternative_of) for s in alternatives] == [
        ([1, 10, 20], [0, 0, 1], 0)
    ]


def test_sample_ids_are_deterministic() -> None:
    t1 = turn([1, 10], [20])
    assert build_samples(session(t1))[0].sample_id == build_samples(session(t1))[0].sample_id
    assert sample_id("s1", 0, 0) != sample_id("s1", 0, 1) != sample_id("s2", 0, 0)
    assert sample_id("s1", 0, 1) != sample_id("s1", 1, 0)


def test_missing_logprobs_are_nan_not_invented() -> None:
    t1 = turn([1, 10], [20, 21])
    t1.choices[0].logprobs = []
    [sample] = build_samples(session(t1))
    assert all(math.isnan(v) for v in sample.logprobs[2:])


@pytest.mark.parametrize(
    "constraint",
    [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "add"}}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"guided_regex": "[0-9]+"},
    ],
)
def test_a_constrained_turn_keeps_its_tokens_but_has_no_behaviour_logprobs(
    constraint: dict[str, Any],
) -> None:
    forced = turn([1, 10], [20, 21, EOS])
    forced.body.update(constraint)
    free = turn([1, 10, 20, 21, EOS, 30], [40, EOS])
    assert forced.constrained_by is not None and free.constrained_by is None
    [sample] = build_samples(session(forced, free))
    assert sample.token_ids == [1, 10, 20, 21, EOS, 30, 40, EOS]
    assert sample.loss_mask == [0, 0, 1, 1, 1, 0, 1, 1]
    logprobs = sample.logprobs
    assert all(math.isnan(x) for x in logprobs[2:5])  # grammar-masked: not the model's
    assert logprobs[6:] == [-0.5, -0.5]  # the free turn's, as recorded
