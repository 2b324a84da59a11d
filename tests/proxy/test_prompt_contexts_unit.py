"""The proxy's memory of each session's last turn, which later turns reference (no I/O)."""

from __future__ import annotations

import orjson

from trajstore.proxy.continuation import Turn
from trajstore.proxy.recorder import PromptContexts, RequestRecorder
from trajstore.proxy.wire import Asked

BODY = {"model": "m", "max_tokens": 8, "temperature": 0.5}
ASKED = Asked(token_ids=False, logprobs=False, usage=False)


def Context(  # noqa: N802  (reads like the record it builds)
    request_id: str, prompt: bytes, n_messages: int = 0, messages: bytes = b""
) -> Turn:
    """A remembered turn holding `prompt` and `messages` (the bytes the bound counts)."""
    return Turn(request_id, prompt, n_messages, messages, b"", ())


def test_sessions_whose_last_turn_is_oldest_are_forgotten_past_the_bound() -> None:
    contexts = PromptContexts(max_bytes=100)
    contexts.remember("a", Context("r1", b"x" * 40))
    contexts.remember("b", Context("r2", b"x" * 20, 1, b"y" * 20))  # messages count too
    contexts.remember("a", Context("r3", b"x" * 40))  # a's newer turn replaces its older one
    assert contexts.get("a") == Context("r3", b"x" * 40)
    assert contexts.get("b") == Context("r2", b"x" * 20, 1, b"y" * 20)
    contexts.remember(
        "c", Context("r4", b"x" * 40)
    )  # 120 bytes: b, whose last turn is oldest, goes
    assert contexts.get("b") is None
    assert contexts.get("a") is not None and contexts.get("c") is not None
    contexts.remember("d", Context("r5", b"x" * 200))  # larger than the bound by itself: none kept
    assert [contexts.get(s) for s in "acd"] == [None, None, None]


def received(messages: list[dict[str, str]], previous: Turn | None) -> dict[str, object]:
    """The request_received payload the recorder makes for a chat request with `messages`."""
    recorder = RequestRecorder(
        writer=None,  # type: ignore[arg-type]  # building an event writes nothing
        session_id="s1",
        run_id="run",
        request_id="q2",
        previous=previous,
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


def earlier(messages: list[dict[str, str]]) -> Turn:
    return Context("q1", b"", len(messages), orjson.dumps(messages))


def test_messages_that_repeat_the_last_turns_are_stored_as_a_reference_and_the_new_ones() -> None:
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}]
    then = [*first, {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4?"}]
    payload = received(then, earlier(first))
    assert payload["messages_prefix"] == {"request_id": "q1", "n_messages": 2}
    assert payload["body"] == {**BODY, "messages": then[2:]}  # the rest of the body is kept
    # The same messages again: a reference and nothing new.
    assert received(first, earlier(first))["body"] == {**BODY, "messages": []}


def test_messages_that_do_not_repeat_the_last_turns_exactly_are_stored_whole() -> None:
    first = [{"role": "user", "content": "2+3?"}]
    cases = [
        [{"role": "user", "content": "2+3?!"}],  # the text changed
        [{"content": "2+3?", "role": "user"}],  # the same, as another serialisation
        [{"role": "system", "content": "new"}, *first],  # something inserted before
        [],  # fewer messages
    ]
    for messages in cases:
        payload = received(messages, earlier(first))
        assert "messages_prefix" not in payload and payload["body"] == {
            **BODY,
            "messages": messages,
        }
    assert "messages_prefix" not in received(first, None)  # nothing remembered
