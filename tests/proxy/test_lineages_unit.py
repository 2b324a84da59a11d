"""The proxy's memory of each session's turns by lineage: which earlier turn a request
continues, what a chain of turns holds, and the byte budget (no I/O)."""

from __future__ import annotations

from typing import Any

import orjson

from trajstore.proxy.lineages import Ending, PromptContexts, SessionTurns, Turn, messages_key
from trajstore.proxy.recorder import RequestRecorder
from trajstore.proxy.wire import Asked

BODY = {"model": "m", "max_tokens": 8, "temperature": 0.5}
ASKED = Asked(token_ids=False, logprobs=False, usage=False)
Messages = list[dict[str, Any]]


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def said(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def turn(request_id: str, messages: Messages, prompt: bytes = b"", reply: str = "ok") -> Turn:
    """A completed turn that was sent `messages` and answered `reply`."""
    serialised = orjson.dumps(messages)
    ending = Ending(b"\x05\x00\x00\x00", "stop", None, said(reply))
    return Turn(
        request_id, len(prompt) // 4, len(messages), len(serialised), messages_key(serialised),
        b"", (ending,), held_prompt=prompt,
    )  # fmt: skip


def found(turns: SessionTurns, messages: Messages) -> list[str]:
    return [t.request_id for t in turns.continued_by(orjson.dumps(messages))]


def test_each_conversation_finds_its_own_turn_however_they_interleave() -> None:
    main, sub = [user("fix the bug")], [{"role": "system", "content": "you search"}, user("find")]
    turns = SessionTurns()
    turns.add(turn("m1", main), None)
    turns.add(turn("s1", sub), None)
    main2 = [*main, said("ok"), user("tool output")]
    turns.add(turn("m2", main2), turns.chains[0].head)
    assert found(turns, [*main2, said("ok"), user("more")]) == ["m2"]  # the deepest, not m1
    assert found(turns, [*sub, said("ok"), user("found it")]) == ["s1"]
    assert found(turns, [user("a title for: fix the bug")]) == []  # a new conversation
    assert found(turns, main) == []  # the same messages again: nothing new after them


def test_a_request_that_goes_back_to_an_earlier_turn_finds_it() -> None:
    """A rewind: the request continues m1 although m2 came after it in the same lineage."""
    turns = SessionTurns()
    turns.add(m1 := turn("m1", [user("a")], b"\x01\x00\x00\x00" * 10), None)
    turns.add(turn("m2", [user("a"), said("ok"), user("b")], b"\x01\x00\x00\x00" * 20), m1)
    assert found(turns, [user("a"), said("ok"), user("c")]) == ["m1"]


def test_a_chain_holds_only_its_last_prompt() -> None:
    turns = SessionTurns()
    first = turn("t1", [user("a")], bytes(range(8)))
    turns.add(first, None)
    second = turn("t2", [user("a"), said("ok"), user("b")], bytes(range(8)) + bytes(range(8)))
    turns.add(second, first)
    assert first.held_prompt is None and first.prompt == bytes(range(8))  # read from t2's
    assert len(turns.chains) == 1 and turns.chains[0].head is second
    # A turn that extends an earlier turn, not the last: a chain of its own.
    third = turn("t3", [user("a"), said("ok"), user("c")], bytes(range(8)) + bytes(8))
    turns.add(third, first)
    assert len(turns.chains) == 2 and third.held_prompt is not None


def test_sessions_least_recently_used_are_forgotten_past_the_bound_and_finished_ones_at_once() -> (
    None
):
    contexts = PromptContexts(max_bytes=1000)
    contexts.remember("a", turn("r1", [user("a")], b"x" * 400), None)
    contexts.remember("b", turn("r2", [user("b")], b"x" * 300), None)
    contexts.remember("a", turn("r3", [user("c")], b"x" * 100), None)  # a is used again
    contexts.remember("c", turn("r4", [user("d")], b"x" * 300), None)  # over: b goes
    assert contexts.get("b").latest is None
    assert contexts.get("a").latest is not None and contexts.get("c").latest is not None
    contexts.forget("a")
    assert contexts.get("a").latest is None and contexts.held < 1000


def test_a_session_past_half_the_budget_forgets_its_oldest_turns_and_keeps_continuing() -> None:
    contexts = PromptContexts(max_bytes=4000)
    conversation = [user("go")]
    previous = None
    for n in range(40):  # one lineage of 40 turns, each holding about 300 bytes
        conversation = [*conversation, said("ok"), user(f"output {n}")]
        latest = turn(f"r{n}", conversation, b"x" * 4 * (n + 1))
        contexts.remember("a", latest, previous)
        previous = latest
    turns = contexts.get("a")
    assert contexts.held == turns.size <= 2000  # half the budget
    assert len(turns.chains) == 1 and turns.chains[0].head is latest
    # The lineage's last turn is still found; the forgotten ones are the log's to answer.
    assert found(turns, [*conversation, said("ok"), user("more")]) == ["r39"]
    assert found(turns, [user("go"), said("ok"), user("output 0"), said("ok"), user("x")]) == []
    # Thousands of one-call lineages (a session used as a plain endpoint): bounded the same way.
    for n in range(2000):
        contexts.remember("b", turn(f"b{n}", [user(f"question {n}")], b"y" * 40), None)
    assert contexts.get("b").size <= 2000 and len(contexts.get("b").chains) < 2000
    assert found(contexts.get("b"), [user("question 1999"), said("ok"), user("and?")]) == ["b1999"]


def received(messages: Messages, turns: SessionTurns) -> dict[str, object]:
    """The request_received payload the recorder makes for a chat request with `messages`."""
    recorder = RequestRecorder(
        writer=None,  # type: ignore[arg-type]  # building an event writes nothing
        session_id="s1",
        run_id="run",
        request_id="q2",
        turns=turns,
    )
    event = recorder.received_event(
        api="chat",
        body={**BODY, "messages": messages},
        engine="http://engine",
        policy_version="0",
        logprobs_mode="raw_logprobs",
        asked=ASKED,
    )
    payload: dict[str, object] = orjson.loads(event.payload_json)
    return payload


def remembering(*conversations: Messages) -> SessionTurns:
    turns = SessionTurns()
    for n, messages in enumerate(conversations):
        turns.add(turn(f"q{n}", messages), None)
    return turns


def test_messages_that_repeat_a_turns_are_stored_as_a_reference_and_the_new_ones() -> None:
    first = [{"role": "system", "content": "be brief"}, user("2+3?")]
    other = [{"role": "system", "content": "titles"}, user("name it")]
    then = [*first, said("ok"), user("and 4?")]
    payload = received(then, remembering(first, other))  # another conversation came after
    assert payload["messages_prefix"] == {"request_id": "q0", "n_messages": 2}
    assert payload["body"] == {**BODY, "messages": then[2:]}  # the rest of the body is kept


def test_messages_that_do_not_repeat_a_turns_exactly_are_stored_whole() -> None:
    first = [user("2+3?")]
    cases = [
        [user("2+3?!"), said("ok"), user("x")],  # the text changed
        [{"content": "2+3?", "role": "user"}, said("ok"), user("x")],  # another serialisation
        [{"role": "system", "content": "new"}, *first, said("ok"), user("x")],  # inserted before
        [],  # fewer messages
    ]
    for messages in cases:
        payload = received(messages, remembering(first))
        assert "messages_prefix" not in payload
        assert payload["body"] == {**BODY, "messages": messages}
    assert "messages_prefix" not in received(first, SessionTurns())  # nothing remembered
