"""Each lineage's last completion, to be found again inside a later prompt (`store.lineages`).

A prompt that holds a conversation's latest reply carried that conversation on: an edit or a
compaction kept the reply (or the summary a call over the history produced). Finding it is a
search for the reply's *interior* (its first and last ids left out: re-rendered inside other text
they may merge with it; at least `MIN_CONTAINED` ids) at a token boundary. A prompt is checked
against one lineage with a byte search, or against all of them through a 64-bit rolling key of
every run of `MIN_CONTAINED` ids (numpy), looked up among the keys of the completions held
(`_Keys`: a sorted array plus recent additions), each hit then checked exactly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trajstore.store.tokens import TOKEN_DTYPE

#: Ids of a completion's interior that must reappear for a prompt to count as keeping it.
MIN_CONTAINED = 8
_ID = TOKEN_DTYPE.itemsize


class LastCompletions:
    """The interior of each owner's (lineage's) last completion; the keys that find them in any
    prompt are computed only when such a search comes (most sessions never need one)."""

    def __init__(self) -> None:
        self._held: dict[int, bytes] = {}  # owner -> interior
        self._keyed: dict[int, int] = {}  # owner -> the key of its interior's start
        self._owners: dict[int, list[int]] = {}  # key -> owners
        self._keys = _Keys()

    def remember(self, owner: int, completion: bytes, finish_reason: str | None) -> None:
        """`owner`'s last completion is now this one (too short to find again: none)."""
        self.forget(owner)
        ids = completion[:-_ID] if finish_reason == "stop" else completion
        interior = ids[_ID:-_ID]
        if len(interior) >= MIN_CONTAINED * _ID:
            self._held[owner] = interior

    def forget(self, owner: int) -> None:
        self._held.pop(owner, None)
        key = self._keyed.pop(owner, None)
        if key is not None:
            self._owners[key].remove(owner)

    def move(self, owner: int, to: int) -> None:
        """`owner`'s last completion is `to`'s now (a turn that left one lineage for another)."""
        interior = self._held.get(owner)
        self.forget(owner)
        if interior is not None:
            self._held[to] = interior

    def contains(self, prompt: bytes, owner: int, after: int = 0) -> bool:
        """Whether `prompt` holds `owner`'s last completion past token `after`."""
        interior = self._held.get(owner)
        return interior is not None and find(prompt, interior, after)

    def containing(self, prompt: bytes) -> list[int]:
        """Every owner whose last completion `prompt` holds."""
        if not self._held or len(prompt) < MIN_CONTAINED * _ID:
            return []
        for owner in self._held.keys() - self._keyed.keys():
            key = _key_of(self._held[owner][: MIN_CONTAINED * _ID])
            self._keyed[owner] = key
            self._owners.setdefault(key, []).append(owner)
            self._keys.add(key)
        starts = self._keys.among(_window_keys(prompt))
        return [
            owner
            for key in starts
            for owner in self._owners.get(int(key), ())
            if self.contains(prompt, owner)
        ]


def find(prompt: bytes, ids: bytes, after: int = 0) -> bool:
    """Whether the packed `ids` occur in `prompt` at a token boundary past token `after`."""
    at = prompt.find(ids, after * _ID)
    while at >= 0 and at % _ID:
        at = prompt.find(ids, at + 1)
    return at >= 0


class _Keys:
    """A growing set of 64-bit keys, looked up many at a time: a sorted array merged with what
    was added since whenever that grows past it (amortised: each key is sorted in O(log) times)."""

    def __init__(self) -> None:
        self._sorted: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self._recent: set[int] = set()

    def add(self, key: int) -> None:
        self._recent.add(key)
        held = 0 if self._sorted is None else len(self._sorted)
        if len(self._recent) > max(64, held):
            recent = np.fromiter(self._recent, np.uint64, len(self._recent))
            merged = recent if self._sorted is None else np.concatenate([self._sorted, recent])
            self._sorted, self._recent = np.unique(merged), set()

    def among(self, keys: np.ndarray[Any, np.dtype[np.uint64]]) -> list[int]:
        """Which of `keys` are in the set (each once)."""
        found: set[int] = set()
        if self._sorted is not None:
            at = np.minimum(np.searchsorted(self._sorted, keys), len(self._sorted) - 1)
            found.update(keys[self._sorted[at] == keys].tolist())
        if self._recent:
            found.update(k for k in keys.tolist() if k in self._recent)
        return list(found)


_MASK = (1 << 64) - 1
_BASE = 1_000_003


def _key_of(packed: bytes) -> int:
    """`_window_keys` of exactly MIN_CONTAINED ids, without numpy (one key a completion)."""
    key = 0
    for value in np.frombuffer(packed, TOKEN_DTYPE).tolist():
        key = (key * _BASE + value) & _MASK
    return key


def _window_keys(packed: bytes) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A 64-bit key of every run of MIN_CONTAINED ids (wrapping arithmetic: a hit is checked)."""
    ids = np.frombuffer(packed, TOKEN_DTYPE).astype(np.uint64)
    n = max(len(ids) - MIN_CONTAINED + 1, 0)
    keys = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(MIN_CONTAINED):
            keys = keys * np.uint64(_BASE) + ids[j : j + n]
    return keys
