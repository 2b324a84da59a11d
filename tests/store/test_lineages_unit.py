"""Lineages: which conversation of a session each turn belongs to, from the tokens alone (no I/O).

The sequences mimic what agent harnesses send through one session: a main loop with a long
system prompt, sub-agents with their own, one-off side calls, compaction, an edit. Token ids are
made distinct per message so the tests read as conversations.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from trajstore.store.lineages import assign
from trajstore.store.payloads_request import PromptPrefix
from trajstore.store.payloads_session import RewardAssigned
from trajstore.store.samples import build_samples, final_branch, rollout_rows
from trajstore.store.sessions import ChoiceRecord, SessionRecord, TurnRecord
from trajstore.store.tokens import encode_token_ids, shared_prefix

EOS = 2
_fresh = itertools.count(1000)


def text(n: int) -> list[int]:
    """`n` ids no other message has."""
    return [next(_fresh) for _ in range(n)]


def chat(*messages: list[int]) -> list[int]:
    """A prompt: each message framed as a template frames it, then the generation prompt."""
    out: list[int] = []
    for message in messages:
        out += [1, *message, EOS, 3]
    return [*out, 1, 4]


class Recorder:
    """Builds a session as the proxy records it, each prompt whole or as a reference to the turn
    it continues (`by_reference`), which must not change any answer."""

    def __init__(self, by_reference: bool) -> None:
        self.by_reference = by_reference
        self.session = SessionRecord("s", run_id="r", status="completed")
        self.session.rewards = [RewardAssigned(value=1.0)]
        self.states: dict[str, bytes] = {}

    def call(
        self,
        prompt: list[int],
        completion: list[int],
        continues: str | None = None,
        messages: list[Any] | None = None,
    ) -> str:
        n = len(self.session.turns)
        request_id = f"t{n}"
        packed = encode_token_ids(prompt)
        body = {} if messages is None else {"messages": messages}
        turn = TurnRecord(request_id, "chat", body, "e", "0", None, False, {}, packed)
        turn.status = "completed"
        turn.received_at, turn.latency_s = float(n), 0.5
        ids = encode_token_ids(completion)
        reply = {"role": "assistant", "content": f"reply {n}"}
        turn.choices[0] = ChoiceRecord(0, ids, bytes(len(ids)), finish_reason="stop", message=reply)  # type: ignore[arg-type]
        prefix = None
        if self.by_reference and continues is not None:
            shared = shared_prefix(packed, self.states[continues])
            prefix = PromptPrefix(request_id=continues, n_tokens=shared)
            turn.prompt_prefix, turn.prompt_added = prefix, packed[4 * shared :]
        self.session.prompts.add(request_id, turn.prompt_added, prefix)
        self.session.messages.add(request_id, messages, None)
        self.session.prompts.completed(request_id, encode_token_ids(completion))
        turn.session = self.session
        self.session.packed = True
        self.session.turns.append(turn)
        self.states[request_id] = packed + encode_token_ids(completion)
        return request_id


@pytest.fixture(params=[False, True], ids=["whole", "by_reference"])
def recorder(request: pytest.FixtureRequest) -> Recorder:
    return Recorder(request.param)


def lineages(session: SessionRecord) -> list[list[int]]:
    return [lineage.turns for lineage in assign(session).lineages]


def test_interleaved_conversations_are_one_lineage_each(recorder: Recorder) -> None:
    """M1 S1 M2 S2 M3 T: a main loop, a sub-agent with its own system prompt, a title call."""
    main_sys, sub_sys, title_sys = text(300), text(120), text(40)
    task, subtask = text(20), text(15)
    m1 = chat(main_sys, task)
    r1 = [*text(24), EOS]
    s1 = chat(sub_sys, subtask)
    q1 = [*text(12), EOS]
    m2 = [*m1, *r1, 3, *chat(text(30))]
    r2 = [*text(20), EOS]
    s2 = [*s1, *q1, 3, *chat(text(10))]
    m3 = [*m2, *r2, 3, *chat(text(40))]
    a = recorder.call(m1, r1)
    b = recorder.call(s1, q1)
    a = recorder.call(m2, r2, a)
    recorder.call(s2, [*text(9), EOS], b)
    recorder.call(m3, [*text(30), EOS], a)
    recorder.call(chat(title_sys, task), [*text(6), EOS])
    samples = build_samples(recorder.session)
    assert [s.turns for s in samples] == [[0, 2, 4], [1, 3], [5]]
    assert [s.role for s in samples] == ["main", "subagent", "side"]
    assert all(s.divergence is None for s in samples)
    default = final_branch(samples)
    assert default is not None and default.turns == [0, 2, 4]
    assert [s.lineage for s in rollout_rows(samples)] == [0, 1, 2]
    assert all(s.session.reward == 1.0 for s in samples)


def test_a_sub_agent_repeating_the_system_prompt_forks_from_the_main_loop(
    recorder: Recorder,
) -> None:
    system = text(200)
    m1 = chat(system, text(20))
    recorder.call(m1, [*text(20), EOS])
    recorder.call(chat(system, text(25)), [*text(20), EOS])
    forest = assign(recorder.session)
    first, second = forest.lineages
    assert second.parent == 0 and second.fork_at == len(chat(system)) - 2 + 1
    assert first.parent is None and first.fork_at is None


def test_a_side_call_off_the_tip_leaves_the_conversation_it_did_not_continue(
    recorder: Recorder,
) -> None:
    """A summary request extends the main loop's last reply; the loop goes on without it."""
    m1 = chat(text(100), text(20))
    r1 = [*text(20), EOS]
    a = recorder.call(m1, r1)
    recorder.call([*m1, *r1, 3, *chat(text(10))], [*text(30), EOS], a)  # "summarise this"
    m2 = [*m1, *r1, 3, *chat(text(50))]
    r2 = [*text(20), EOS]
    b = recorder.call(m2, r2, a)
    recorder.call([*m2, *r2, 3, *chat(text(10))], [*text(10), EOS], b)
    forest = assign(recorder.session)
    assert lineages(recorder.session) == [[0, 2, 3], [1]]
    side = forest.lineages[1]
    assert (side.parent, side.fork_at, side.role) == (0, len(m1) + len(r1), "side")
    samples = build_samples(recorder.session)
    assert all(s.divergence is None for s in samples)


def test_parallel_calls_from_one_point_are_two_lineages(recorder: Recorder) -> None:
    """Two calls from the same point (sub-agents started at once): the later one continues the
    lineage, the earlier one becomes a lineage forked there; each goes on in its own."""
    m1 = chat(text(100), text(20))
    r1 = [*text(20), EOS]
    a = recorder.call(m1, r1)
    x = recorder.call([*m1, *r1, 3, *chat(text(30))], [*text(10), EOS], a)
    y = recorder.call([*m1, *r1, 3, *chat(text(31))], [*text(10), EOS], a)
    x_state = recorder.states[x]
    recorder.call([*_ids(x_state), 3, *chat(text(5))], [*text(10), EOS], x)
    recorder.call([*_ids(recorder.states[y]), 3, *chat(text(5))], [*text(10), EOS], y)
    assert lineages(recorder.session) == [[0, 2, 4], [1, 3]]
    assert all(s.divergence is None for s in build_samples(recorder.session))


def test_compaction_is_a_divergence_of_the_lineage_it_compacted(recorder: Recorder) -> None:
    """The loop asks for a summary (a turn of its own), then starts over from the summary."""
    system = text(150)
    prompt, reply = chat(system, text(40)), [*text(60), EOS]
    last = recorder.call(prompt, reply)
    for _ in range(3):
        prompt = [*prompt, *reply, 3, *chat(text(200))]
        reply = [*text(60), EOS]
        last = recorder.call(prompt, reply, last)
    summary_request = [*prompt, *reply, 3, *chat(text(10))]
    summary = [*text(80), EOS]
    recorder.call(summary_request, summary, last)
    compacted = chat(system, [*text(5), *summary[:-1]], text(12))
    recorder.call(compacted, [*text(10), EOS])
    samples = build_samples(recorder.session)
    assert [(s.lineage, s.branch) for s in samples] == [(0, 0), (0, 1)]
    assert samples[1].divergence is not None
    assert samples[1].divergence.reason == "compacted"
    assert samples[1].is_final and samples[1].role == "main"


def test_an_edit_inside_one_lineage_is_a_divergence_there_and_only_there(
    recorder: Recorder,
) -> None:
    system, task = text(120), text(30)
    prompt, reply = chat(system, task), [*text(20), EOS]
    main = recorder.call(prompt, reply)
    side_sys = text(60)
    s1 = chat(side_sys, text(10))
    side = recorder.call(s1, [*text(12), EOS])
    history: list[list[int]] = [task]
    for _ in range(2):
        history += [reply[:-1], text(40)]
        prompt, reply = [*prompt, *reply, 3, *chat(history[-1])], [*text(20), EOS]
        main = recorder.call(prompt, reply, main)
    # The agent edits its first message and sends the rest of the history again.
    edited = chat(system, [*task[:10], *text(3), *task[10:]], *history[1:], reply[:-1], text(8))
    recorder.call(edited, [*text(15), EOS])
    s2 = [*_ids(recorder.states[side]), 3, *chat(text(8))]
    recorder.call(s2, [*text(12), EOS], side)
    samples = build_samples(recorder.session)
    assert [(s.lineage, s.branch, s.turns) for s in samples] == [
        (0, 0, [0, 2, 3]), (0, 1, [4]), (1, 0, [1, 5]),
    ]  # fmt: skip
    divergences = [s.divergence.reason for s in samples if s.divergence is not None]
    assert divergences == ["history_rewritten"]


def test_many_unrelated_one_call_lineages(recorder: Recorder) -> None:
    """An agent using the session as a plain endpoint: every call its own lineage."""
    system = text(64)
    for n in range(400):
        recorder.call(chat(system, text(5 + n % 7)), [*text(3), EOS])
    forest = assign(recorder.session)
    assert len(forest.lineages) == 400
    # Each forks from one that shares the system prompt with it.
    assert [lin.parent is None for lin in forest.lineages] == [True] + [False] * 399
    assert {lin.fork_at for lin in forest.lineages[1:]} == {len(chat(system)) - 2 + 1}
    assert sum(lineage.role == "main" for lineage in forest.lineages) == 1


def test_the_orchestrator_names_the_main_lineage(recorder: Recorder) -> None:
    recorder.call(chat(text(300), text(10)), [*text(5), EOS])
    recorder.call(chat(text(30), text(10)), [*text(5), EOS])
    assert assign(recorder.session).main == 0
    recorder.session.main_lineage = 1
    samples = build_samples(recorder.session)
    assert [(s.lineage, s.role, s.is_final) for s in samples] == [
        (0, "side", False), (1, "main", True),
    ]  # fmt: skip


def _ids(packed: bytes) -> list[int]:
    import numpy as np

    values: Any = np.frombuffer(packed, "<i4").tolist()
    return list(values)


def test_the_same_messages_with_other_tokens_are_the_same_conversation(recorder: Recorder) -> None:
    """A history rendered again from text (after a fallback, or by a thinking template that
    drops earlier reasoning) re-tokenises the first reply: the messages say it is the same
    conversation, so it is a divergence of it, not a new one."""
    system, task = text(100), text(20)
    said = [{"role": "system", "content": "s"}, {"role": "user", "content": "t"}]
    reply = [*text(12), EOS]
    first = recorder.call(chat(system, task), reply, messages=said)
    again = [*said, {"role": "assistant", "content": "reply 0"}, {"role": "user", "content": "u"}]
    rendered = [*chat(system, task)[:-1], 77, *reply[1:], 3, *chat(text(9))]  # re-tokenised
    recorder.call(rendered, [*text(5), EOS], first, messages=again)
    # The next turn sends the reply it got back edited: rewritten, not re-rendered.
    edited = [*again, {"role": "assistant", "content": "edited"}, {"role": "user", "content": "v"}]
    recorder.call([*rendered[:-3], 88, *chat(text(4))], [*text(5), EOS], messages=edited)
    samples = build_samples(recorder.session)
    assert [(s.lineage, s.branch) for s in samples] == [(0, 0), (0, 1), (0, 2)]
    reasons = [s.divergence.reason for s in samples if s.divergence is not None]
    assert reasons == ["template_not_append_only", "history_rewritten"]


def test_a_summary_asked_in_a_call_of_its_own_then_used_is_compaction(recorder: Recorder) -> None:
    """The summary comes from a call with a summariser's system prompt over the history; the
    loop then starts over from it under its own system prompt: compacted, in the loop."""
    system = text(150)
    prompt, reply = chat(system, text(40)), [*text(40), EOS]
    last = recorder.call(prompt, reply)
    prompt, reply = [*prompt, *reply, 3, *chat(text(300))], [*text(40), EOS]
    last = recorder.call(prompt, reply, last)
    summary = [*text(60), EOS]
    recorder.call(chat(text(30), [*text(5), *reply[:-1], *text(300)]), summary)  # the summariser
    recorder.call(chat(system, [*text(5), *summary[:-1]]), [*text(10), EOS])
    samples = build_samples(recorder.session)
    assert [(s.lineage, s.branch, s.role) for s in samples] == [
        (0, 0, "main"), (0, 1, "main"), (1, 0, "side"),
    ]  # fmt: skip
    assert samples[1].divergence is not None and samples[1].divergence.reason == "compacted"
    assert samples[1].is_final


def test_a_call_over_a_conversations_history_under_its_own_prompt_is_a_side_call(
    recorder: Recorder,
) -> None:
    """Qwen Code's memory extraction: another system prompt, the history as text, a question."""
    system = text(200)
    prompt, reply = chat(system, text(40)), [*text(30), EOS]
    recorder.call(prompt, reply)
    recorder.call(chat(text(50), [*text(40), *reply[:-1]], text(10)), [*text(8), EOS])
    forest = assign(recorder.session)
    assert [(lin.turns, lin.role, lin.parent, lin.fork_at) for lin in forest.lineages] == [
        ([0], "main", None, None), ([1], "side", 0, 0),
    ]  # fmt: skip
