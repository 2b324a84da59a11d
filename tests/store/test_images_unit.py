"""Images in samples: references in recorded messages, and each image's placeholder span in a
sample's tokens (no I/O)."""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.store.test_samples_unit import session, turn
from trajstore.store.images import image_hashes, image_spans, reference, referenced_hash
from trajstore.store.payloads_request import ImageRecorded
from trajstore.store.samples import build_samples

PAD, START, END, EOS = 151655, 151652, 151653, 2


def ids(*values: int) -> np.ndarray[Any, np.dtype[np.int32]]:
    return np.array(values, dtype=np.int32)


def test_each_run_of_the_placeholder_is_one_image_in_order() -> None:
    tokens = ids(1, 10, START, PAD, PAD, PAD, END, 11, START, PAD, PAD, END, 12)
    assert image_spans(tokens, None, PAD, 2) == [(3, 6), (9, 11)]


def test_runs_at_the_edges_of_the_tokens_are_found() -> None:
    assert image_spans(ids(PAD, PAD, 5, PAD), None, PAD, 2) == [(0, 2), (3, 4)]


def test_a_count_that_does_not_match_the_images_gives_no_spans_rather_than_a_guess() -> None:
    tokens = ids(1, PAD, PAD, 5, PAD, PAD, 6)  # two runs: Pixtral-like row breaks of one image
    assert image_spans(tokens, None, PAD, 1) is None
    assert image_spans(tokens, None, PAD, 3) is None


def test_an_unknown_placeholder_locates_nothing() -> None:
    assert image_spans(ids(1, PAD, 2), None, None, 1) is None
    assert image_spans(ids(1, 2), None, None, 0) == []


def test_placeholder_ids_the_model_generated_are_not_images() -> None:
    tokens = ids(1, PAD, PAD, 7, PAD, EOS)
    generated = np.array([0, 0, 0, 1, 1, 1], dtype=bool)
    assert image_spans(tokens, generated, PAD, 1) == [(1, 3)]


def test_references_name_the_hash_and_nothing_else_is_one() -> None:
    sha = "ab" * 32
    assert referenced_hash(reference(sha)) == sha
    assert referenced_hash("https://example.com/cat.png") is None
    assert referenced_hash(None) is None


def test_image_hashes_follow_the_messages_and_their_parts_in_order() -> None:
    messages = [
        {"role": "system", "content": "look"},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "these"},
                {"type": "image_url", "image_url": {"url": reference("a" * 64)}},
                {"type": "image_url", "image_url": reference("b" * 64)},  # vLLM's bare string
            ],
        },
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
    ]
    assert image_hashes(messages) == ["a" * 64, "b" * 64, None]  # the last recorded inline
    assert image_hashes(None) == []


def image_turn(prompt: list[int], completion: list[int], hashes: list[str], index: int) -> Any:
    record = turn(prompt, completion, index=index)
    parts = [{"type": "image_url", "image_url": {"url": reference(h)}} for h in hashes]
    record.body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    record.body["messages"][0]["content"] += parts
    record.n_images, record.image_token_id = len(hashes), PAD
    return record


def test_a_sample_lists_its_last_turns_images_with_their_spans_and_sources() -> None:
    a, u = "a" * 64, "c" * 64
    first = image_turn([1, START, PAD, PAD, END, 10], [20, EOS], [a], 0)
    second_prompt = [1, START, PAD, PAD, END, 10, 20, EOS, 30, START, PAD, PAD, PAD, END]
    second = image_turn(second_prompt, [40, EOS], [a, u], 1)
    recorded = session(first, second)
    recorded.images = {
        a: ImageRecorded(sha256=a, source="data", media_type="image/png", n_bytes=3),
        u: ImageRecorded(sha256=u, source="url", url="https://x/y.png"),
    }
    (sample,) = build_samples(recorded)
    assert sample.images == [
        {"sha256": a, "source": "data", "url": None, "media_type": "image/png",
         "start": 2, "end": 4, "reason": None},
        {"sha256": u, "source": "url", "url": "https://x/y.png", "media_type": None,
         "start": 10, "end": 13, "reason": None},
    ]  # fmt: skip
    assert all(sample.token_ids[i] == PAD for i in range(10, 13))


def test_an_image_whose_event_is_missing_keeps_its_hash_and_span_without_a_source() -> None:
    record = image_turn([1, PAD, 10], [20, EOS], ["d" * 64], 0)
    (sample,) = build_samples(session(record))
    assert sample.images[0]["sha256"] == "d" * 64
    assert (sample.images[0]["source"], sample.images[0]["start"]) == (None, 1)


def test_images_not_located_say_why_rather_than_guess() -> None:
    a, b = "a" * 64, "b" * 64
    # Two images whose runs touch: one run for two images.
    merged = image_turn([1, START, PAD, PAD, PAD, PAD, END], [20, EOS], [a, b], 0)
    (sample,) = build_samples(session(merged))
    assert [(i["start"], i["reason"]) for i in sample.images] == [
        (None, "1 placeholder runs for 2 images")
    ] * 2
    # The same image twice, with runs of different lengths: they are not the image's.
    twice = image_turn([1, START, PAD, PAD, END, 10, START, PAD, END], [20, EOS], [a, a], 0)
    (sample,) = build_samples(session(twice))
    assert {i["reason"] for i in sample.images} == {
        "the same image has placeholder runs of different lengths"
    }
    assert {i["start"] for i in sample.images} == {None}
    # No placeholder id recorded.
    unknown = image_turn([1, PAD, 10], [20, EOS], [a], 0)
    unknown.image_token_id = None
    (sample,) = build_samples(session(unknown))
    assert "TRAJSTORE_IMAGE_TOKEN_ID" in sample.images[0]["reason"]


def test_text_only_samples_have_no_images() -> None:
    (sample,) = build_samples(session(turn([1, 10], [20, EOS])))
    assert sample.images == []
