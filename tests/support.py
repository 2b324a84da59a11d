"""Small things several tests need: realistic events and a bounded wait."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from trajstore.store import EventType, NewEvent


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
