"""A long agent session written straight to the log, shaped like opencode's (issue 35).

Each turn re-sends the conversation so far plus the last tool call's output, and the recorder
stores it as the proxy does: `messages_prefix` and a prompt `prefix` referencing the turn before
(the contracts in `store.sessions`), so the log holds what each turn added and a reader that
makes every turn whole, or follows references by recursion, is caught by the session's length.
Every `side_every`-th call is a one-off side call (a title or a check) with a prompt of its own:
another lineage, as real harnesses make them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream

SYSTEM = 1_000  #: tokens of the system prompt and tools
COMPLETION = 6  #: tokens of each tool call the model makes
_TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {}}}]


@dataclass
class LongSession:
    """What `record_long_session` wrote: enough to check a reader against."""

    session_id: str
    n_turns: int  #: model calls
    main_turns: int = 0  #: those of the main loop
    prompt_tokens: list[int] = field(default_factory=list)  #: each call's whole prompt length
    completion_tokens: int = 0


@dataclass
class _Head:
    """The main loop's last turn: what the next one references."""

    request_id: str
    n_tokens: int  #: its prompt + completion
    n_messages: int  #: its whole messages


def tool_output(turn: int) -> int:
    """Tokens of the tool output the agent sends back after turn `turn`: it grows, as file reads
    and test logs do over a coding session."""
    return 8 + (turn % 7) * 3 + turn // 500


class _Writer:
    def __init__(self, session_id: str, run_id: str) -> None:
        self.session_id, self.run_id = session_id, run_id
        self.streams: list[tuple[str, list[NewEvent]]] = []
        self.rng = np.random.default_rng(7)

    def event(self, kind: EventType, payload: dict[str, Any], **arrays: Any) -> NewEvent:
        return NewEvent(
            kind, session_id=self.session_id, run_id=self.run_id, payload=payload, **arrays
        )

    def ids(self, n: int, low: int = 0) -> Any:
        return self.rng.integers(low, low + 50_000, n, dtype=np.int32)

    def turn(
        self, received: dict[str, Any], prompt: Any, payload: dict[str, Any], reply: Any
    ) -> None:
        completion = self.ids(COMPLETION)
        finished = {"index": 0, "finish_reason": "tool_calls", "message": reply}
        self.streams.append((request_stream(received["request_id"]), [
            self.event(EventType.REQUEST_RECEIVED, received),
            self.event(EventType.PROMPT_TOKENS, {"choice": None, **payload}, token_ids=prompt),
            self.event(EventType.COMPLETION_CHUNK, {"choice": 0, "text": ""}, token_ids=completion,
                       logprobs=np.full(COMPLETION, -0.25, np.float32)),
            self.event(EventType.COMPLETION_FINISHED, {"choices": [finished], "latency_s": 0.01}),
        ]))  # fmt: skip


async def record_long_session(
    store: EventStore,
    n_turns: int,
    *,
    session_id: str = "long",
    run_id: str = "run-long",
    side_every: int = 50,
) -> LongSession:
    """Append a finished session of `n_turns` model calls; return what was written."""
    written = LongSession(session_id, n_turns)
    out = _Writer(session_id, run_id)
    out.streams.append((session_stream(session_id), [out.event(EventType.SESSION_CREATED, {})]))
    head: _Head | None = None
    for n in range(n_turns):
        request_id = f"{session_id}-r{n}"
        received: dict[str, Any] = {"request_id": request_id, "api": "chat", "received_at": n}
        call = {"id": f"c{n}", "type": "function", "function": {"name": "read", "arguments": "{}"}}
        reply = {"role": "assistant", "content": None, "tool_calls": [call]}
        if n % side_every == side_every - 1:
            # A title call: its own short prompt and a plain answer (another lineage).
            received["body"] = {"messages": [{"role": "user", "content": f"Title {n}"}]}
            out.turn(received, out.ids(40, 50_000), {}, {"role": "assistant", "content": "t"})
            written.prompt_tokens.append(40)
        elif head is None:
            messages = [
                {"role": "system", "content": "You are opencode. " * 40},
                {"role": "user", "content": "Fix the failing test."},
            ]
            received["body"] = {"messages": messages, "tools": _TOOLS}
            out.turn(received, out.ids(SYSTEM), {}, reply)
            head = _Head(request_id, SYSTEM + COMPLETION, len(messages))
            written.prompt_tokens.append(SYSTEM)
        else:
            output = tool_output(n)
            messages = [
                {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{n - 1}"}]},
                {"role": "tool", "tool_call_id": f"c{n - 1}", "content": "line\n" * output},
            ]
            received["body"] = {"messages": messages, "tools": _TOOLS}
            received["messages_prefix"] = {"request_id": head.request_id,
                                           "n_messages": head.n_messages}  # fmt: skip
            length = head.n_tokens + output
            prefix = {"request_id": head.request_id, "n_tokens": head.n_tokens}
            out.turn(received, out.ids(output), {"prefix": prefix, "n_tokens": length}, reply)
            head = _Head(request_id, length + COMPLETION, head.n_messages + len(messages))
            written.prompt_tokens.append(length)
        written.main_turns += n % side_every != side_every - 1
        written.completion_tokens += COMPLETION
    out.streams.append((session_stream(session_id), [
        out.event(EventType.REWARD_ASSIGNED, {"value": 1.0}),
        out.event(EventType.SESSION_FINISHED, {"status": "completed"}),
    ]))  # fmt: skip
    await _write(store, out.streams)
    return written


async def _write(store: EventStore, streams: list[tuple[str, list[NewEvent]]]) -> None:
    """Through the batched writer (COPY): thousands of streams in a few transactions."""
    versions: dict[str, int] = {}
    async with store.writer(max_pending=1_000_000) as writer:
        for stream, events in streams:
            first = versions.get(stream, 0) + 1
            writer.append_many(stream, first, events)
            versions[stream] = first + len(events) - 1
        await writer.flush()
