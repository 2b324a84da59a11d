"""The turns this replica remembers of each session, by lineage: which earlier turn a request
continues, so that its prompt can be continued from the ids sampled (`proxy.continuation`) and
stored as a reference plus what is new (`proxy.recorder`).

A session carries several conversations at once (a main loop, sub-agents, side calls:
`store.lineages`), so the turn a request continues is not the session's last one: it is the
deepest remembered turn T whose messages the request repeats first, byte for byte as orjson
serialises them (an agent sends its own messages back verbatim), and then T's reply. Each turn
is keyed by a digest of its messages' serialisation (without the closing bracket); a request's
serialisation is hashed once, with a digest taken at the length of each lineage's last turn
(then, when none fits, of every remembered turn: a rewind to an earlier point). The cost is the
request's size plus one look-up per lineage, whatever the session's length.

Turns that extend each other form a *chain* (a lineage as this replica saw it): only the chain's
last turn keeps its whole prompt; an earlier turn's prompt is the start of it. A chain costs its
last prompt plus its completions, not the square of its turns.

Bounded: `PromptContexts` holds at most `max_bytes` (the least recently used sessions go first),
and a finished or discarded session is forgotten at once. What is forgotten is read back from the
log when a request needs it (`proxy.continuation.turn_in_log`), as on another replica or after a
restart: slower, never wrong.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

_KEY = os.urandom(16)
_COMMA = ord(",")


def _hasher() -> Any:
    return hashlib.blake2b(digest_size=16, key=_KEY)


def messages_key(serialised: bytes) -> bytes:
    """The key of a message list's serialisation: its digest without the closing bracket, which
    a request that repeats the list and goes on has a comma in place of."""
    hasher = _hasher()
    hasher.update(memoryview(serialised)[:-1])
    return bytes(hasher.digest())


class Ending(NamedTuple):
    """How one choice of a turn ended, as the next turn may continue it."""

    tokens: bytes  #: the completion's ids, packed
    finish_reason: str | None
    stop_reason: Any
    reply: dict[str, Any] | None  #: the assistant message the proxy returned


@dataclass(eq=False)
class Turn:
    """A completed turn, as a later request may continue it."""

    request_id: str
    prompt_len: int  #: tokens of its prompt
    n_messages: int
    messages_len: int  #: bytes of its messages' serialisation
    messages_key: bytes
    render_key: bytes
    choices: tuple[Ending, ...]
    api: str = "chat"  #: the API it came in (its messages are the chat ones it was sent as)
    #: For a turn read from the log: its messages and render options, parsed. PostgreSQL's
    #: jsonb does not keep key order, so these are compared as values, not as bytes.
    from_log: tuple[list[Any], list[Any]] | None = None
    #: Its whole prompt, packed; None once a later turn of its chain holds it.
    held_prompt: bytes | None = field(default=None, repr=False)
    chain: Chain | None = field(default=None, repr=False)

    @property
    def prompt(self) -> bytes:
        """Its whole prompt, packed."""
        if self.held_prompt is not None:
            return self.held_prompt
        assert self.chain is not None
        return self.chain.head.prompt[: 4 * self.prompt_len]

    @property
    def tokens(self) -> bytes:
        """Its prompt + completion (choice 0), packed: what a later prompt may reference."""
        return self.prompt + self.choices[0].tokens if self.choices else self.prompt

    @property
    def size(self) -> int:
        """About how many bytes it holds."""
        held = len(self.held_prompt or b"") + len(self.render_key) + 200
        return held + sum(len(ending.tokens) for ending in self.choices)


@dataclass(eq=False)
class Chain:
    """Turns that extend each other (a lineage, as this replica saw it); the last holds the
    whole prompt. It also keeps when its continuation was last audited, and whether an audit
    turned continuation off for it (`proxy.continuation`)."""

    turns: list[Turn] = field(default_factory=list)
    continued: int = 0  #: turns continued since the last audit
    off: str | None = None  #: why continuation is off for this lineage

    @property
    def head(self) -> Turn:
        """Its last turn."""
        return self.turns[-1]


class SessionTurns:
    """The turns of one session this replica remembers."""

    def __init__(self) -> None:
        self.chains: list[Chain] = []
        self.latest: Turn | None = None  #: the most recently completed turn
        self.images: frozenset[str] = frozenset()  #: images recorded for the session here
        self._by_key: dict[tuple[int, bytes], list[Turn]] = {}
        self.size = 0

    def add(self, turn: Turn, extends: Turn | None) -> None:
        """A completed turn; `extends`: the remembered turn whose prompt + completion its
        prompt starts with (then it joins that turn's chain when that turn is the last)."""
        chain = extends.chain if extends is not None else None
        if chain is not None and chain.head is extends and turn.held_prompt is not None:
            assert extends is not None
            self.size -= len(extends.held_prompt or b"")
            extends.held_prompt = None  # the new last turn's prompt holds it
        else:
            chain = Chain()
            self.chains.append(chain)
        chain.turns.append(turn)
        turn.chain = chain
        self._by_key.setdefault((turn.messages_len, turn.messages_key), []).append(turn)
        self.latest = turn
        self.size += turn.size

    def continued_by(self, serialised: bytes) -> list[Turn]:
        """The remembered turns whose messages `serialised` (a request's) starts with and goes on
        past, deepest first: the lineages' last turns; when none fits, any turn."""
        if not self._by_key:
            return []
        found = self._fitting(serialised, sorted({c.head.messages_len for c in self.chains}))
        if not found:
            found = self._fitting(serialised, sorted({n for n, _ in self._by_key}))
        return found

    def _fitting(self, serialised: bytes, lengths: list[int]) -> list[Turn]:
        hasher = _hasher()
        done = 0
        found: list[Turn] = []
        for length in lengths:
            cut = length - 1
            if cut >= len(serialised) - 1:
                break
            if serialised[cut] != _COMMA:
                continue
            hasher.update(memoryview(serialised)[done:cut])
            done = cut
            found += self._by_key.get((length, bytes(hasher.copy().digest())), ())
        return sorted(found, key=lambda t: t.messages_len, reverse=True)


class PromptContexts:
    """What this replica remembers of each session (`SessionTurns`), within a byte budget."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._sessions: OrderedDict[str, SessionTurns] = OrderedDict()
        self._bytes = 0

    def get(self, session_id: str) -> SessionTurns:
        """The session's remembered turns (a new, empty record if none)."""
        turns = self._sessions.get(session_id)
        if turns is None:
            turns = self._sessions[session_id] = SessionTurns()
        self._sessions.move_to_end(session_id)
        return turns

    def remember(self, session_id: str, turn: Turn, extends: Turn | None) -> None:
        """Record a completed turn (called once its events are queued, in log order)."""
        turns = self.get(session_id)
        self._bytes -= turns.size
        turns.add(turn, extends)
        self._bytes += turns.size
        while self._bytes > self.max_bytes and len(self._sessions) > 1:
            _, dropped = self._sessions.popitem(last=False)
            self._bytes -= dropped.size

    def forget(self, session_id: str) -> None:
        """Release a session (finished or discarded: no request of it will come)."""
        dropped = self._sessions.pop(session_id, None)
        if dropped is not None:
            self._bytes -= dropped.size

    @property
    def held(self) -> int:
        """Bytes held, about."""
        return self._bytes
