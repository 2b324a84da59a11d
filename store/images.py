"""Images in a session's messages: how the log refers to them, and where their placeholder ids
sit in a sample's tokens.

An OpenAI chat message may carry images as content parts
(`{"type": "image_url", "image_url": {"url": ...}}`, the URL a data URL or one the engine
fetches). The agent re-sends its whole conversation every turn, so the proxy records each image
once per session, in an `image_recorded` event keyed by the SHA-256 of its bytes (a data URL's
decoded bytes; an http URL's text, which the proxy never fetches), and the request body it
records carries a reference in the image's place: `trajstore-image:sha256:<hex>`. The contract
is in `store.sessions`.

A vision-language engine expands each image into a run of placeholder ids in the prompt it
reports (vLLM: the model's image token repeated once per image feature, e.g. Qwen2-VL's
`<|image_pad|>` grid_t * grid_h * grid_w / merge_size**2 times, LLaVA-1.5's `<image>` 576 times).
`image_spans` finds those runs in a sample, so a trainer can put the image's features there;
`sample_images` lists a sample's images with their spans, or why one has none.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from trajstore.store.payloads_request import ImageRecorded

#: What a recorded body has in an image's URL in place of the image itself.
REFERENCE_PREFIX = "trajstore-image:sha256:"


def reference(sha256: str) -> str:
    """The URL a recorded body carries in place of the image with this hash."""
    return REFERENCE_PREFIX + sha256


def referenced_hash(url: Any) -> str | None:
    """The hash a reference URL names, or None when `url` is not a reference."""
    if isinstance(url, str) and url.startswith(REFERENCE_PREFIX):
        return url[len(REFERENCE_PREFIX) :]
    return None


def image_parts(messages: Any) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(message index, part index, part) of every `image_url` content part, in order."""
    if not isinstance(messages, list):
        return
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                yield i, j, part


def part_url(part: dict[str, Any]) -> Any:
    """An `image_url` part's URL: OpenAI's `{"url": ...}` object, or vLLM's bare string."""
    value = part.get("image_url")
    return value.get("url") if isinstance(value, dict) else value


def image_hashes(messages: Any) -> list[str | None]:
    """The images of recorded messages, in order: each one's hash (None for an image that was
    recorded inline, which a log written before images were recorded by reference has)."""
    return [referenced_hash(part_url(part)) for _, _, part in image_parts(messages)]


def image_spans(
    tokens: np.ndarray[Any, np.dtype[np.int32]],
    generated: np.ndarray[Any, np.dtype[np.bool_]] | None,
    placeholder: int | None,
    n_images: int,
) -> list[tuple[int, int]] | None:
    """The [start, end) of each image's placeholder ids in `tokens`, in order; None when they
    cannot be told apart with certainty.

    An image is one maximal run of `placeholder` outside the generated tokens (`generated`: True
    where the model sampled the token). That holds for the engines' placeholders of Qwen2-VL,
    Qwen2.5-VL, LLaVA and LLaVA-NeXT; a model whose image is several runs (Pixtral's row breaks,
    Gemma 3's pan-and-scan crops) gives more runs than images, and then None rather than a guess.
    """
    if placeholder is None or n_images == 0:
        return None if n_images else []
    hits = tokens == placeholder
    if generated is not None:
        hits &= ~generated
    edges = np.flatnonzero(np.diff(np.concatenate(([False], hits, [False])).astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    if len(starts) != n_images:
        return None
    return [(int(s), int(e)) for s, e in zip(starts, ends, strict=True)]


def sample_images(
    tokens: np.ndarray,
    generated: np.ndarray,
    image_token_id: int | None,
    hashes: Sequence[str | None],
    recorded: Mapping[str, ImageRecorded],
) -> list[dict[str, Any]]:
    """A sample's images (its last turn's `hashes`, in prompt order) located in its `tokens`,
    with what `recorded` says of each; where one is not located (null `start` and `end`),
    `reason` says why."""
    spans = image_spans(tokens, generated, image_token_id, len(hashes))
    reason = None
    if spans is None:
        reason = _unlocated(tokens, image_token_id, len(hashes))
    else:
        # One image is one processor output: the same bytes twice with runs of different
        # lengths means the runs are not the images' (a guess would put features on text).
        lengths: dict[str | None, set[int]] = {}
        for sha256, span in zip(hashes, spans, strict=True):
            lengths.setdefault(sha256, set()).add(span[1] - span[0])
        if any(len(seen) > 1 for sha256, seen in lengths.items() if sha256 is not None):
            reason = "the same image has placeholder runs of different lengths"
            spans = None
    images = []
    for n, sha256 in enumerate(hashes):
        image = recorded.get(sha256 or "")
        start, end = (None, None) if spans is None else spans[n]
        images.append(
            {
                "sha256": sha256,
                "source": image.source if image else None,
                "url": image.url if image else None,
                "media_type": image.media_type if image else None,
                "start": start,
                "end": end,
                "reason": reason,
            }
        )
    return images


def _unlocated(tokens: np.ndarray, image_token_id: int | None, n_images: int) -> str:
    """Why a sample's images have no spans."""
    if image_token_id is None:
        return "the engine's image placeholder id was not recorded (TRAJSTORE_IMAGE_TOKEN_ID)"
    hits = tokens == image_token_id
    runs = int(np.count_nonzero(np.diff(np.concatenate(([0], hits.astype(np.int8)))) == 1))
    return f"{runs} placeholder runs for {n_images} images"
