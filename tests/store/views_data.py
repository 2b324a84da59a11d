"""A small, hand-checkable set of sessions for the SQL views and the README's queries.

Written through `EventStore` with the payloads the proxy's recorder writes (store/sessions.py).
Turns read: prompt -> completion, finish reason, engine, policy version, time to first token.

    s1  run r1, task A, completed, reward 1.0
        [1,10] -> [20,2] stop e1 1 0.1 (calls a tool)
        [1,10,20,2,30] -> [40,2] stop e1 1 0.2
    s2  run r1, task A, completed, reward 0.0 then corrected to 0.5
        [1,11] -> [21,22] length e2 2 0.5
    s3  run r1, task B, completed, reward 1.0
        [1,100..119,12] -> [23,50..59,2] stop e2 2 0.4
        [1,100..119,99,23,50..59,2,31] -> [41,2] stop e2 2 0.6 (the history was rewritten: a
        message edited after the 20-token system prompt, the reply kept; store.lineages)
    s4  run r1, task B, timeout, no reward
        [1,13] -> [24,2] stop e1 1 0.3
        a request that failed
    s5  run r2, task A, completed, reward 1.0, then discarded
        [1,14] -> [25,2] stop e1 3 0.1
    s6  run r2, task B, still active
        [1,15] -> [26,2] stop e1 3 0.1
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream

REPLY = list(range(50, 60))  # s3's first reply: long enough to be recognised when kept
SYSTEM = list(range(100, 120))  # s3's system prompt: the rewrite shares it
TOOL_CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
}


@dataclass
class Turn:
    prompt: list[int]
    completion: list[int]
    finish: str = "stop"
    engine: str = "e1"
    policy: str = "1"
    ttft: float = 0.1
    tool_call: bool = False
    failed: bool = False


async def record(
    store: EventStore,
    session_id: str,
    run_id: str,
    task_id: str,
    turns: list[Turn],
    *,
    rewards: tuple[float, ...] = (),
    status: str | None = "completed",
    discard: bool = False,
) -> None:
    def event(kind: EventType, payload: dict[str, Any], **arrays: Any) -> NewEvent:
        return NewEvent(kind, session_id=session_id, run_id=run_id, payload=payload, **arrays)

    created = {"task_id": task_id, "group_id": f"{run_id}-{task_id}", "metadata": {"tags": []}}
    await store.append(session_stream(session_id), [event(EventType.SESSION_CREATED, created)])
    for n, turn in enumerate(turns):
        request_id = f"{session_id}-{n}"
        body = {
            "model": "tiny",
            "messages": [{"role": "user", "content": f"question {n}"}],
            "tools": [{"type": "function", "function": {"name": "add"}}],
        }
        received = {
            "request_id": request_id, "api": "chat", "body": body, "sampling": {},
            "engine": turn.engine, "policy_version": turn.policy, "stream": False,
        }  # fmt: skip
        events = [
            event(EventType.REQUEST_RECEIVED, received),
            event(EventType.PROMPT_TOKENS, {"choice": None}, token_ids=turn.prompt),
        ]
        if turn.failed:
            failure = {"reason": "engine_error", "status": 500, "message": "boom", "latency_s": 1}
            events.append(event(EventType.REQUEST_FAILED, failure))
        else:
            message: dict[str, Any] = {"role": "assistant", "content": f"answer {n}"}
            if turn.tool_call:
                message = {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
            finished = {
                "choices": [{"index": 0, "finish_reason": turn.finish, "message": message}],
                "latency_s": turn.ttft * 2,
                "ttft_s": turn.ttft,
            }
            events += [
                event(
                    EventType.COMPLETION_CHUNK,
                    {"choice": 0, "text": f"answer {n}"},
                    token_ids=turn.completion,
                    logprobs=[-0.5] * len(turn.completion),
                ),
                event(EventType.COMPLETION_FINISHED, finished),
            ]
        await store.append(request_stream(request_id), events)
    for value in rewards:
        await store.append(
            session_stream(session_id), [event(EventType.REWARD_ASSIGNED, {"value": value})]
        )
    if status is not None:
        await store.append(
            session_stream(session_id), [event(EventType.SESSION_FINISHED, {"status": status})]
        )
    if discard:
        discarded = event(EventType.SESSION_DISCARDED, {"reason": "leaked the answer"})
        await store.append(session_stream(session_id), [discarded])


async def record_all(store: EventStore) -> None:
    """The six sessions of the table above."""
    await record(
        store, "s1", "r1", "A",
        [Turn([1, 10], [20, 2], tool_call=True), Turn([1, 10, 20, 2, 30], [40, 2], ttft=0.2)],
        rewards=(1.0,),
    )  # fmt: skip
    await record(
        store, "s2", "r1", "A",
        [Turn([1, 11], [21, 22], finish="length", engine="e2", policy="2", ttft=0.5)],
        rewards=(0.0, 0.5),
    )  # fmt: skip
    await record(
        store, "s3", "r1", "B",
        [
            Turn([1, *SYSTEM, 12], [23, *REPLY, 2], engine="e2", policy="2", ttft=0.4),
            Turn([1, *SYSTEM, 99, 23, *REPLY, 2, 31], [41, 2], engine="e2", policy="2", ttft=0.6),
        ],
        rewards=(1.0,),
    )  # fmt: skip
    await record(
        store, "s4", "r1", "B",
        [Turn([1, 13], [24, 2], ttft=0.3), Turn([1, 13, 24, 2, 32], [], failed=True)],
        status="timeout",
    )  # fmt: skip
    await record(
        store, "s5", "r2", "A", [Turn([1, 14], [25, 2], policy="3")], rewards=(1.0,), discard=True
    )
    await record(store, "s6", "r2", "B", [Turn([1, 15], [26, 2], policy="3")], status=None)
