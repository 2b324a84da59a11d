"""Training samples from a recorded session, token-exact: no text is ever re-tokenised.

A sample is one token sequence with a loss mask and the behaviour logprobs of its generated
tokens. A session holds one or more conversations, its *lineages* (`store.lineages`: which
turn extends which, from the tokens alone); each lineage gives one sample per branch. Within a
branch, turn k+1 extends turn k: its prompt starts with everything the sample holds so far
(prompt, completions, and the glue in between). The new tokens between the two (tool results,
user messages, template glue) get loss mask 0; turn k+1's completion gets mask 1 and its
logprobs.

When the engine ended turn k with an end-of-turn token that the next prompt does not repeat
(a template that re-renders the assistant turn without it), the sample keeps the generated token
(the model did produce it and should learn to) and the extension continues after it.

A lineage's history may diverge (truncated, rewritten, re-rendered by a template that is not
append-only, or compacted): a new branch starts at that turn, and the divergence is recorded
(turn, first differing position, reason). Another conversation speaking in between is never a
divergence: it is another lineage.

Deliberate choices, each tested:
- failed or aborted requests are left out (the agent did not continue from them); their
  partial tokens stay in the log;
- with `n > 1`, the choice the lineage's next turn continues from stays in the sample; the other
  choices of that turn become one-turn samples of their own (`alternative_of` names the turn);
- an empty completion extends the sample by nothing; a completion cut by `length` is kept as is;
- a turn whose decoding was constrained (a forced tool call, a JSON format, guided decoding)
  keeps its tokens (mask 1) but gets NaN behaviour logprobs: the engine reported the logprobs
  of the grammar-masked distribution, not the model's (see `TurnRecord.constrained_by`); the
  trainer leaves tokens without behaviour logprobs out of the importance-weighted loss;
- every sample of a session carries the session's reward (the episode's outcome), its lineage,
  the lineage's role (main, subagent, side) and the lineage it forked from;
- `is_final` marks the trainer's default sample: the last branch of the main lineage;
- a sample's images are those of its last turn's messages, in order, each with its hash, where
  it came from (data or URL) and the [start, end) of its placeholder ids in the sample's tokens
  (`store.images.image_spans`); the span is None, and `reason` says why, when the engine's
  placeholder id was not recorded, its runs do not match the images one for one, or the same
  image has runs of different lengths (a trainer checks the lengths against its processor:
  `trainer.vision`).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.store.images import sample_images
from trajstore.store.lineages import Divergence, Lineage, assign
from trajstore.store.payloads import ArraySpec, VersionSpan
from trajstore.store.records import ChoiceRecord, SessionRecord, TurnRecord
from trajstore.store.side_data import absent, unpack
from trajstore.store.tokens import (
    LOGPROB_DTYPE,
    TOKEN_DTYPE,
    decode_logprobs,
    decode_token_ids,
    encode_logprobs,
    encode_token_ids,
)

__all__ = ["Divergence", "Sample", "build_samples", "final_branch", "rollout_rows", "sample_id"]

#: Changes whenever the rules above change; samples record it, and a rebuild writes a new one.
PROJECTION_VERSION = 2

_SAMPLE_NAMESPACE = uuid.UUID("6f6b3c0e-4c1c-4f0e-9a55-7a0b1d3c2e11")


def _packed_ids(values: Any) -> bytes:
    """Token ids as stored (little-endian int32 bytes): as they are when already packed."""
    return values if isinstance(values, bytes) else encode_token_ids(values)


def _packed_logprobs(values: Any) -> bytes:
    """Logprobs as stored (little-endian float32 bytes): as they are when already packed."""
    return values if isinstance(values, bytes) else encode_logprobs(values)


#: One float32 NaN, little-endian: the behaviour logprob of a token that has none.
_NAN = np.array([np.nan], dtype=LOGPROB_DTYPE).tobytes()
_ID = TOKEN_DTYPE.itemsize  # bytes per token id


@dataclass
class Sample:
    """One training sequence, as the trainer eats it.

    Tokens are kept packed, as the log stores them (little-endian int32 bytes), with one run per
    prompt, glue or completion for the mask and the logprobs: a sample is assembled, compared
    and written with byte operations, never a Python object per token. `token_bytes` and
    friends are what the projector writes, `token_array()` and friends numpy views of them, and
    `token_ids` and friends lists for people.
    """

    sample_id: uuid.UUID
    session: SessionRecord
    branch: int  #: within its lineage
    lineage: int = 0  #: which conversation of the session (`store.lineages`)
    role: str = "main"  #: its lineage's role: main | subagent | side
    parent: int | None = None  #: the lineage its lineage forked from
    fork_at: int | None = None  #: tokens its lineage shares with that one
    prompt_len: int = 0
    turns: list[int] = field(default_factory=list)  # indices into session.turns
    tool_turns: int = 0
    policy_versions: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    divergence: Divergence | None = None  # why this branch started (None for the first)
    alternative_of: int | None = None  # for an n>1 choice not continued: its turn
    is_final: bool = False  #: the trainer's default: the main lineage's last branch
    token_bytes: bytes = b""  #: all token ids, packed
    # One run per segment: its length in tokens, and its packed logprobs when the model
    # generated it (None for prompt and glue).
    _runs: list[tuple[int, bytes | None]] = field(default_factory=list, repr=False)
    response_len: int = 0  #: tokens the model generated in this sample (loss mask 1)
    #: Its images, in order: {sha256, source, url, media_type, start, end, reason} (the module).
    images: list[dict[str, Any]] = field(default_factory=list)
    #: Which policy version generated which of its tokens: [{version, start, end}] over
    #: `token_ids`, the generated tokens only, in order (a turn cut by a weight switch adds two
    #: or more; a turn recorded before spans existed one, its request's `policy_version`).
    version_spans: list[dict[str, Any]] = field(default_factory=list)
    _choices: list[int] = field(default_factory=list, repr=False)  # each turn's choice

    @property
    def n_tokens(self) -> int:
        """How many tokens the sample holds."""
        return len(self.token_bytes) // _ID

    def mask_bytes(self) -> bytes:
        """The loss mask, one byte per token: 1 where the model generated the token."""
        return b"".join((b"\x00" if lp is None else b"\x01") * n for n, lp in self._runs)

    def logprob_bytes(self) -> bytes:
        """Behaviour logprobs, packed float32: 0.0 where the mask is 0, NaN where the engine
        gave none."""
        return b"".join(bytes(4 * n) if lp is None else lp for n, lp in self._runs)

    def token_array(self) -> np.ndarray[Any, np.dtype[np.int32]]:
        """All token ids, int32 (a read-only view)."""
        return decode_token_ids(self.token_bytes)  # type: ignore[return-value]

    def mask_array(self) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The loss mask, uint8 (a read-only view)."""
        return np.frombuffer(self.mask_bytes(), dtype=np.uint8)

    def logprob_array(self) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Behaviour logprobs, float32 (a read-only view)."""
        return decode_logprobs(self.logprob_bytes())  # type: ignore[return-value]

    @property
    def token_ids(self) -> list[int]:
        """All token ids."""
        return self.token_array().tolist()  # type: ignore[no-any-return]

    @property
    def loss_mask(self) -> list[int]:
        """1 where the model generated the token, 0 elsewhere."""
        return list(self.mask_bytes())

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprobs (0.0 where the mask is 0)."""
        return self.logprob_array().astype(np.float64).tolist()  # type: ignore[no-any-return]

    def as_json(self) -> dict[str, Any]:
        """A JSON-able view: what the export writes of it, without the session it came from."""
        return {
            "sample_id": str(self.sample_id),
            "session_id": self.session.session_id,
            "lineage": self.lineage,
            "role": self.role,
            "parent": self.parent,
            "fork_at": self.fork_at,
            "branch": self.branch,
            "alternative_of": self.alternative_of,
            "is_final": self.is_final,
            "turns": self.turns,
            "prompt_len": self.prompt_len,
            "response_len": self.response_len,
            "finish_reason": self.finish_reason,
            "divergence": None if self.divergence is None else self.divergence.as_json(),
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
        }

    def turn_offsets(self) -> list[tuple[int, int, int, int]]:
        """Each of its turns with where its parts sit, in tokens: (turn, glue start, completion
        start, completion end). From the runs it was built with, so a reader of a long session
        never makes a turn's prompt whole to find them."""
        offsets = []
        at = 0
        runs = iter(self._runs)
        for turn, (glue, _), (completion, _) in zip(self.turns, runs, runs, strict=True):
            offsets.append((turn, at, at + glue, at + glue + completion))
            at += glue + completion
        return offsets

    def side_arrays(self) -> dict[tuple[str, str, str], np.ndarray[Any, Any]]:
        """Its turns' side data (`store.side_data`: routed experts) aligned with its tokens:
        (kind, source, name) -> an array whose first axis is the sample's tokens, `absent`
        where no turn gave a value. A turn's arrays index its own prompt + completion; each
        fills only the positions that turn added to the sample (its glue and completion)."""
        full: dict[tuple[str, str, str], np.ndarray[Any, Any]] = {}
        n = self.n_tokens
        for (index, glue, start, end), choice in zip(
            self.turn_offsets(), self._choices, strict=True
        ):
            turn = self.session.turns[index]
            if not turn.side_data or turn.n_prompt_tokens is None:
                continue
            shift = start - turn.n_prompt_tokens  # sample position of the turn's position 0
            for side, data in turn.side_data:
                if side.choice != choice:
                    continue
                for name, values in unpack(side.arrays, data).items():
                    key = (side.kind, side.source or "", name)
                    if key not in full:
                        fill = absent(values.dtype)
                        full[key] = np.full((n, *values.shape[1:]), fill, values.dtype)
                    target = full[key]
                    if target.shape[1:] != values.shape[1:]:
                        continue  # another layout within one sample: never a guessed row
                    lo = max(glue, side.start + shift)
                    hi = min(end, side.start + shift + len(values))
                    if hi > lo:
                        first = lo - shift - side.start
                        target[lo:hi] = values[first : first + hi - lo]
        return full

    def side_columns(self) -> tuple[list[dict[str, Any]] | None, bytes | None]:
        """`samples.side` and `samples.side_data`: the specs of `side_arrays()` (with kind and
        source) and their packed bytes; (None, None) without side data."""
        arrays = self.side_arrays()
        if not arrays:
            return None, None
        specs, chunks, offset = [], [], 0
        for (kind, source, name), values in arrays.items():
            data = values.astype(values.dtype.newbyteorder("<"), copy=False).tobytes()
            spec = ArraySpec(
                name=name, dtype=values.dtype.name, shape=list(values.shape),
                offset=offset, nbytes=len(data),
            )  # fmt: skip
            specs.append({"kind": kind, "source": source or None, **spec.model_dump()})
            chunks.append(data)
            offset += len(data)
        return specs, b"".join(chunks)

    def _add_turn(self, index: int, turn: TurnRecord, choice: ChoiceRecord) -> None:
        self.turns.append(index)
        self._choices.append(choice.index)
        ids = _packed_ids(choice.token_ids)
        logprobs = _packed_logprobs(choice.logprobs)
        n = len(ids) // _ID
        if len(logprobs) != len(ids) or turn.constrained_by is not None:
            # None given, or those of a grammar-masked distribution (see
            # TurnRecord.constrained_by): no behaviour logprobs. The tokens stay, mask 1.
            logprobs = _NAN * n
        at = self.n_tokens
        self.token_bytes += ids
        self._runs.append((n, logprobs))
        self.response_len += n
        self.finish_reason = choice.finish_reason
        if choice.message and choice.message.get("tool_calls"):
            self.tool_turns += 1  # the model called a tool (as `turns.n_tool_calls` counts)
        spans = choice.version_spans
        if spans is None and turn.policy_version is not None:
            spans = [VersionSpan(version=turn.policy_version, start=0, end=n)]
        for span in spans or ():
            self._add_span(span.version, at + span.start, at + span.end)
        if turn.engine is not None and turn.engine not in self.engines:
            self.engines.append(turn.engine)

    def _add_span(self, version: str, start: int, end: int) -> None:
        if end <= start:
            return
        if version not in self.policy_versions:
            self.policy_versions.append(version)
        last = self.version_spans[-1] if self.version_spans else None
        if last is not None and last["version"] == version and last["end"] == start:
            last["end"] = end  # the next turn goes on with the same version: one span
        else:
            self.version_spans.append({"version": version, "start": start, "end": end})

    def version_array(self) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Each token's policy version as an integer, aligned with `token_ids`: -1 for tokens
        not generated (prompt, glue) and for versions that are not integers."""
        return token_versions(self.n_tokens, self.version_spans)

    def _add_glue(self, tokens: bytes) -> None:
        self.token_bytes += tokens
        self._runs.append((len(tokens) // _ID, None))


def token_versions(
    n_tokens: int, spans: list[dict[str, Any]] | None
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """Per-token integer policy versions (int64, -1 where none) of a sample of `n_tokens`
    tokens from its `version_spans`."""
    out = np.full(n_tokens, -1, dtype=np.int64)
    for span in spans or ():
        try:
            version = int(span["version"])
        except (TypeError, ValueError):
            continue
        out[int(span["start"]) : int(span["end"])] = version
    return out


def sample_id(session_id: str, lineage: int, branch: int, alternative: str = "") -> uuid.UUID:
    """Deterministic: the same session, lineage and branch always give the same id."""
    name = f"{PROJECTION_VERSION}/{session_id}/{lineage}/{branch}/{alternative}"
    return uuid.uuid5(_SAMPLE_NAMESPACE, name)


def build_samples(session: SessionRecord) -> list[Sample]:
    """The samples of one session, by the rules in this module's docstring."""
    forest = assign(session)
    samples: list[Sample] = []
    for lineage in forest.lineages:
        for number, branch in enumerate(lineage.branches):
            sample = _sample(session, lineage, number)
            sample.divergence = branch.divergence
            sample.prompt_len = len(branch.steps[0].glue) // _ID
            for step in branch.steps:
                turn = session.turns[step.turn]
                sample._add_glue(step.glue)
                sample._add_turn(step.turn, turn, turn.choices[step.choice])
                samples.extend(_alternatives(sample, lineage, step.turn, turn, step.choice))
            samples.append(sample)
            sample.is_final = lineage.index == forest.main and number == len(lineage.branches) - 1
    for sample in samples:
        sample.token_bytes = bytes(sample.token_bytes)
        turn = session.turns[sample.turns[-1]]
        if turn.n_images:
            sample.images = sample_images(
                sample.token_array(),
                sample.mask_array().astype(bool),
                turn.image_token_id,
                turn.image_hashes,
                session.images,
            )
    return samples


def _sample(session: SessionRecord, lineage: Lineage, branch: int, alternative: str = "") -> Sample:
    sample = Sample(
        sample_id(session.session_id, lineage.index, branch, alternative),
        session,
        branch,
        lineage=lineage.index,
        role=lineage.role,
        parent=lineage.parent,
        fork_at=lineage.fork_at,
    )
    # Grown in place while it is built (linear in its tokens, however many turns), then bytes.
    sample.token_bytes = bytearray()  # type: ignore[assignment]
    return sample


def _alternatives(
    sample: Sample, lineage: Lineage, index: int, turn: TurnRecord, chosen: int
) -> list[Sample]:
    """The choices of an n > 1 turn that the lineage did not continue, a sample each."""
    others = sorted(set(turn.choices) - {chosen})
    if not others:
        return []
    prompt = _packed_ids(turn.prompt_token_ids)
    samples = []
    for other in others:
        alternative = _sample(sample.session, lineage, sample.branch, f"{index}.{other}")
        alternative.alternative_of = index
        alternative._add_glue(prompt)
        alternative.prompt_len = len(prompt) // _ID
        alternative._add_turn(index, turn, turn.choices[other])
        samples.append(alternative)
    return samples


def final_branch(samples: Sequence[Sample]) -> Sample | None:
    """The session's default sample (`is_final`: the main lineage's last branch, which holds
    the episode's outcome), or None when the session made no sample: what a trainer that takes
    one sequence per episode trains on (`trajstore.rollout.trl_rollout`,
    `trajstore.rollout.verl_loop`)."""
    return next((s for s in samples if s.is_final), None)


def rollout_rows(samples: Sequence[Sample]) -> list[Sample]:
    """Every lineage's last branch (alternatives of n > 1 turns left out), main lineage first:
    what a trainer takes when all lineages of a rollout make one group member (one advantage,
    several rows)."""
    last: dict[int, Sample] = {}
    for sample in samples:
        if sample.alternative_of is None:
            last[sample.lineage] = sample  # branches come in order
    return sorted(last.values(), key=lambda s: (s.role != "main", s.lineage))
