"""Prompts and messages the log stores as references to an earlier turn, made whole on demand.

The recorder stores a prompt that repeats an earlier turn's tokens as `prefix: {request_id,
n_tokens}` plus the ids after them, and messages that repeat an earlier request's as
`messages_prefix: {request_id, n_messages}` plus the rest (the contract is in `store.sessions`).
A session of many turns is then as large as what its turns added, not the square of it. Readers
keep it so:

- nothing is made whole until it is asked for, and then by walking the chain of references back
  to a turn stored whole and forward again: a loop, never recursion (a session of thousands of
  turns is a chain thousands long), linear in the chain and in the bytes of the result;
- whether every reference can be satisfied is decided from counts alone, in one pass, so a
  reader knows which turns cannot be rebuilt (their referenced turn is missing, too short, or the
  chain loops) without building any prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from trajstore.store.payloads_request import MessagesPrefix, PromptPrefix

_ID = 4  # bytes per packed token id
_CACHED = 4  # whole prompts kept: reading a session's turns in order costs each turn once


@dataclass
class _Prompt:
    added: bytes  #: ids stored with the turn (the whole prompt when `source` is None)
    source: str | None  #: the request whose prompt + completion it continues
    shared: int  #: ids taken from that request's prompt + completion
    completion: bytes = b""  #: its own choice 0, packed: what a later reference may take


class Prompts:
    """The session's prompts as stored; a whole one on demand (`whole`)."""

    def __init__(self) -> None:
        self._prompts: dict[str, _Prompt] = {}
        self._cache: OrderedDict[str, bytes] = OrderedDict()

    def add(self, request_id: str, added: bytes, prefix: PromptPrefix | None) -> None:
        """A turn's prompt as its prompt_tokens event stores it."""
        if prefix is None:
            self._prompts[request_id] = _Prompt(added, None, 0)
        else:
            self._prompts[request_id] = _Prompt(added, prefix.request_id, prefix.n_tokens)

    def completed(self, request_id: str, completion: bytes) -> None:
        """The turn's choice 0, packed (what references to it continue)."""
        if request_id in self._prompts:
            self._prompts[request_id].completion = completion

    def length(self, request_id: str) -> int:
        """The whole prompt's length in ids, from counts."""
        prompt = self._prompts[request_id]
        return prompt.shared + len(prompt.added) // _ID

    def unresolved(self) -> dict[str, str]:
        """Request id -> why its prompt cannot be made whole, for every such turn."""
        ok: dict[str, bool] = {}
        failed: dict[str, str] = {}
        for request_id in self._prompts:
            chain: dict[str, None] = {}  # in order, and a loop found in constant time
            at: str | None = request_id
            while at is not None and at not in ok:
                if at in chain or at not in self._prompts:
                    break  # a loop, or a request the session's events do not hold
                chain[at] = None
                at = self._prompts[at].source
            good = at is None or ok.get(at, False)
            for link in reversed(chain.keys()):
                prompt = self._prompts[link]
                if good and prompt.source is not None:
                    source = self._prompts[prompt.source]
                    held = self.length(prompt.source) + len(source.completion) // _ID
                    good = prompt.shared <= held
                ok[link] = good
                if not good:
                    failed[link] = (
                        f"its prompt continues request {prompt.source!r} for {prompt.shared} "
                        "tokens, which this session's events do not hold"
                    )
        return failed

    def whole(self, request_id: str) -> bytes:
        """The whole prompt, packed (call only for a turn `unresolved()` did not name)."""
        cached = self._cache.get(request_id)
        if cached is not None:
            self._cache.move_to_end(request_id)
            return cached
        chain = []
        at: str | None = request_id
        start: bytes | None = None
        while at is not None:
            start = self._cache.get(at)
            if start is not None:
                break
            chain.append(at)
            at = self._prompts[at].source
        built = bytearray(start or b"")
        for link in reversed(chain):
            prompt = self._prompts[link]
            if prompt.source is None:
                built = bytearray(prompt.added)
            else:
                # `built` is the source's whole prompt: its completion, cut to what is shared.
                built += self._prompts[prompt.source].completion
                del built[prompt.shared * _ID :]
                built += prompt.added
        whole = bytes(built)
        self._cache[request_id] = whole
        while len(self._cache) > _CACHED:
            self._cache.popitem(last=False)
        return whole


@dataclass
class _Messages:
    added: list[Any] | None  #: messages stored with the request (None: not a list)
    source: str | None
    count: int  #: messages taken from the source request


class Messages:
    """The session's requests' messages as stored; a whole list on demand (`whole`)."""

    def __init__(self) -> None:
        self._messages: dict[str, _Messages] = {}
        self._lengths: dict[str, int | None] | None = None  # whole lengths, once counted

    def add(self, request_id: str, added: Any, prefix: MessagesPrefix | None) -> None:
        """A request's messages as its request_received event stores them."""
        self._lengths = None
        listed = added if isinstance(added, list) else None
        if prefix is None:
            self._messages[request_id] = _Messages(listed, None, 0)
        else:
            count = prefix.n_messages or -1
            self._messages[request_id] = _Messages(listed, prefix.request_id, count)

    def whole(self, request_id: str) -> list[Any] | None:
        """The request's whole messages, or None when they cannot be made whole (a referenced
        request missing, with another count of messages, or a loop): never a guess."""
        chain: dict[str, None] = {}  # in order, and a loop found in constant time
        at: str | None = request_id
        while at is not None:
            if at in chain or at not in self._messages:
                return None
            chain[at] = None
            at = self._messages[at].source
        whole: list[Any] = []
        for link in reversed(chain.keys()):
            messages = self._messages[link]
            if messages.added is None or (messages.source and len(whole) != messages.count):
                return None
            whole += messages.added
        return whole

    def count(self, request_id: str) -> int | None:
        """How many messages the request's whole list holds (None: it cannot be made whole)."""
        if self._lengths is None:
            self.unresolved()
        assert self._lengths is not None
        return self._lengths.get(request_id)

    def unresolved(self) -> dict[str, str]:
        """Request id -> why its messages cannot be made whole, for every such request (from
        counts, in one pass)."""
        lengths: dict[str, int | None] = {}
        self._lengths = lengths
        failed: dict[str, str] = {}
        for request_id in self._messages:
            chain: dict[str, None] = {}
            at: str | None = request_id
            while at is not None and at not in lengths:
                if at in chain or at not in self._messages:
                    break
                chain[at] = None
                at = self._messages[at].source
            length = 0 if at is None else lengths.get(at)
            for link in reversed(chain.keys()):
                messages = self._messages[link]
                if messages.added is None or (
                    messages.source is not None and length != messages.count
                ):
                    length = None
                    if messages.source is not None:
                        failed[link] = (
                            f"its messages continue the {messages.count} of request "
                            f"{messages.source!r}, which this session's events do not hold"
                        )
                elif length is not None:
                    length = (length if messages.source else 0) + len(messages.added)
                lengths[link] = length
        return failed

    def added(self, request_id: str) -> list[Any] | None:
        """The messages the request stored itself (the new ones, when it references another)."""
        messages = self._messages.get(request_id)
        return None if messages is None else messages.added
