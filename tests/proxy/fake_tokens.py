"""The fake engine's tokeniser (`fake_engine.FakeEngine`): fake, but with the property the
recorder relies on.

- ``word_id(w)``: a word ``t<N>`` with 5 <= N < 500 is id N (the inverse of the detokeniser,
  which renders id N as ``"t<N> "``); any other word is ``5 + crc32(w) % 495``.
- a chat message is ``[1 <|im_start|>, word_id(role), 203 "\\n", *word_ids(content),
  2 <|im_end|>, 203]``; the prompt is the messages followed by ``[1, word_id("assistant"), 203]``.
- a completions prompt that is a list of ints is used as-is; a string is ``word_ids(prompt)``.
- generated ids lie in [5, 500); eos is id 2 with text ``<|im_end|>`` and no content; a token's
  logprob is a function of the token and its position (``version_logprob`` on a versioned
  engine).
- with vision, each ``image_url`` part becomes ``<|vision_start|>``, ``<|image_pad|>`` repeated
  ``image_token_count(url)`` times and ``<|vision_end|>``, with Qwen2-VL's ids.
- ``expert_ids``: the fake's routing of each position, for ``routed_experts``.

So, as with vLLM, when the assistant reply is replayed unchanged turn k+1's prompt starts with
turn k's prompt + completion ids: a reply cut by ``length`` is followed by the template's
``[2, 203]``, a reply ending with eos 2 by ``203``.
"""

from __future__ import annotations

import random
import re
import zlib
from typing import Any

import numpy as np
import orjson

IM_START, EOS, NEWLINE = 1, 2, 203
#: Qwen2-VL's <|vision_start|>, <|vision_end|> and <|image_pad|> (its config's image_token_id).
VISION_START, VISION_END, IMAGE_PAD = 151652, 151653, 151655
_WORD_ID = re.compile(r"t(\d+)")

JSON = dict[str, Any]


def word_id(word: str) -> int:
    """The fake token id of one whitespace-separated word (see the module docstring)."""
    m = _WORD_ID.fullmatch(word)
    if m and 5 <= int(m[1]) < 500:
        return int(m[1])
    return 5 + zlib.crc32(word.encode()) % 495


def token_text(tid: int) -> str:
    """The text of a generated token, as it appears in logprobs."""
    return "<|im_end|>" if tid == EOS else f"t{tid} "


def content_text(tid: int) -> str:
    """A generated token's text in the content: vLLM skips special tokens, so eos adds none."""
    return "" if tid == EOS else token_text(tid)


def image_token_count(url: str) -> int:
    """How many placeholder ids the fake VLM gives the image at `url`: 4 to 8, by its text."""
    return 4 + zlib.crc32(url.encode()) % 5


def _image_ids(part: JSON) -> list[int]:
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    return [VISION_START, *[IMAGE_PAD] * image_token_count(str(url)), VISION_END]


def chat_prompt_ids(
    messages: list[JSON],
    generation: bool = True,
    *,
    rewrite_replies: bool = False,
    vision: bool = False,
) -> list[int]:
    """The prompt ids of a chat request: ChatML framing around word ids.

    `rewrite_replies`: a template that is not append-only, as thinking models' are: an earlier
    assistant message is rendered with a word the engine never sampled at its start.
    `vision`: image parts become their placeholder ids (the module docstring).
    """
    ids: list[int] = []
    for m in messages:
        content = m.get("content")
        if vision and isinstance(content, list):
            ids += [IM_START, word_id(str(m.get("role", ""))), NEWLINE]
            for p in content:
                if isinstance(p, dict) and p.get("type") == "image_url":
                    ids += _image_ids(p)
                elif isinstance(p, dict):
                    ids += map(word_id, str(p.get("text", "")).split())
            ids += [EOS, NEWLINE]
            continue
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        words = str(content or "").split()
        if m.get("tool_calls"):  # so that tool-call turns tokenise to something distinct
            words += orjson.dumps(m["tool_calls"], option=orjson.OPT_SORT_KEYS).decode().split()
        ids += [IM_START, word_id(str(m.get("role", ""))), NEWLINE]
        if rewrite_replies and m.get("role") == "assistant":
            words.insert(0, "(earlier)")
        ids += [*map(word_id, words), EOS, NEWLINE]
    return [*ids, IM_START, word_id("assistant"), NEWLINE] if generation else ids


def completion_prompt_ids(prompt: Any) -> list[int]:
    """The prompt ids of a completions request: token ids as-is, text by word ids."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list):  # a batch of prompts: the fake answers the first only
        prompt = prompt[0] if prompt else ""
    return [word_id(w) for w in str(prompt).split()]


def expert_ids(
    ids: list[int], start: int, layers: int, top_k: int, n_experts: int
) -> np.ndarray[Any, Any]:
    """The fake's routing of positions start.. of `ids` (all but the last): row p, layer l has
    the top_k consecutive experts from (7 * ids[p] + 3 * l) mod n_experts."""
    rows = np.asarray(ids[start : max(len(ids) - 1, start)], np.int64)
    base = (7 * rows[:, None] + 3 * np.arange(layers)[None, :]) % n_experts
    experts = (base[:, :, None] + np.arange(top_k)[None, None, :]) % n_experts
    return experts.astype(np.uint8 if n_experts <= 256 else np.uint16).reshape(
        len(rows), layers, top_k
    )


def version_logprob(version: str) -> float:
    """The logprob a versioned fake engine gives every token it generates on `version`."""
    return -1.0 - int(version)


def _logprob(tid: int, pos: int) -> float:
    # In [-5, 0), the same for the same token at the same position.
    return -5.0 + 5.0 * random.Random(tid * 7919 + pos).random()


def _top(tid: int, lp: float, k: int) -> list[tuple[str, float]]:
    # The sampled token first, then k-1 distinct, less likely alternatives.
    alts = [(5 + (tid - 5 + 7 * j) % 495, lp - 0.5 * j) for j in range(1, k)]
    return [(token_text(t), v) for t, v in [(tid, lp), *alts][:k]]


def chat_logprobs(ids: list[int], pos: int, k: int) -> JSON:
    """Chat's ``logprobs`` for tokens starting at position ``pos``, top_logprobs=k."""

    def entry(token: str, lp: float) -> JSON:
        return {"token": token, "logprob": lp, "bytes": list(token.encode())}

    content = []
    for j, tid in enumerate(ids):
        lp = _logprob(tid, pos + j)
        top = [entry(s, v) for s, v in _top(tid, lp, k)]
        content.append(entry(token_text(tid), lp) | {"top_logprobs": top})
    return {"content": content}


def completion_logprobs(ids: list[int], pos: int, offset: int, k: int) -> JSON:
    """Completions' ``logprobs``; ``offset`` is the text length before these tokens."""
    lps = [_logprob(tid, pos + j) for j, tid in enumerate(ids)]
    offsets = [offset + sum(len(content_text(t)) for t in ids[:j]) for j in range(len(ids))]
    return {
        "text_offset": offsets,
        "token_logprobs": lps,
        "tokens": [token_text(t) for t in ids],
        "top_logprobs": [dict(_top(t, lp, k)) for t, lp in zip(ids, lps, strict=True)],
    }
