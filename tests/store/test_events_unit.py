"""Events and token arrays, checked without a database: what is refused, what is kept exactly."""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest

from trajstore.store import BadEvent, EventType, NewEvent, PayloadTooLarge
from trajstore.store.events import MAX_PAYLOAD_BYTES
from trajstore.store.tokens import (
    decode_logprobs,
    decode_token_ids,
    encode_logprobs,
    encode_token_ids,
)


def test_token_ids_round_trip_bit_exact_up_to_int32_max() -> None:
    ids = np.array([0, 1, 151_643, 2**31 - 1], dtype=np.int64)
    decoded = decode_token_ids(encode_token_ids(ids))
    assert decoded is not None
    assert decoded.dtype == np.int32
    assert decoded.tolist() == ids.tolist()


def test_python_lists_are_accepted_too() -> None:
    assert encode_token_ids([1, 2, 3]) == np.array([1, 2, 3], "<i4").tobytes()
    assert encode_logprobs([-0.5, -1.0]) == np.array([-0.5, -1.0], "<f4").tobytes()


def test_logprobs_keep_negative_infinity_and_float32_bits() -> None:
    values = np.array([-np.inf, -0.0, -1e-38, -12.345678], dtype=np.float32)
    decoded = decode_logprobs(encode_logprobs(values))
    assert decoded is not None
    assert decoded.tobytes() == values.tobytes()
    assert math.isinf(decoded[0])


def test_encoding_is_little_endian_whatever_the_input_order() -> None:
    big_endian = np.array([1, 256], dtype=">i4")
    assert encode_token_ids(big_endian) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([2**31], "must lie in"),
        ([-1], "must lie in"),
        ([1.0, 2.0], "must be integers"),
        (["1"], "must be integers"),
        ([[1, 2]], "must be integers"),
        (np.array([[1, 2]]), "one-dimensional"),
    ],
)
def test_bad_token_ids_are_refused_with_a_reason(ids: list[object], message: str) -> None:
    with pytest.raises(BadEvent, match=message):
        NewEvent(EventType.PROMPT_TOKENS, session_id="s", token_ids=ids)  # type: ignore[arg-type]


def test_logprobs_must_be_numbers() -> None:
    with pytest.raises(BadEvent, match="must be floats"):
        NewEvent(EventType.COMPLETION_CHUNK, token_ids=[1], logprobs=["a"])  # type: ignore[list-item]


def test_one_logprob_per_token() -> None:
    with pytest.raises(BadEvent, match="2 token ids but 1 logprobs"):
        NewEvent(EventType.COMPLETION_CHUNK, token_ids=[1, 2], logprobs=[-0.1])


def test_unknown_event_type_names_the_known_ones() -> None:
    with pytest.raises(BadEvent, match=r"unknown event type 'compleshun'.*completion_chunk"):
        NewEvent("compleshun")  # type: ignore[arg-type]


def test_event_type_given_as_text_becomes_the_enum() -> None:
    assert NewEvent("reward_assigned").type is EventType.REWARD_ASSIGNED  # type: ignore[arg-type]


def test_oversized_payload_is_refused() -> None:
    with pytest.raises(PayloadTooLarge, match=f"limit is {MAX_PAYLOAD_BYTES}"):
        NewEvent(EventType.REQUEST_RECEIVED, payload={"text": "x" * MAX_PAYLOAD_BYTES})


def test_payload_must_be_json() -> None:
    with pytest.raises(BadEvent, match="not JSON-serialisable"):
        NewEvent(EventType.REQUEST_RECEIVED, payload={"when": object()})


def test_nul_in_payload_is_refused_but_an_escaped_backslash_is_not() -> None:
    with pytest.raises(BadEvent, match="NUL"):
        NewEvent(EventType.REQUEST_RECEIVED, payload={"messages": [{"content": "a\x00b"}]})
    kept = NewEvent(EventType.REQUEST_RECEIVED, payload={"content": "C:\\u0000"})
    assert b"u0000" in kept.payload_json


def test_lone_surrogates_are_refused() -> None:
    with pytest.raises(BadEvent, match="not JSON-serialisable"):
        NewEvent(EventType.REQUEST_RECEIVED, payload={"content": "\ud800"})


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\x00b", 7])
def test_bad_ids_are_refused(bad: object) -> None:
    with pytest.raises(BadEvent, match="session_id"):
        NewEvent(EventType.SESSION_CREATED, session_id=bad)  # type: ignore[arg-type]


def test_event_id_must_be_a_uuid() -> None:
    with pytest.raises(BadEvent, match="event_id"):
        NewEvent(EventType.SESSION_CREATED, event_id="not-a-uuid")  # type: ignore[arg-type]
    assert isinstance(NewEvent(EventType.SESSION_CREATED).event_id, uuid.UUID)
