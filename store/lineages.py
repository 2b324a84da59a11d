"""Lineages: the conversations of one session, found from the tokens alone.

Real agents run several conversations through one session's base URL, interleaved in time: the
main loop, sub-agents with their own system prompt, side calls (a title, a safety check, a
summary). Each conversation is a *lineage*: a chain of turns where every turn's prompt extends
the tokens of the turn before it (that turn's prompt and the completion actually sampled). The
projection makes one sample per lineage, more where a lineage's own history diverged.

The rule. Turns are taken in request order (`store.sessions`). For each turn with prompt P:

1. **Extend.** P starts with a lineage's tokens: those of its last turn (prompt + completion), or
   all of them but the final end-of-turn token when that turn stopped on it and the template does
   not repeat it. The deepest such lineage wins and the turn joins it.
2. Otherwise take the lineage L whose tokens P shares the longest prefix with (s tokens; ties go
   to the lineage most recently extended) and decide, in order:
   - `history_truncated`: P is a strict prefix of L's tokens (the context was cut at its end);
   - `template_not_append_only`: P repeats L's last prompt whole and differs inside L's last
     completion (the reply came back re-rendered);
   - `compacted` / `history_rewritten`: P contains L's last completion (the interior of it, at
     least `MIN_CONTAINED` tokens) past where it leaves L's tokens: the agent kept the latest
     reply and changed what came before it. `compacted` when P is less than half as long as L's
     tokens (the history was replaced by something shorter, such as a summary the model wrote,
     or old tool output pruned), else `history_rewritten` (a message edited inside the history).
     Any lineage whose last completion P contains is considered, L first.
   In these three cases the turn stays in L and starts a new branch of it: a *divergence*,
   recorded with its turn, position and reason.
   - **Side call at the tip.** P extends the tokens of the turn T just before L's last turn H,
     and H extended T: H was a call off the conversation (a summary, a check, a parallel call
     from the same point) that the conversation did not take up. H leaves L and becomes a
     lineage of its own, forked from L, and the turn joins L after T.
3. Otherwise the turn starts a new lineage. It *forks* from L when they share at least
   `MIN_SHARED` tokens (a sub-agent or a side call that repeats the harness's system prompt, a
   rewind to an earlier point of L), with `fork_at` = s; else it is a root.

A lineage's tokens are those of its *current* branch; a divergence starts a new branch. With
`n > 1` the lineage continues the choice that the next turn extends (choice 0 when none does).

Roles. The orchestrator may name the main lineage when it finishes the session; otherwise the
main lineage is the one that reached the longest context (ties: more turns, then the earlier
one): a harness's main loop carries its whole system prompt, every tool and the task's history,
where side calls (titles, checks) are short and sub-agents start from a task description. Every
other lineage is a `subagent` when it has two turns or more, else a `side` call.

Cost. Lineages are found through an index of their tokens' prefixes (a keyed 64-bit digest at
every `BLOCK` tokens, and one per lineage at its last turn), not by comparing a prompt with every
lineage: a turn whose prompt the log stores as a reference to a lineage's last turn costs what it
added; a prompt stored whole costs its length once. A session of thousands of unrelated one-call
lineages is linear in its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trajstore.store.prefixes import Digests, PrefixIndex, extends, new_hasher
from trajstore.store.tokens import TOKEN_DTYPE, shared_prefix

if TYPE_CHECKING:
    from trajstore.store.sessions import SessionRecord, TurnRecord

#: Tokens a turn must share with a lineage to count as forked from it (less: a root).
MIN_SHARED = 16
#: Tokens of a completion's interior that must reappear for a turn to count as keeping it.
MIN_CONTAINED = 8
_ID = TOKEN_DTYPE.itemsize


@dataclass
class Divergence:
    """Where and why a lineage's history stopped extending its previous branch."""

    turn: int  #: index of the turn whose prompt did not extend the lineage
    position: int  #: first token position where the prompt and the lineage differ
    reason: str  #: history_truncated | history_rewritten | template_not_append_only | compacted

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {"turn": self.turn, "position": self.position, "reason": self.reason}


@dataclass
class Step:
    """One turn of a branch: the tokens before its completion, and the choice continued."""

    turn: int  #: index into session.turns
    glue: bytes  #: packed ids between the branch's previous completion and this one's
    at: int = 0  #: where the glue starts in the lineage's tokens (bytes)
    choice: int = 0


@dataclass
class Branch:
    """A run of turns that extend each other; the first has the whole prompt as its glue."""

    steps: list[Step] = field(default_factory=list)
    divergence: Divergence | None = None


@dataclass(frozen=True)
class _Before:
    """The turn before a lineage's last one, as far as a side call at the tip needs it."""

    turn: int
    length: int  #: bytes of its prompt + completion
    last: bytes  #: its last id, packed (the next turn's glue may have overwritten it)
    eot: bool
    prompt_len: int  #: tokens of its prompt


@dataclass
class Lineage:
    """One conversation of a session."""

    index: int  #: in order of its first turn
    parent: int | None = None  #: the lineage it forked from
    fork_at: int | None = None  #: tokens it shares with its parent
    branches: list[Branch] = field(default_factory=list)
    role: str = "side"  #: main | subagent | side
    longest: int = 0  #: the longest context it reached (tokens)
    # Its tokens: the current branch's last turn, prompt + continued completion.
    state: bytearray = field(default_factory=bytearray, repr=False)
    prompt_len: int = 0  #: tokens of that turn's prompt
    eot: bool = False  #: that turn stopped on its last id: a next prompt may leave it out
    before: _Before | None = None
    touched: int = 0  #: when it was last extended (the most recent wins ties)
    digests: Digests = field(default_factory=Digests, repr=False)  #: how far it is indexed

    @property
    def n_turns(self) -> int:
        """Turns in all its branches."""
        return sum(len(b.steps) for b in self.branches)

    @property
    def turns(self) -> list[int]:
        """Its turns, in order."""
        return [s.turn for b in self.branches for s in b.steps]

    @property
    def tip(self) -> Step:
        """Its last turn."""
        return self.branches[-1].steps[-1]

    def head_boundary(self) -> tuple[int, Any]:
        """Where a prompt that extends its tokens is sure to still agree (`store.prefixes`)."""
        return self.digests.head_boundary(len(self.state) // _ID)


@dataclass
class Forest:
    """A session's lineages, and where each of its turns went."""

    lineages: list[Lineage] = field(default_factory=list)
    lineage_of: dict[int, int] = field(default_factory=dict)  #: turn index -> lineage index
    main: int | None = None


def _packed(values: Any) -> bytes:
    return values if isinstance(values, bytes) else np.asarray(values, TOKEN_DTYPE).tobytes()


class Assigner:
    """Places a session's turns into lineages by the rule in the module's docstring."""

    def __init__(self, session: SessionRecord) -> None:
        self.session = session
        self.forest = Forest()
        self.index = PrefixIndex()
        self._clock = 0
        self._tips: dict[str, Lineage] = {}  # request id of a lineage's last turn -> it
        self._completions: dict[int, list[int]] = {}  # a completion's first key -> lineages
        self._contained: dict[int, tuple[bytes, int]] = {}  # lineage -> (interior, its key)

    def run(self) -> Forest:
        """Place every completed turn, in order; then the roles."""
        for index, turn in enumerate(self.session.turns):
            if turn.status == "completed" and turn.choices:
                self._place(index, turn)
                self._finish(index)
        self._roles()
        return self.forest

    # -- the walk over the index -----------------------------------------------------------

    def _walk(
        self, tail: bytes, start: int, hasher: Any
    ) -> tuple[tuple[Lineage, int] | None, int | None]:
        """The deepest lineage a prompt extends, with where its glue starts (bytes), and the
        lineage it follows longest; the prompt from token `start` on is `tail` (`hasher` holds
        its digest at `start`)."""
        candidates, follows = self.index.walk(tail, start, hasher)
        found: tuple[Lineage, int] | None = None
        for index in candidates:
            lineage = self.forest.lineages[index]
            glue_at = extends(tail, start * _ID, lineage.state, lineage.eot)
            if glue_at is not None and (found is None or glue_at > found[1]):
                found = (lineage, glue_at)
        return found, follows

    # -- turns -------------------------------------------------------------------------------

    def _place(self, index: int, turn: TurnRecord) -> None:
        by_reference = self._by_reference(turn)
        if by_reference is not None:
            (found, _), start, tail = by_reference
            if found is not None:  # always, unless the index lost it: then the general way
                lineage, glue_at = found
                self._join(lineage, index, tail[glue_at - start :], glue_at)
                return
        prompt = _packed(turn.prompt_token_ids)
        found, follows = self._walk(prompt, 0, new_hasher())
        if found is not None and self._other_choice(found[0], prompt, found[1]):
            self._place(index, turn)
        elif found is not None:
            lineage, glue_at = found
            self._join(lineage, index, prompt[glue_at:], glue_at)
        elif follows is not None and self._other_choice(self.forest.lineages[follows], prompt, 0):
            self._place(index, turn)
        else:
            self._diverge_or_start(index, turn, prompt, follows)

    def _by_reference(self, turn: TurnRecord) -> tuple[Any, int, bytes] | None:
        """For a prompt the log stores as a reference to a lineage's last turn, which it
        extends: the walk from that lineage's last boundary, over the tokens from there on
        (what the turn added, and the end of the lineage's tokens). None for other prompts."""
        prefix = turn.prompt_prefix
        lineage = None if prefix is None else self._tips.get(str(prefix.get("request_id")))
        if lineage is None or lineage.tip.choice != 0:
            return None
        assert prefix is not None
        n = int(prefix.get("n_tokens") or 0) * _ID
        if not (n == len(lineage.state) or (lineage.eot and n == len(lineage.state) - _ID)):
            return None
        at, hasher = lineage.head_boundary()
        tail = bytes(lineage.state[at * _ID : n]) + _packed(turn.prompt_added)
        return self._walk(tail, at, hasher), at * _ID, tail

    def _other_choice(self, lineage: Lineage, prompt: bytes, deeper_than: int) -> bool:
        """With n > 1: whether `prompt` extends another choice of the lineage's last turn further
        than `deeper_than` bytes (that choice then becomes the one the lineage continues)."""
        turn = self.session.turns[lineage.tip.turn]
        if len(turn.choices) < 2 or len(lineage.branches[-1].steps) == 0:
            return False
        head = bytes(lineage.state[: lineage.prompt_len * _ID])
        for index in sorted(turn.choices):
            choice = turn.choices[index]
            state = head + _packed(choice.token_ids)
            eot = choice.finish_reason == "stop" and bool(choice.token_ids)
            glue_at = extends(prompt, 0, state, eot)
            if index != lineage.tip.choice and glue_at is not None and glue_at > deeper_than:
                lineage.tip.choice = index
                lineage.state, lineage.eot = bytearray(state), eot
                self.index.update(lineage.index, lineage.state, lineage.digests)
                return True
        return False

    def _join(self, lineage: Lineage, index: int, glue: bytes, at: int) -> None:
        tip = lineage.tip
        state = lineage.state
        lineage.before = _Before(tip.turn, len(state), bytes(state[-_ID:]), lineage.eot,
                                 lineage.prompt_len)  # fmt: skip
        lineage.branches[-1].steps.append(Step(index, glue, at))
        self._tip(lineage, index)

    def _tip(self, lineage: Lineage, index: int) -> None:
        """The turn is the lineage's last now."""
        for request_id in [r for r, lin in self._tips.items() if lin is lineage]:
            del self._tips[request_id]
        self._tips[self.session.turns[index].request_id] = lineage
        self.forest.lineage_of[index] = lineage.index

    def _new(self, index: int, prompt: bytes, parent: int | None, fork_at: int | None) -> None:
        lineage = Lineage(len(self.forest.lineages), parent, fork_at)
        lineage.branches.append(Branch([Step(index, prompt)]))
        self.forest.lineages.append(lineage)
        self._tip(lineage, index)

    def _finish(self, index: int) -> None:
        """The turn's lineage's tokens become its prompt + completion."""
        lineage = self.forest.lineages[self.forest.lineage_of[index]]
        turn = self.session.turns[index]
        step = lineage.tip
        choice = turn.choices.get(step.choice) or turn.choices[min(turn.choices)]
        if len(lineage.branches[-1].steps) == 1:
            self.index.rewind(lineage.digests, 0)
            lineage.state = bytearray(step.glue)
        else:
            self.index.rewind(lineage.digests, step.at // _ID)
            del lineage.state[step.at :]
            lineage.state += step.glue
        lineage.prompt_len = len(lineage.state) // _ID
        completion = _packed(choice.token_ids)
        lineage.state += completion
        lineage.eot = choice.finish_reason == "stop" and bool(completion)
        lineage.longest = max(lineage.longest, len(lineage.state) // _ID)
        self._touch(lineage)
        self._remember_completion(lineage, completion, choice.finish_reason)

    def _touch(self, lineage: Lineage) -> None:
        self._clock += 1
        lineage.touched = self._clock
        self.index.update(lineage.index, lineage.state, lineage.digests)

    # -- a prompt that extends no lineage ---------------------------------------------------

    def _diverge_or_start(
        self, index: int, turn: TurnRecord, prompt: bytes, follows: int | None
    ) -> None:
        lineage = None if follows is None else self.forest.lineages[follows]
        shared = 0 if lineage is None else shared_prefix(prompt, bytes(lineage.state))
        if lineage is not None:
            reason = self._divergence(lineage, prompt, shared)
            if reason is not None:
                self._branch(lineage, index, prompt, Divergence(index, shared, reason))
                return
        kept = self._containing(prompt, exclude=follows)
        if kept is not None:
            at = shared_prefix(prompt, bytes(kept.state))
            self._branch(kept, index, prompt, Divergence(index, at, self._kept(kept, prompt)))
            return
        if lineage is not None and self._side_call_at_tip(lineage, prompt):
            self._place(index, turn)  # the lineage is back at the turn before: place it again
            return
        if lineage is not None and shared >= MIN_SHARED:
            self._new(index, prompt, lineage.index, shared)
        else:
            self._new(index, prompt, None, None)

    def _divergence(self, lineage: Lineage, prompt: bytes, shared: int) -> str | None:
        if shared == len(prompt) // _ID < len(lineage.state) // _ID:
            return "history_truncated"
        if shared >= lineage.prompt_len:
            return "template_not_append_only"
        if self._contains(prompt, lineage, shared):
            return self._kept(lineage, prompt)
        return None

    @staticmethod
    def _kept(lineage: Lineage, prompt: bytes) -> str:
        return "compacted" if 2 * len(prompt) < len(lineage.state) else "history_rewritten"

    def _branch(self, lineage: Lineage, index: int, prompt: bytes, why: Divergence) -> None:
        lineage.branches.append(Branch([Step(index, prompt)], why))
        lineage.before = None
        self._tip(lineage, index)

    def _side_call_at_tip(self, lineage: Lineage, prompt: bytes) -> bool:
        """Rule 2's last case: when `prompt` extends the turn before the lineage's last one,
        that last turn leaves for a lineage of its own. Returns whether it did."""
        before = lineage.before
        if before is None:
            return False
        state_before = bytes(lineage.state[: before.length - _ID]) + before.last
        if extends(prompt, 0, state_before, before.eot) is None:
            return False
        head = lineage.branches[-1].steps.pop()
        side = Lineage(len(self.forest.lineages), lineage.index, before.length // _ID)
        prompt_of_head = bytes(lineage.state[: lineage.prompt_len * _ID])
        side.branches.append(Branch([Step(head.turn, prompt_of_head, 0, head.choice)]))
        side.state = bytearray(lineage.state)
        side.prompt_len, side.eot, side.longest = lineage.prompt_len, lineage.eot, lineage.longest
        self.forest.lineages.append(side)
        self._tip(side, head.turn)
        self._touch(side)
        held = self._contained.get(lineage.index)
        self._forget_completion(lineage)
        if held is not None:
            self._contained[side.index] = held
            self._completions[held[1]].append(side.index)
        # The conversation is back at the turn before: it is the lineage's last again.
        self.index.rewind(lineage.digests, before.length // _ID - 1)
        lineage.state = bytearray(state_before)
        lineage.prompt_len, lineage.eot = before.prompt_len, before.eot
        lineage.before = None
        self._tips[self.session.turns[before.turn].request_id] = lineage
        self._touch(lineage)
        return True

    # -- a lineage's last completion, kept inside a later prompt ----------------------------

    def _remember_completion(
        self, lineage: Lineage, completion: bytes, finish_reason: str | None
    ) -> None:
        self._forget_completion(lineage)
        ids = completion[:-_ID] if finish_reason == "stop" else completion
        interior = ids[_ID:-_ID]  # its edges may merge with the text around it when re-rendered
        if len(interior) < MIN_CONTAINED * _ID:
            return
        key = int(_window_keys(interior[: MIN_CONTAINED * _ID])[0])
        self._contained[lineage.index] = (interior, key)
        self._completions.setdefault(key, []).append(lineage.index)

    def _forget_completion(self, lineage: Lineage) -> None:
        held = self._contained.pop(lineage.index, None)
        if held is not None:
            self._completions[held[1]].remove(lineage.index)

    def _contains(self, prompt: bytes, lineage: Lineage, after: int) -> bool:
        held = self._contained.get(lineage.index)
        if held is None:
            return False
        at = prompt.find(held[0], after * _ID)
        while at >= 0 and at % _ID:
            at = prompt.find(held[0], at + 1)
        return at >= 0

    def _containing(self, prompt: bytes, exclude: int | None) -> Lineage | None:
        """The most recently extended lineage whose last completion `prompt` contains."""
        wanted = [k for k, v in self._completions.items() if v]
        if not wanted or len(prompt) < MIN_CONTAINED * _ID:
            return None
        keys = _window_keys(prompt)
        found = [
            self.forest.lineages[index]
            for key in np.unique(keys[np.isin(keys, np.array(wanted, np.uint64))]).tolist()
            for index in self._completions.get(int(key), ())
            if index != exclude
        ]
        found = [lin for lin in found if self._contains(prompt, lin, 0)]
        return max(found, key=lambda lin: lin.touched) if found else None

    # -- roles -------------------------------------------------------------------------------

    def _roles(self) -> None:
        lineages = self.forest.lineages
        if not lineages:
            return
        named = self.session.main_lineage
        if named is not None and 0 <= named < len(lineages):
            main = lineages[named]
        else:
            main = max(lineages, key=lambda lin: (lin.longest, lin.n_turns, -lin.index))
        for lineage in lineages:
            lineage.role = "subagent" if lineage.n_turns > 1 else "side"
        main.role = "main"
        self.forest.main = main.index


def _window_keys(packed: bytes) -> np.ndarray[Any, np.dtype[np.uint64]]:
    """A 64-bit key of every run of MIN_CONTAINED ids (wrapping arithmetic: a hit is checked)."""
    ids = np.frombuffer(packed, TOKEN_DTYPE).astype(np.uint64)
    n = max(len(ids) - MIN_CONTAINED + 1, 0)
    keys = np.zeros(n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(MIN_CONTAINED):
            keys = keys * np.uint64(1_000_003) + ids[j : j + n]
    return keys


def assign(session: SessionRecord) -> Forest:
    """The session's lineages and where each completed turn went (the module's rule)."""
    return Assigner(session).run()
