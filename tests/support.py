"""Small things several tests need: realistic events, a session as the proxy records it, and a
bounded wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream


def chunk_event(
    session_id: str, n_tokens: int = 16, *, seed: int = 0, run_id: str = "run-1"
) -> NewEvent:
    """A completion chunk like the proxy records: token ids, logprobs and a little JSON."""
    rng = np.random.default_rng(seed)
    return NewEvent(
        EventType.COMPLETION_CHUNK,
        session_id=session_id,
        run_id=run_id,
        payload={"choice": 0, "text": "x" * 40, "engine": "http://127.0.0.1:8000"},
        token_ids=rng.integers(0, 150_000, n_tokens, dtype=np.int32),
        logprobs=-rng.random(n_tokens, dtype=np.float32) * 5,
    )


STOPPED = {"choices": [{"index": 0, "finish_reason": "stop"}]}


@dataclass
class RecordedSession:
    """Appends one session's events to a store as the proxy's recorder writes them (the contracts
    in `store.sessions`): created, turns (one request stream each), reward and finish."""

    store: EventStore
    session_id: str = "s1"
    run_id: str = "run-1"

    def event(self, kind: EventType, payload: dict[str, Any], **arrays: Any) -> NewEvent:
        """An event of this session."""
        return NewEvent(
            kind, session_id=self.session_id, run_id=self.run_id, payload=payload, **arrays
        )

    async def created(self, **payload: Any) -> None:
        """The session_created event (`payload`: task_id, group_id, ...)."""
        await self.store.append(
            session_stream(self.session_id), [self.event(EventType.SESSION_CREATED, payload)]
        )

    async def turn(
        self,
        received: dict[str, Any],
        prompt_ids: list[int],
        completion: list[int] | None,
        *,
        prompt: dict[str, Any] | None = None,
        chunk: dict[str, Any] | None = None,
        logprob: float = -0.5,
        finished: dict[str, Any] = STOPPED,
    ) -> None:
        """One model call, in its request's stream (`received["request_id"]` names it): received,
        prompt tokens, the completion as one chunk (none when `completion` is None), finished."""
        events = [
            self.event(EventType.REQUEST_RECEIVED, received),
            self.event(EventType.PROMPT_TOKENS, {"choice": None, **(prompt or {})},
                       token_ids=prompt_ids),
        ]  # fmt: skip
        if completion is not None:
            events.append(
                self.event(
                    EventType.COMPLETION_CHUNK,
                    {"choice": 0, "text": ""} if chunk is None else chunk,
                    token_ids=completion,
                    logprobs=[logprob] * len(completion),
                )
            )
        events.append(self.event(EventType.COMPLETION_FINISHED, finished))
        await self.store.append(request_stream(received["request_id"]), events)

    async def finished(self, reward: float | None = 1.0, status: str | None = "completed") -> None:
        """The reward, then session_finished with `status` (either left out when None)."""
        events = []
        if reward is not None:
            events.append(self.event(EventType.REWARD_ASSIGNED, {"value": reward}))
        if status is not None:
            events.append(self.event(EventType.SESSION_FINISHED, {"status": status}))
        if events:
            await self.store.append(session_stream(self.session_id), events)


async def eventually(
    condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.02
) -> None:
    """Wait until `condition()` holds; fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        await asyncio.sleep(interval)
