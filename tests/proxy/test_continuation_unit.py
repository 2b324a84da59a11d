"""Whether the reply an agent sends back is the one it was given, as clients really re-send it
(`proxy.continuation.same_reply`, rule 3), and what a turn records of its prompt (no I/O)."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from trajstore.proxy.continuation import RENDERED, Continuer, Plan, same_reply
from trajstore.proxy.lineages import Chain, Turn

GIVEN: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "refusal": None,
    "reasoning": "the user wants a sum",
    "tool_calls": [
        {
            "id": "call-1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
        }
    ],
}


def call(arguments: str) -> dict[str, Any]:
    return {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": arguments}}


@pytest.mark.parametrize(
    "sent",
    [
        # LangChain and pydantic-ai leave nulls and reasoning out, and may send "" for content.
        {"role": "assistant", "content": "", "tool_calls": [call('{"a": 2, "b": 3}')]},
        # Arguments re-serialised with other spacing and key order.
        {"role": "assistant", "tool_calls": [call('{"b":3,"a":2}')]},
        GIVEN,
    ],
)
def test_a_reply_sent_back_as_clients_reserialise_it_is_the_same(sent: dict[str, Any]) -> None:
    assert same_reply(sent, GIVEN)


@pytest.mark.parametrize(
    "sent",
    [
        {"role": "assistant", "tool_calls": [call('{"a": 2, "b": 4}')]},  # other arguments
        {"role": "assistant", "content": "2+3", "tool_calls": [call('{"a": 2, "b": 3}')]},
        {"role": "assistant", "content": ""},  # the call dropped
        {"role": "user", "content": "", "tool_calls": [call('{"a": 2, "b": 3}')]},
        {**GIVEN, "tool_calls": [{**GIVEN["tool_calls"][0], "id": "call-9"}]},
    ],
)
def test_an_edited_reply_is_not_the_same(sent: dict[str, Any]) -> None:
    assert not same_reply(sent, GIVEN)


def test_text_parts_and_plain_text_are_the_same_reply() -> None:
    given = {"role": "assistant", "content": "five", "tool_calls": None}
    sent = {
        "role": "assistant",
        "content": [{"type": "text", "text": "fi"}, {"type": "text", "text": "ve"}],
    }
    assert same_reply(sent, given)
    assert not same_reply({"role": "assistant", "content": "five."}, given)


def test_what_a_turn_records_of_how_its_prompt_was_sent() -> None:
    assert RENDERED.as_json() == {"prompt_source": "rendered"}
    assert RENDERED._replace(fallback="reply_changed").as_json() == {
        "prompt_source": "rendered",
        "continuation": {"fallback": "reply_changed"},
    }
    continued = Turn("r1", 3, 1, 10, b"", b"", ())
    assert Plan("continued", drift_at=12, choice=1, turn=continued, audit=True).as_json() == {
        "prompt_source": "continued",
        "continuation": {"choice": 1, "drift_at": 12},
    }
    # The drift is measured on audited turns only.
    assert Plan("continued", choice=0, turn=continued).as_json() == {
        "prompt_source": "continued",
        "continuation": {"choice": 0},
    }


def test_audits_come_at_geometric_lengths_once_enough_turns_were_continued() -> None:
    continuer = Continuer(audit_every=4, audit_growth=0.5)
    turn = Turn("r1", 1000, 1, 10, b"", b"", ())
    turn.chain = Chain(turn, deque([turn]))
    assert continuer._audit_due(turn)  # the lineage's first continued turn
    turn.chain.audited_at, turn.chain.since_audit = 1000, 3
    assert not continuer._audit_due(turn)  # four turns, but the conversation has not grown
    turn.prompt_len = 1500
    assert continuer._audit_due(turn)
    turn.chain.since_audit = 1
    assert not continuer._audit_due(turn)  # grown, but too few turns since
    assert not Continuer(audit_every=0)._audit_due(turn)  # never
