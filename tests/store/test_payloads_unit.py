"""The event contract: every shape the log has held reads as today's model; what writers store is
what they stored before the contract was code; the documented catalogue is the code's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trajstore.store import BadEvent, EventType, NewEvent, catalogue
from trajstore.store.payloads import PAYLOADS, VERSION_KEY, dump, load, stored
from trajstore.store.payloads_request import (
    CompletionChunk,
    Continuation,
    PromptTokens,
    RequestReceived,
)
from trajstore.store.payloads_session import RewardAssigned, SessionFinished

ARCHITECTURE = Path(__file__).parents[2] / "docs" / "architecture.md"

#: The event types recorded before the contract was code: each must have its payload class.
RECORDED = (
    "session_created", "request_received", "prompt_tokens", "completion_chunk",
    "completion_finished", "request_failed", "reward_assigned", "session_finished",
    "session_discarded", "training_step", "image_recorded",
)  # fmt: skip


def test_every_recorded_event_type_has_one_payload_class() -> None:
    assert set(RECORDED) <= set(PAYLOADS)
    assert all(PAYLOADS[t].event_type == t for t in PAYLOADS)
    assert set(PAYLOADS) <= {t.value for t in EventType}


#: prompt_tokens as releases wrote it: (stored, the continuation today's model reads).
PROMPTS = [
    # Before token-in continuation (release of migration 0008): no source at all.
    ({"choice": None}, None),
    # Before per-lineage continuation: every continued turn audited, drift_at always written.
    (
        {"choice": None, "prefix": {"request_id": "r1", "n_tokens": 29}, "n_tokens": 41,
         "continuation": {"choice": 0, "drift_at": None}, "prompt_source": "continued"},
        Continuation(request_id="r1", choice=0, drift_at=None, audit=True),
    ),
    # After it, up to this contract: drift_at only on audited turns.
    (
        {"choice": None, "prefix": {"request_id": "r2", "n_tokens": 50}, "n_tokens": 60,
         "continuation": {"choice": 1}, "prompt_source": "continued"},
        Continuation(request_id="r2", choice=1, audit=False),
    ),
    (
        {"choice": None, "prefix": {"request_id": "r3", "n_tokens": 8}, "n_tokens": 20,
         "continuation": {"choice": 0, "drift_at": 15}, "prompt_source": "continued"},
        Continuation(request_id="r3", choice=0, drift_at=15, audit=True),
    ),
    # Rendered after looking like a continuation: why.
    (
        {"choice": None, "continuation": {"fallback": "history_changed"},
         "prompt_source": "rendered"},
        Continuation(fallback="history_changed"),
    ),
]  # fmt: skip


@pytest.mark.parametrize(("stored", "continuation"), PROMPTS)
def test_every_prompt_shape_the_log_held_reads_as_version_2(
    stored: dict[str, Any], continuation: Continuation | None
) -> None:
    prompt = PromptTokens.read(stored)
    assert prompt.continuation == continuation
    # and once read, it is stored as version 2, which reads back the same
    again = dump(prompt)
    assert again[VERSION_KEY] == 2
    assert PromptTokens.read(again) == prompt


def test_what_the_recorder_stores_today_reads_back_as_written() -> None:
    continued = PromptTokens(
        choice=None,
        prompt_source="continued",
        continuation=Continuation(request_id="r1", choice=0, audit=False),
    )
    stored = NewEvent(EventType.PROMPT_TOKENS, payload=continued).payload
    assert stored == {
        "choice": None,
        "prompt_source": "continued",
        "continuation": {"request_id": "r1", "choice": 0, "audit": False},
        "v": 2,
    }
    assert PromptTokens.read(stored) == continued


@pytest.mark.parametrize(
    "stored", [{"choice": 1, "text": "t5 "}, {"choice": None, "text": None}, {}, {"text": "x"}]
)
def test_the_projectors_chunk_reading_is_the_contracts(stored: dict[str, Any]) -> None:
    chunk = CompletionChunk.read(stored)
    assert CompletionChunk.fields(stored) == (chunk.choice, chunk.text)


def test_what_the_recorder_builds_without_models_is_what_the_models_store() -> None:
    chunk = CompletionChunk(choice=2, text="t7 ")
    assert CompletionChunk.stored(2, "t7 ") == dump(chunk)
    continued = {"request_id": "r1", "choice": 0, "audit": True, "drift_at": None}
    fields = {"choice": None, "prompt_source": "continued", "continuation": continued}
    assert stored(PromptTokens, **fields) == dump(PromptTokens(**fields))
    with pytest.raises(TypeError, match="declares no"):
        stored(PromptTokens, choise=None)


def test_a_policy_version_sent_as_a_number_reads_as_text() -> None:
    received = RequestReceived.read({"request_id": "r", "policy_version": 3})
    assert received.policy_version == "3"
    assert RequestReceived.read({"request_id": "r"}).api == "chat"


def test_writers_store_the_fields_they_set_none_included() -> None:
    # What proxy.sessions stored before the contract: the API model's whole dump.
    reward = RewardAssigned(value=1.0, components=None, source=None)
    assert dump(reward) == {"value": 1.0, "components": None, "source": None}
    assert dump(SessionFinished(status="timeout")) == {"status": "timeout"}
    assert SessionFinished.read({}).status == "completed"


def test_unknown_fields_are_kept_and_newer_versions_refused() -> None:
    newer = {"value": 1.0, "given_by": "a judge"}
    assert dump(RewardAssigned.read(newer)) == newer
    with pytest.raises(BadEvent, match="newer than this release"):
        load("prompt_tokens", {"choice": None, VERSION_KEY: 3})
    with pytest.raises(BadEvent, match="does not match its schema"):
        load("reward_assigned", {"source": "no value"})
    with pytest.raises(BadEvent, match="cannot go in"):
        NewEvent(EventType.SESSION_FINISHED, payload=RewardAssigned(value=1.0))


def test_the_documented_catalogue_is_the_codes() -> None:
    text = ARCHITECTURE.read_text()
    start = text.index(catalogue.BEGIN) + len(catalogue.BEGIN) + 1
    documented = text[start : text.index(catalogue.END)]
    assert documented == catalogue.catalogue(), (
        "docs/architecture.md's event catalogue is stale: paste the output of "
        "`python -m trajstore.store.catalogue` between its markers"
    )
