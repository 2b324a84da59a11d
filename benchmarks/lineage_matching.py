"""What finding a session's lineages costs the projection, against the rule before lineages
(every turn against the session's previous one), in one run, in memory.

Used by benchmarks/projection.py. Sessions are built as the proxy records them (each prompt
stored as a reference to the turn it continues plus the new tokens, `store.references`), then
their samples built, CPU only (no database): with `store.samples.build_samples` (lineages), and
with the rule before it (kept here as the baseline: each turn joins the running sample when its
prompt extends it, else a new branch). The old rule read whole prompts (its rebuild made every
prompt whole), so its side makes each turn's prompt whole first, as it did. Three shapes:

- single line: agent episodes of 16 turns (a 4,096-token first prompt, 256-token completions,
  1,024-token tool results), one conversation each: target lineages <= 1.1x the old rule;
- forest: 8 conversations interleaved over 200 turns (the shape of a harness with sub-agents),
  half of them repeating the main loop's system prompt;
- one-call: 2,000 unrelated calls through one session (an agent using it as a plain endpoint),
  each repeating a 2,048-token system prompt.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from trajstore.store.payloads_request import PromptPrefix
from trajstore.store.payloads_session import RewardAssigned
from trajstore.store.records import ChoiceRecord, SessionRecord, TurnRecord
from trajstore.store.samples import Sample, build_samples
from trajstore.store.tokens import encode_token_ids, shared_prefix

EOS = 2
_ID = 4


class _Session:
    """A session built as the proxy records it."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.record = SessionRecord(f"s{seed}", run_id="bench", status="completed", packed=True)
        self.record.rewards = [RewardAssigned(value=1.0)]
        self.states: dict[str, bytes] = {}
        self.tokens = 0

    def ids(self, n: int) -> list[int]:
        return self.rng.integers(5, 50_000, n).tolist()  # type: ignore[no-any-return]

    def call(self, prompt: bytes, completion: list[int], continues: str | None) -> str:
        request_id = f"t{len(self.record.turns)}"
        turn = TurnRecord(request_id, "chat", {}, "e", "0", None, False, {}, prompt)
        turn.status = "completed"
        ids = encode_token_ids([*completion, EOS])
        logprobs = np.full(len(ids) // _ID, -0.5, np.float32).tobytes()
        turn.choices[0] = ChoiceRecord(0, ids, logprobs, finish_reason="stop")  # type: ignore[arg-type]
        prefix = None
        if continues is not None:
            shared = shared_prefix(prompt, self.states[continues])
            if shared >= 16:
                prefix = PromptPrefix(request_id=continues, n_tokens=shared)
                turn.prompt_prefix, turn.prompt_added = prefix, prompt[_ID * shared :]
        self.record.prompts.add(request_id, turn.prompt_added, prefix)
        self.record.prompts.completed(request_id, ids)
        turn.session = self.record
        self.record.turns.append(turn)
        self.states[request_id] = prompt + ids
        self.tokens += len(prompt) // _ID + len(ids) // _ID
        return request_id

    def conversation(self, system: list[int], first: int) -> list[Any]:
        """[prompt so far, its last request] of a new conversation."""
        return [encode_token_ids([1, *system, EOS, 3, 1, *self.ids(first), EOS]), None]

    def turn(self, conversation: list[Any], completion: int, result: int) -> None:
        prompt, last = conversation
        request_id = self.call(prompt, self.ids(completion), last)
        conversation[0] = self.states[request_id] + encode_token_ids([3, 1, *self.ids(result), EOS])
        conversation[1] = request_id


def single_line(n: int) -> list[_Session]:
    sessions = []
    for seed in range(n):
        session = _Session(seed)
        talk = session.conversation(session.ids(4_000), 96)
        for _ in range(16):
            session.turn(talk, 256, 1_024)
        sessions.append(session)
    return sessions


def forest(n: int) -> list[_Session]:
    sessions = []
    for seed in range(n):
        session = _Session(seed)
        main_system = session.ids(4_000)
        talks = [
            session.conversation(main_system if k % 2 else session.ids(1_000), 64) for k in range(8)
        ]
        for step in range(200):
            session.turn(talks[step % 8 if step % 3 else 0], 128, 256)
        sessions.append(session)
    return sessions


def one_call(n: int) -> list[_Session]:
    sessions = []
    for seed in range(n):
        session = _Session(seed)
        system = session.ids(2_048)
        for _ in range(2_000):
            session.turn(session.conversation(system, 32), 16, 0)
        sessions.append(session)
    return sessions


def linear_samples(session: SessionRecord) -> list[Sample]:
    """The rule before lineages (the baseline): each turn against the session's previous one.
    Its rebuild made every prompt whole, so this does too."""
    usable = [(i, t) for i, t in enumerate(session.turns) if t.status == "completed" and t.choices]
    prompts = [bytes(t.prompt_token_ids) for _, t in usable]
    samples: list[Sample] = []
    current: Sample | None = None
    for prompt, (index, turn) in zip(prompts, usable, strict=True):
        choice = turn.choices[0]
        glue: bytes | None = None
        if current is not None:
            held = current.token_bytes
            if prompt.startswith(held):
                glue = prompt[len(held) :]
            elif current.finish_reason == "stop" and prompt.startswith(held[:-_ID]):
                glue = prompt[len(held) - _ID :]
        if current is None or glue is None:
            current = Sample(None, session, len(samples))  # type: ignore[arg-type]
            current.token_bytes = bytearray()  # type: ignore[assignment]
            current._add_glue(prompt)
            samples.append(current)
        else:
            current._add_glue(glue)
        current._add_turn(index, turn, choice)
    return samples


def _time(build: Callable[[SessionRecord], list[Sample]], sessions: list[SessionRecord]) -> float:
    started = time.process_time()
    for session in sessions:
        build(session)
    return time.process_time() - started


def report(runs: int, quick: bool) -> None:
    """Measure the three shapes, alternating which rule goes first; print medians and ratios."""
    shapes = {
        "single line (16 turns)": single_line(4 if quick else 20),
        "forest (8 lineages, 200 turns)": forest(1 if quick else 3),
        "one-call (2,000 lineages)": one_call(1),
    }
    print(f"\nlineage matching, CPU only (medians of {runs} runs): the projection's samples "
          "with lineages against the rule before them")  # fmt: skip
    print(f"{'shape':34}{'tokens':>12}{'lineages ms':>13}{'before ms':>11}{'ratio':>8}"
          f"{'samples':>9}{'before':>8}")  # fmt: skip
    print(f"{'':34}{'(prompts + completions)':>23}")
    for name, built in shapes.items():
        sessions = [b.record for b in built]
        timings: dict[str, list[float]] = {"new": [], "old": []}
        for run in range(runs):
            order = ["new", "old"] if run % 2 == 0 else ["old", "new"]
            for rule in order:
                build = build_samples if rule == "new" else linear_samples
                timings[rule].append(_time(build, sessions))
        new, old = (statistics.median(timings[r]) for r in ("new", "old"))
        tokens = sum(b.tokens for b in built)
        made = sum(len(build_samples(s)) for s in sessions)
        before = sum(len(linear_samples(s)) for s in sessions)
        print(f"{name:34}{tokens:12,d}{1e3 * new:13.1f}{1e3 * old:11.1f}{new / old:7.2f}x"
              f"{made:9d}{before:8d}")  # fmt: skip
