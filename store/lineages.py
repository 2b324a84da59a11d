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
2. Otherwise, when the turn's *messages* repeat those of a lineage's last turn and go on with an
   assistant message, it is that conversation although its tokens do not extend it: a divergence
   `template_not_append_only` when that message is the reply as it was given (the template
   rendered the history other than as sampled, e.g. from text after a fallback, or a thinking
   template dropping earlier reasoning), `history_rewritten` when it was edited.
3. Otherwise take the lineage L whose tokens P shares the longest prefix with (s tokens; ties go
   to the lineage most recently extended) and decide, in order:
   - `history_truncated`: P is a strict prefix of L's tokens (the context was cut at its end);
   - `template_not_append_only`: P repeats L's last prompt whole and differs inside L's last
     completion (the reply came back re-rendered);
   - `compacted` / `history_rewritten`: P shares at least `MIN_SHARED` tokens with L (its
     system prompt, say) and contains L's last completion (its interior, at least
     `MIN_CONTAINED` tokens) past where it leaves L's tokens: the agent kept the latest reply
     and changed what came before it. `compacted` when P is less than half as long as L's tokens
     (the history replaced by something shorter, such as a summary the model wrote, or old tool
     output pruned), else `history_rewritten` (a message edited inside the history);
   - `compacted`, too: P shares `MIN_SHARED` tokens with L and contains the last completion of
     another lineage whose prompt held L's last completion (a summary asked for in a call of its
     own, over L's history).
   In these cases the turn stays in L and starts a new branch of it: a *divergence*, recorded
   with its turn, position and reason. (A prompt that contains L's last completion but shares
   no prefix with it, such as a memory-extraction call over L's history under a system prompt
   of its own, is a new lineage forked from L at 0 tokens: a side call, not L's continuation.)
   - **Side call at the tip.** P extends the tokens of the turn T just before L's last turn H,
     and H extended T: H was a call off the conversation (a summary, a check, a parallel call
     from the same point) that the conversation did not take up. H leaves L and becomes a
     lineage of its own, forked from L, and the turn joins L after T.
4. Otherwise the turn starts a new lineage. It *forks* from L when they share at least
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

from trajstore.store.completions import LastCompletions
from trajstore.store.prefixes import Digests, PrefixIndex, extends, new_hasher
from trajstore.store.replies import same_reply
from trajstore.store.tokens import TOKEN_DTYPE, shared_prefix

if TYPE_CHECKING:
    from trajstore.store.sessions import SessionRecord, TurnRecord

#: Tokens a turn must share with a lineage to count as forked from it (less: a root).
MIN_SHARED = 16
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


@dataclass(eq=False)
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
    tip_request: str | None = None  #: its last turn's request id
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
        self._dirty: dict[Lineage, None] = {}  # lineages whose tokens changed since indexed
        self._clock = 0
        self._tips: dict[str, Lineage] = {}  # request id of a lineage's last turn -> it
        self._completions = LastCompletions()  # each lineage's, to find in a later prompt
        self._summaries: dict[int, list[Lineage]] = {}  # lineage -> calls over its history

    def run(self) -> Forest:
        """Place every completed turn, in order; then the roles."""
        for index, turn in enumerate(self.session.turns):
            if turn.status == "completed" and turn.choices:
                self._place(index, turn)
                self._finish(index)
        self._roles()
        return self.forest

    # -- the walk over the index -----------------------------------------------------------

    def _walk(self, prompt: bytes) -> tuple[tuple[Lineage, int] | None, int | None]:
        """The deepest lineage the prompt extends, with where its glue starts (bytes), and the
        lineage it follows longest (`store.prefixes`)."""
        for lineage in self._dirty:  # indexed when first needed: a session of one conversation
            self.index.update(lineage.index, lineage.state, lineage.digests, lineage.eot)
        self._dirty.clear()
        heads, follows = self.index.walk(prompt, 0, new_hasher())
        found: tuple[Lineage, int] | None = None
        for index, glue_at in heads:
            if found is None or glue_at > found[1]:
                found = (self.forest.lineages[index], glue_at)
        return found, follows

    # -- turns -------------------------------------------------------------------------------

    def _place(self, index: int, turn: TurnRecord) -> None:
        lineage, glue_at = self._by_reference(turn)
        if lineage is not None:
            self._join(lineage, index, _packed(turn.prompt_added), glue_at)
            return
        prompt = _packed(turn.prompt_token_ids)
        found, follows = self._walk(prompt)
        if found is not None and self._other_choice(found[0], prompt, found[1]):
            self._place(index, turn)
        elif found is not None:
            lineage, glue_at = found
            self._join(lineage, index, prompt[glue_at:], glue_at)
        elif follows is not None and self._other_choice(self.forest.lineages[follows], prompt, 0):
            self._place(index, turn)
        else:
            self._diverge_or_start(index, turn, prompt, follows)

    def _by_reference(self, turn: TurnRecord) -> tuple[Lineage | None, int]:
        """A prompt the log stores as a reference to a lineage's last turn that it extends (all
        of its tokens, or all but an end-of-turn id the template leaves out) joins that lineage,
        its glue what the turn stored: (that lineage, where the glue starts), else (None, 0).
        The proxy references the deepest turn a request continues, so this is the rule's answer
        at the cost of what the turn added."""
        prefix = turn.prompt_prefix
        lineage = None if prefix is None else self._tips.get(prefix.request_id)
        if lineage is None or lineage.tip.choice != 0:
            return None, 0
        assert prefix is not None
        n = prefix.n_tokens * _ID
        if n == len(lineage.state) or (lineage.eot and n == len(lineage.state) - _ID):
            return lineage, n
        return None, 0

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
                self._touch(lineage)
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
        if lineage.tip_request is not None and self._tips.get(lineage.tip_request) is lineage:
            del self._tips[lineage.tip_request]
        lineage.tip_request = self.session.turns[index].request_id
        self._tips[lineage.tip_request] = lineage
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
        self._completions.remember(lineage.index, completion, choice.finish_reason)

    def _touch(self, lineage: Lineage) -> None:
        """The lineage's tokens changed: it is indexed again before the next walk."""
        self._clock += 1
        lineage.touched = self._clock
        self._dirty[lineage] = None

    # -- a prompt that extends no lineage ---------------------------------------------------

    def _diverge_or_start(
        self, index: int, turn: TurnRecord, prompt: bytes, follows: int | None
    ) -> None:
        lineage = None if follows is None else self.forest.lineages[follows]
        said = self._continues_messages(turn, lineage)
        if said is not None:  # the same conversation, its tokens re-rendered or its reply edited
            owner, why = said
            at = shared_prefix(prompt, bytes(owner.state))
            self._branch(owner, index, prompt, Divergence(index, at, why))
            return
        shared = 0 if lineage is None else shared_prefix(prompt, bytes(lineage.state))
        if lineage is not None:
            reason = self._divergence(lineage, prompt, shared)
            if reason is not None:
                self._branch(lineage, index, prompt, Divergence(index, shared, reason))
                return
        # Another lineage's last completion inside the prompt: a summary of this one (compacted
        # through a summarising call), or a call over this one's history (a new lineage).
        if lineage is not None and shared >= MIN_SHARED and self._summarised(lineage, prompt):
            self._branch(lineage, index, prompt, Divergence(index, shared, "compacted"))
            return
        if lineage is not None and self._side_call_at_tip(lineage, prompt):
            self._place(index, turn)  # the lineage is back at the turn before: place it again
            return
        if lineage is not None and shared >= MIN_SHARED:
            self._new(index, prompt, lineage.index, shared)
        elif (kept := self._containing(prompt)) is not None:
            # A call over a lineage's history under a prompt of its own: it shares no prefix.
            self._new(index, prompt, kept.index, 0)
            self._summaries.setdefault(kept.index, []).append(self.forest.lineages[-1])
        else:
            self._new(index, prompt, None, None)

    def _continues_messages(
        self, turn: TurnRecord, follows: Lineage | None
    ) -> tuple[Lineage, str] | None:
        """The lineage whose last turn's messages the turn's repeat, then an assistant message
        (the messages say it is the same conversation although the tokens do not), with the
        reason: the reply as it was given (`template_not_append_only`) or edited
        (`history_rewritten`). The turn its messages reference is asked first (the proxy found
        it so), then the lineage its tokens follow longest (compared as values)."""
        prefix = turn.messages_prefix
        lineage = None if prefix is None else self._tips.get(prefix.request_id)
        added = turn.messages_added
        if lineage is not None and added and isinstance(added[0], dict):
            return self._reply_kept(lineage, added[0])
        if follows is None:
            return None
        mine = turn.messages
        theirs = self.session.turns[follows.tip.turn].messages
        if mine is None or theirs is None or len(mine) <= len(theirs):
            return None
        if mine[: len(theirs)] != theirs or not isinstance(mine[len(theirs)], dict):
            return None
        return self._reply_kept(follows, mine[len(theirs)])

    def _reply_kept(self, lineage: Lineage, sent: dict[str, Any]) -> tuple[Lineage, str] | None:
        if sent.get("role") != "assistant":
            return None
        tip = lineage.tip
        returned = self.session.turns[tip.turn].choices.get(tip.choice)
        kept = returned is not None and same_reply(sent, returned.message)
        return lineage, "template_not_append_only" if kept else "history_rewritten"

    def _divergence(self, lineage: Lineage, prompt: bytes, shared: int) -> str | None:
        if shared == len(prompt) // _ID < len(lineage.state) // _ID:
            return "history_truncated"
        if shared >= lineage.prompt_len:
            return "template_not_append_only"
        if shared >= MIN_SHARED and self._completions.contains(prompt, lineage.index, shared):
            return self._kept(lineage, prompt)
        return None

    def _summarised(self, lineage: Lineage, prompt: bytes) -> bool:
        """Whether `prompt` holds the last completion of a call made over `lineage`'s history
        (a lineage forked from it at 0 tokens: its last completion is then a summary of it)."""
        return any(
            self._completions.contains(prompt, summary.index)
            for summary in self._summaries.get(lineage.index, ())
        )

    @staticmethod
    def _kept(lineage: Lineage, prompt: bytes) -> str:
        return "compacted" if 2 * len(prompt) < len(lineage.state) else "history_rewritten"

    def _branch(self, lineage: Lineage, index: int, prompt: bytes, why: Divergence) -> None:
        lineage.branches.append(Branch([Step(index, prompt)], why))
        lineage.before = None
        self._tip(lineage, index)

    def _side_call_at_tip(self, lineage: Lineage, prompt: bytes) -> bool:
        """Rule 3's last case: when `prompt` extends the turn before the lineage's last one,
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
        self._completions.move(lineage.index, side.index)
        # The conversation is back at the turn before: it is the lineage's last again.
        self.index.rewind(lineage.digests, before.length // _ID - 1)
        lineage.state = bytearray(state_before)
        lineage.prompt_len, lineage.eot = before.prompt_len, before.eot
        lineage.before = None
        self._tip(lineage, before.turn)
        self._touch(lineage)
        return True

    def _containing(self, prompt: bytes) -> Lineage | None:
        """The most recently extended lineage whose last completion `prompt` holds."""
        found = [self.forest.lineages[owner] for owner in self._completions.containing(prompt)]
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


def assign(session: SessionRecord) -> Forest:
    """The session's lineages and where each completed turn went (the module's rule)."""
    return Assigner(session).run()
