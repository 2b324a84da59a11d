"""An index of token prefixes: which known sequences a prompt starts with, and which it follows
longest, without comparing it with each one (`store.lineages` keeps one sequence per
conversation of a session).

Every indexed sequence registers a keyed 64-bit digest of its first k x `BLOCK` tokens for each
k (the most recent sequence to register a digest owns it), and its *head*: the digest at the last
boundary before its end, with the exact ids after it (fewer than a block). A prompt is walked
boundary by boundary from the start: where its digest is a head key, the prompt's own next ids
are looked up among that key's tails, one look-up per tail length present (at most a block's
worth), so many sequences that end alike cost no more than one; where its digest is no block
key, no indexed sequence shares more with it and the walk stops. A walk costs the prompt's shared
length in hashing and a few look-ups a block; memory is about one entry a block. The digests are
keyed with a secret of the process, so an agent cannot craft collisions.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

#: Tokens per block.
BLOCK = 64
_ID = 4  # bytes per packed token id
_KEY = os.urandom(16)


def new_hasher() -> Any:
    """A digest of nothing yet."""
    return hashlib.blake2b(digest_size=8, key=_KEY)


def digest(hasher: Any) -> bytes:
    """The digest so far (the hasher goes on)."""
    return bytes(hasher.copy().digest())


def extends(tail: bytes, start: int, sequence: bytes | bytearray, eot: bool) -> int | None:
    """Where a prompt goes on past `sequence` (bytes), when it starts with all of it, or with all
    but its last id when `eot` (a template that does not repeat an end-of-turn token); else
    None. `tail` is the prompt from byte `start` on: the two are known to agree before it."""
    rest = memoryview(sequence)[start:]
    if tail.startswith(rest):
        return len(sequence)
    if eot and len(rest) >= _ID and tail.startswith(rest[:-_ID]):
        return len(sequence) - _ID
    return None


@dataclass
class Digests:
    """How far one sequence is indexed: the digest of its first `hashed` tokens, and of the
    boundary before (a prompt that leaves out its last id still agrees there)."""

    hashed: int = 0
    hasher: Any = field(default_factory=new_hasher, repr=False)
    earlier: tuple[int, Any] | None = field(default=None, repr=False)
    head_key: tuple[int, bytes] | None = None

    def head_boundary(self, n_tokens: int) -> tuple[int, Any]:
        """The last boundary before the end of a sequence of `n_tokens`, and its hasher."""
        if self.hashed < n_tokens or self.earlier is None:
            return self.hashed, self.hasher
        return self.earlier


class PrefixIndex:
    """Block digests of every indexed sequence, and their heads."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, bytes], int] = {}
        #: head key -> the tails after it (<= BLOCK ids, exact) -> (owner, glue offset back)
        self.heads: dict[tuple[int, bytes], dict[bytes, set[tuple[int, int]]]] = {}
        self._tail_lengths: dict[tuple[int, bytes], dict[int, int]] = {}
        self._registered: dict[int, tuple[tuple[int, bytes], list[bytes]]] = {}

    def update(self, owner: int, sequence: bytes | bytearray, digests: Digests, eot: bool) -> None:
        """Index `sequence` (of `owner`): the boundaries it passed since last time, and its head:
        the tail after its last boundary, and, when `eot`, the same without its last id (a
        prompt may leave that out)."""
        n = len(sequence) // _ID
        if digests.hashed == n and digests.earlier is None and n:
            digests.hashed, digests.hasher = 0, new_hasher()  # no boundary before its end held
        if digests.hashed == 0:
            self.blocks[0, digest(digests.hasher)] = owner
        while digests.hashed + BLOCK <= n:
            digests.earlier = (digests.hashed, digests.hasher.copy())
            start = digests.hashed * _ID
            digests.hasher.update(sequence[start : start + BLOCK * _ID])
            digests.hashed += BLOCK
            self.blocks[digests.hashed, digest(digests.hasher)] = owner
        self.unhead(owner)
        at, hasher = digests.head_boundary(n)
        key = (at, digest(hasher))
        tail = bytes(sequence[at * _ID :])
        tails = [tail, tail[:-_ID]] if eot and tail else [tail]
        for back, piece in enumerate(tails):
            self.heads.setdefault(key, {}).setdefault(piece, set()).add((owner, back))
            lengths = self._tail_lengths.setdefault(key, {})
            lengths[len(piece)] = lengths.get(len(piece), 0) + 1
        self._registered[owner] = (key, tails)

    @staticmethod
    def rewind(digests: Digests, tokens: int) -> None:
        """The sequence is about to change from token `tokens` on: forget the digests past it."""
        if digests.hashed <= tokens:
            return
        if digests.earlier is not None and digests.earlier[0] <= tokens:
            (digests.hashed, digests.hasher), digests.earlier = digests.earlier, None
        else:
            digests.hashed, digests.hasher, digests.earlier = 0, new_hasher(), None

    def unhead(self, owner: int) -> None:
        """Take the sequence's head out."""
        registered = self._registered.pop(owner, None)
        if registered is None:
            return
        key, tails = registered
        for back, piece in enumerate(tails):
            self.heads[key][piece].discard((owner, back))
            self._tail_lengths[key][len(piece)] -= 1
            if not self._tail_lengths[key][len(piece)]:
                del self._tail_lengths[key][len(piece)]

    def walk(
        self, tail: bytes, start: int, hasher: Any
    ) -> tuple[list[tuple[int, int]], int | None]:
        """Walk a prompt from token `start` (`hasher` holds its digest there; `tail` is the
        prompt from there on): every sequence the prompt starts with, as (owner, where the
        prompt goes on past it, in bytes), and the owner of the deepest block key it shares
        (the sequence it follows longest)."""
        found: list[tuple[int, int]] = []
        follows: int | None = None
        hasher = hasher.copy()
        at, end = start, start + len(tail) // _ID
        while True:
            key = (at, digest(hasher))
            offset = (at - start) * _ID
            for length in self._tail_lengths.get(key, ()):
                owners = self.heads[key].get(tail[offset : offset + length], ())
                if offset + length <= len(tail):
                    found += [(owner, at * _ID + length) for owner, _ in owners]
            writer = self.blocks.get(key)
            if writer is None:
                return found, follows
            follows = writer
            if at + BLOCK > end:
                return found, follows
            hasher.update(tail[offset : offset + BLOCK * _ID])
            at += BLOCK
