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

Bounded: `PromptContexts` holds at most `max_bytes` (the least recently used sessions go first;
one session at most half of it, its oldest turns going first), and a finished or discarded
session is forgotten at once. What is forgotten is read back from the
log when a request needs it (`proxy.continuation.turn_in_log`), as on another replica or after a
restart: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson

from trajstore.proxy.apis import TRANSLATIONS
from trajstore.proxy.errors import ProxyError
from trajstore.proxy.replicas import Replicas
from trajstore.store import EventStore, StoreError
from trajstore.store.records import TurnRecord
from trajstore.store.replies import same_reply
from trajstore.store.sessions import rebuild_session

log = logging.getLogger(__name__)

#: Request fields that change how the template renders: a continuation needs them unchanged.
RENDER_FIELDS = ("tools", "chat_template", "chat_template_kwargs", "documents")


def render_key(body: dict[str, Any]) -> bytes:
    """The request's render options, comparable between turns."""
    return orjson.dumps([body.get(field) for field in RENDER_FIELDS])


# -- comparing the reply the agent sent back with the one it was given -------------------------


#: Remembered turns, other than the lineages' last, that a request is compared with.
REWINDS = 64
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

    head: Turn  #: its last turn (kept while a request holds one of its turns, even if trimmed)
    turns: deque[Turn] = field(default_factory=deque)  #: those still remembered, oldest first
    since_audit: int = 0  #: turns continued since its last audit
    audited_at: int = 0  #: prompt tokens at its last audit (0: never audited)
    off: str | None = None  #: why continuation is off for this lineage
    remembered: bool = True  #: False once `SessionTurns.trim` forgot its last turn

    def append(self, turn: Turn) -> None:
        """A turn that extends its head: the new head."""
        self.turns.append(turn)
        self.head = turn
        turn.chain = self


class SessionTurns:
    """The turns of one session this replica remembers."""

    def __init__(self) -> None:
        self.chains: list[Chain] = []
        self.latest: Turn | None = None  #: the most recently completed turn
        self.images: frozenset[str] = frozenset()  #: images recorded for the session here
        self._by_key: dict[tuple[int, bytes], list[Turn]] = {}
        self._heads: dict[int, int] = {}  # the lineages' last turns' messages lengths: how many
        self._order: deque[Turn] = deque()  # every remembered turn, oldest first
        self.size = 0

    def add(
        self,
        turn: Turn,
        extends: Turn | None,
        *,
        parent: Turn | None = None,
    ) -> None:
        """A completed turn. `extends`: the remembered turn whose prompt + completion its prompt
        starts with (it joins that turn's chain when that turn is the last); `parent`: the turn
        its request continued or looked like (a chain of its own keeps the parent's audit
        verdict)."""
        chain = extends.chain if extends is not None else None
        joins = chain is not None and chain.remembered and chain.head is extends
        if chain is not None and joins and turn.held_prompt is not None:
            assert extends is not None
            self.size -= len(extends.held_prompt or b"")
            extends.held_prompt = None  # the new last turn's prompt holds it
            self._count_head(extends.messages_len, -1)
            chain.append(turn)
        else:
            chain = Chain(turn, deque([turn]))
            turn.chain = chain
            if parent is not None and parent.chain is not None:
                chain.off = parent.chain.off
            self.chains.append(chain)
        self._count_head(turn.messages_len, +1)
        self._by_key.setdefault((turn.messages_len, turn.messages_key), []).append(turn)
        self._order.append(turn)
        self.latest = turn
        self.size += turn.size

    def trim(self, max_bytes: int) -> None:
        """Forget the oldest turns until the session holds at most `max_bytes` (the latest turn
        stays): a session of many thousands of turns, or of thousands of one-call lineages,
        stays within its share of the replica's budget. A request that continues a forgotten
        turn finds it in the log (`turn_in_log`), as after a restart."""
        while self.size > max_bytes and len(self._order) > 1:
            turn = self._order.popleft()
            self.size -= turn.size
            same = self._by_key[turn.messages_len, turn.messages_key]
            same.remove(turn)
            if not same:
                del self._by_key[turn.messages_len, turn.messages_key]
            chain = turn.chain
            assert chain is not None and chain.turns[0] is turn  # a chain's turns come in order
            chain.turns.popleft()
            if chain.head is turn:  # every earlier turn of its chain went first
                self._count_head(turn.messages_len, -1)
                chain.remembered = False
                self.chains.remove(chain)

    def _count_head(self, length: int, by: int) -> None:
        count = self._heads.get(length, 0) + by
        if count:
            self._heads[length] = count
        else:
            del self._heads[length]

    def continued_by(self, serialised: bytes) -> list[Turn]:
        """The remembered turns whose messages `serialised` (a request's) starts with and goes on
        past, deepest first: the lineages' last turns; when none fits, the `REWINDS` deepest
        other turns it could continue (a rewind to an earlier point: further back, the log
        answers)."""
        if not self._by_key:
            return []
        found = self._fitting(serialised, sorted(self._heads))
        if not found:
            shorter = sorted(n for n, _ in self._by_key if n < len(serialised))
            found = self._fitting(serialised, shorter[-REWINDS:])
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

    def remember(
        self,
        session_id: str,
        turn: Turn,
        extends: Turn | None,
        parent: Turn | None = None,
    ) -> None:
        """Record a completed turn (called once its events are queued, in log order); the
        arguments are `SessionTurns.add`'s."""
        turns = self.get(session_id)
        self._bytes -= turns.size
        turns.add(turn, extends, parent=parent)
        turns.trim(self.max_bytes // 2)  # one session never takes the whole budget
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


# -- the turn continued, from the log ------------------------------------------------------


def turn_from_record(record: TurnRecord) -> Turn | None:
    """A completed turn as rebuilt from the log (`rebuild_session(packed=True)`), or None."""
    translation = TRANSLATIONS.get(record.api)
    if record.status != "completed" or (record.api != "chat" and translation is None):
        return None
    body = {**record.body, "messages": record.messages}
    try:
        chat = body if translation is None else translation.to_chat(record.body)
    except ProxyError:
        return None
    messages = chat.get("messages")
    prompt = record.prompt_token_ids
    if not isinstance(messages, list) or not isinstance(prompt, bytes) or not record.choices:
        return None
    endings = []
    for index in range(len(record.choices)):
        choice = record.choices.get(index)
        if choice is None:
            return None
        tokens = choice.token_ids if isinstance(choice.token_ids, bytes) else b""
        endings.append(Ending(tokens, choice.finish_reason, choice.stop_reason, choice.message))
    options = [chat.get(name) for name in RENDER_FIELDS]
    return Turn(
        record.request_id, len(prompt) // 4, len(messages), 0, b"", b"", tuple(endings),
        api=record.api, from_log=(messages, options), held_prompt=prompt,
    )  # fmt: skip


async def turn_in_log(
    store: EventStore,
    replicas: Replicas,
    session_id: str,
    messages: list[Any],
    wait: float = 2.0,
) -> Turn | None:
    """The deepest turn of the session's log whose messages and reply `messages` starts with,
    for a request that continues a turn this replica does not remember (served by another
    replica, before a restart, or forgotten).

    The other replicas are asked to store the session's events first (the finish barrier), but
    for `wait` seconds at most: a turn is not held up for long; without them, the log may lack
    the turn continued, and the request is then rendered from its messages.
    """
    try:
        async with asyncio.timeout(wait):
            await replicas.flush_everywhere(session_id)
    except (TimeoutError, ProxyError, StoreError) as exc:
        log.info("continuation reads %s's log without every replica's writes: %s", session_id, exc)
    record = rebuild_session(session_id, await store.read_session(session_id), packed=True)
    best: Turn | None = None
    # Cheap first: the message after the turn's must be its reply; only then the whole list.
    for candidate in reversed(record.turns):
        if candidate.status != "completed" or candidate.api == "completions":
            continue
        n = _n_messages(candidate)
        if n is None or n + 1 >= len(messages) or (best and best.n_messages >= n):
            continue
        if not any(same_reply(messages[n], c.message) for c in candidate.choices.values()):
            continue
        turn = turn_from_record(candidate)
        if turn is not None and turn.from_log and messages[:n] == turn.from_log[0]:
            best = turn
    return best


def _n_messages(record: TurnRecord) -> int | None:
    """How many messages the turn sent (from counts for chat: no list is built)."""
    if record.api == "chat":
        return record.n_messages
    turn = turn_from_record(record)
    return None if turn is None else turn.n_messages


# -- the continuation itself -------------------------------------------------------------------
