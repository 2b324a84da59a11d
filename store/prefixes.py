"""An index of token prefixes: which known sequence a prompt follows, without comparing it
with each one (`store.lineages` keeps one sequence per conversation of a session).

Every indexed sequence registers a keyed 64-bit digest of its first k x `BLOCK` tokens for each
k (the most recent sequence to register a digest owns it), and one *head* key: the digest at the
last boundary before its end. A prompt is walked boundary by boundary from the start (or from a
boundary it is known to share with a sequence): where its digest is a head key, the sequences
ending within the next block are candidates it may extend (checked exactly); where its digest
is no block key, no indexed sequence shares more with it and the walk stops. A walk costs the
prompt's shared length in hashing, one dictionary look-up a block; memory is one entry a block.
The digests are keyed with a secret of the process, so an agent cannot craft collisions.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

#: Tokens per block.
BLOCK = 32
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
    """Block digests of every indexed sequence, and their head keys."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, bytes], int] = {}
        self.heads: dict[tuple[int, bytes], set[int]] = {}

    def update(self, owner: int, sequence: bytes | bytearray, digests: Digests) -> None:
        """Index `sequence` (of `owner`): the boundaries it passed since last time, its head."""
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
        self.unhead(owner, digests)
        at, hasher = digests.head_boundary(n)
        digests.head_key = (at, digest(hasher))
        self.heads.setdefault(digests.head_key, set()).add(owner)

    @staticmethod
    def rewind(digests: Digests, tokens: int) -> None:
        """The sequence is about to change from token `tokens` on: forget the digests past it."""
        if digests.hashed <= tokens:
            return
        if digests.earlier is not None and digests.earlier[0] <= tokens:
            (digests.hashed, digests.hasher), digests.earlier = digests.earlier, None
        else:
            digests.hashed, digests.hasher, digests.earlier = 0, new_hasher(), None

    def unhead(self, owner: int, digests: Digests) -> None:
        """Take the sequence's head key out."""
        if digests.head_key is not None:
            self.heads.get(digests.head_key, set()).discard(owner)
            digests.head_key = None

    def walk(self, tail: bytes, start: int, hasher: Any) -> tuple[list[int], int | None]:
        """Walk a prompt from token `start` (`hasher` holds its digest there; `tail` is the
        prompt from there on): the owners of every head key met (candidates it may extend), and
        the owner of the deepest block key it shares (the sequence it follows longest)."""
        candidates: list[int] = []
        follows: int | None = None
        hasher = hasher.copy()
        at, end = start, start + len(tail) // _ID
        while True:
            key = (at, digest(hasher))
            candidates.extend(self.heads.get(key, ()))
            owner = self.blocks.get(key)
            if owner is None:
                return candidates, follows
            follows = owner
            if at + BLOCK > end:
                return candidates, follows
            offset = (at - start) * _ID
            hasher.update(tail[offset : offset + BLOCK * _ID])
            at += BLOCK
