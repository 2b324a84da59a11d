"""Training samples from a recorded session, token-exact: no text is ever re-tokenised.

A sample is one token sequence with a loss mask and the behaviour logprobs of its generated
tokens. Turns are taken in order; turn k+1 *extends* the current sample when its prompt token ids
start with everything the sample holds so far (prompt, completions, and the glue in between).
The new tokens between the two (tool results, user messages, template glue) get loss mask 0;
turn k+1's completion gets mask 1 and its logprobs.

When the engine ended turn k with an end-of-turn token that the next prompt does not repeat
(a template that re-renders the assistant turn without it), the sample keeps the generated token
(the model did produce it and should learn to) and the extension continues after it.

Otherwise the history diverged (truncated, rewritten, or re-rendered by a template that is not
append-only): the current sample ends and a new branch starts at that turn, and the divergence is
recorded (turn, first differing position, reason).

Deliberate choices, each tested:
- failed or aborted requests are left out (the agent did not continue from them); their
  partial tokens stay in the log;
- with `n > 1`, the choice the next turn continues from stays in the sample; the other choices of
  that turn become one-turn samples of their own (`alternative_of` names the turn);
- an empty completion extends the sample by nothing; a completion cut by `length` is kept as is;
- every branch of a session carries the session's reward (the episode's outcome) and says
  whether it is the final branch (`is_final`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from store.sessions import ChoiceRecord, SessionRecord, TurnRecord

#: Changes whenever the rules above change; samples record it, and a rebuild writes a new one.
PROJECTION_VERSION = 1

_SAMPLE_NAMESPACE = uuid.UUID("6f6b3c0e-4c1c-4f0e-9a55-7a0b1d3c2e11")


@dataclass
class Divergence:
    """Where and why a session's history stopped extending the previous sample."""

    turn: int  #: index of the turn whose prompt did not extend the sample
    position: int  #: first token position where the prompt and the sample differ
    reason: str  #: history_truncated | history_rewritten | template_not_append_only

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view."""
        return {"turn": self.turn, "position": self.position, "reason": self.reason}


@dataclass
class Sample:
    """One training sequence, as the trainer eats it."""

    sample_id: uuid.UUID
    session: SessionRecord
    branch: int
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 where the mask is 0
    prompt_len: int = 0
    turns: list[int] = field(default_factory=list)  # indices into session.turns
    tool_turns: int = 0
    policy_versions: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    divergence: Divergence | None = None  # why this branch started (None for the first)
    alternative_of: int | None = None  # for an n>1 choice not continued: its turn
    is_final: bool = False

    @property
    def response_len(self) -> int:
        """Tokens the model generated in this sample (loss mask 1)."""
        return sum(self.loss_mask)

    def _add_turn(self, index: int, turn: TurnRecord, choice: ChoiceRecord) -> None:
        self.turns.append(index)
        self.token_ids.extend(choice.token_ids)
        self.loss_mask.extend([1] * len(choice.token_ids))
        logprobs = choice.logprobs if len(choice.logprobs) == len(choice.token_ids) else []
        self.logprobs.extend(logprobs or [float("nan")] * len(choice.token_ids))
        self.finish_reason = choice.finish_reason
        if choice.message and choice.message.get("tool_calls"):
            self.tool_turns += 1  # the model called a tool (as `turns.n_tool_calls` counts)
        for value, seen in (
            (turn.policy_version, self.policy_versions),
            (turn.engine, self.engines),
        ):
            if value is not None and value not in seen:
                seen.append(value)

    def _add_glue(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)
        self.loss_mask.extend([0] * len(tokens))
        self.logprobs.extend([0.0] * len(tokens))


def sample_id(session_id: str, branch: int, alternative: str = "") -> uuid.UUID:
    """Deterministic: the same session and branch always give the same id."""
    name = f"{PROJECTION_VERSION}/{session_id}/{branch}/{alternative}"
    return uuid.uuid5(_SAMPLE_NAMESPACE, name)


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _divergence_reason(sample: Sample, prompt: list[int], position: int, last: list[int]) -> str:
    if position == len(prompt) < len(sample.token_ids):
        return "history_truncated"  # the prompt is a strict prefix: the context was cut
    if position >= len(sample.token_ids) - len(last):
        return "template_not_append_only"  # the last completion came back re-rendered
    return "history_rewritten"


def _continued_choice(turn: TurnRecord, next_prompt: list[int] | None, base: list[int]) -> int:
    """The choice of an n>1 turn that the next turn's prompt continues (default: 0)."""
    if next_prompt is None or len(turn.choices) < 2:
        return min(turn.choices) if turn.choices else 0
    for index in sorted(turn.choices):
        candidate = base + turn.choices[index].token_ids
        if next_prompt[: len(candidate)] == candidate:
            return index
    return min(turn.choices)


def build_samples(session: SessionRecord) -> list[Sample]:
    """The samples of one session, by the rules in this module's docstring."""
    usable = [(i, t) for i, t in enumerate(session.turns) if t.status == "completed" and t.choices]
    samples: list[Sample] = []
    current: Sample | None = None
    last_completion: list[int] = []
    for position_in_list, (index, turn) in enumerate(usable):
        prompt = turn.prompt_token_ids
        next_prompt = (
            usable[position_in_list + 1][1].prompt_token_ids
            if position_in_list + 1 < len(usable)
            else None
        )
        chosen = _continued_choice(turn, next_prompt, prompt)
        choice = turn.choices[chosen]

        glue: list[int] | None = None
        if current is not None:
            held = current.token_ids
            if prompt[: len(held)] == held:
                glue = prompt[len(held) :]
            elif (
                last_completion
                and current.finish_reason == "stop"
                and prompt[: len(held) - 1] == held[:-1]
            ):
                glue = prompt[len(held) - 1 :]  # the end-of-turn token was not repeated
        if current is None or glue is None:
            divergence = None
            if current is not None:
                at = _first_difference(prompt, current.token_ids)
                reason = _divergence_reason(current, prompt, at, last_completion)
                divergence = Divergence(index, at, reason)
            branch = len([s for s in samples if s.alternative_of is None])
            current = Sample(sample_id(session.session_id, branch), session, branch)
            current.divergence = divergence
            current._add_glue(prompt)
            current.prompt_len = len(prompt)
            samples.append(current)
        else:
            current._add_glue(glue)
        current._add_turn(index, turn, choice)
        last_completion = choice.token_ids

        for other in sorted(set(turn.choices) - {chosen}):
            alternative = Sample(
                sample_id(session.session_id, current.branch, f"{index}.{other}"),
                session,
                current.branch,
                alternative_of=index,
            )
            alternative._add_glue(prompt)
            alternative.prompt_len = len(prompt)
            alternative._add_turn(index, turn, turn.choices[other])
            samples.append(alternative)

    branches = [s for s in samples if s.alternative_of is None]
    if branches:
        branches[-1].is_final = True
    return samples
