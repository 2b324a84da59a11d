"""Teacher scoring against an engine that fails or answers in vLLM's shape (httpx's mock
transport), on the real PostgreSQL: failures are recorded, the live mode follows new sessions.
The real engine's answers are checked in test_teacher_vllm.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from tests.support import RecordedSession
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.teacher import (
    Teacher,
    TeacherRefused,
    TeacherUnavailable,
    follow,
    read_prompt_logprobs,
    refusal_reason,
    score_run,
)

COUNT = "SELECT count(*) FROM side_data WHERE run_id = 'live'"
MODELS = {"data": [{"id": "teacher", "max_model_len": 4096}]}


def engine(completions: Callable[[dict], httpx.Response]) -> httpx.AsyncClient:
    """An HTTP client whose engine serves `MODELS` and answers completions with `completions`."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=MODELS)
        return completions(json.loads(request.content))

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


def vllm_shaped(body: dict) -> httpx.Response:
    """prompt_logprobs as vLLM gives them: logprob of token t is -t/100 (a checkable rule)."""
    choices = [
        {"index": i, "prompt_logprobs": [None] + [
            {str(token): {"logprob": -t / 100, "rank": 2}} for t, token in enumerate(p) if t
        ]}
        for i, p in enumerate(body["prompt"])
    ]  # fmt: skip
    return httpx.Response(200, json={"choices": choices})


async def record(store: EventStore, session_id: str, run_id: str = "r") -> None:
    recorded = RecordedSession(store, session_id, run_id=run_id)
    await recorded.created()
    await recorded.turn({"request_id": session_id, "body": {}}, [5, 6, 7], [8, 9, 10])
    await recorded.finished()


def test_vllm_refusals_are_told_apart() -> None:
    assert refusal_reason("Token id 3000 is out of vocabulary") == "vocabulary"
    assert refusal_reason("This model's maximum context length is 256 tokens.") == "too_long"
    assert refusal_reason("something else") == "engine"


def test_prompt_logprobs_of_other_ids_are_refused() -> None:
    entries = [None, {"6": {"logprob": -1.0, "rank": 3}, "9": {"logprob": -0.5, "rank": 1}}]
    scores = read_prompt_logprobs(entries, [5, 6], top_k=1)
    assert np.isnan(scores.logprobs[0]) and scores.logprobs[1] == -1.0
    assert scores.topk_ids is not None and scores.topk_ids[1].tolist() == [9]
    with pytest.raises(TeacherRefused, match="did not score token 7"):
        read_prompt_logprobs(entries, [5, 7], top_k=0)
    with pytest.raises(TeacherRefused, match="positions"):
        read_prompt_logprobs(entries, [5, 6, 7], top_k=0)


async def test_an_engine_that_keeps_failing_stops_the_run_with_recorded_failures(
    store: EventStore,
) -> None:
    for k in range(3):
        await record(store, f"s{k}")
    await Projector(store).run_once()
    teacher = Teacher("t", "http://teacher", "teacher", batch_size=2, concurrency=1, retry_s=0)
    broken = engine(lambda body: httpx.Response(503, text="engine overloaded"))
    with pytest.raises(TeacherUnavailable, match="503"):
        await score_run(store, teacher, http=broken)
    failures = await store.pool.fetch("SELECT reason, message FROM scoring_failures")
    assert len(failures) == 2  # the batch it failed; the next one was never sent
    assert {r["reason"] for r in failures} == {"engine"}
    assert "engine overloaded" in failures[0]["message"]
    # Nothing was scored, so a later pass (the engine back) scores all three.
    assert (await score_run(store, teacher, http=engine(vllm_shaped))).scored == 3


async def test_the_live_mode_scores_sessions_as_they_finish(store: EventStore) -> None:
    teacher = Teacher("t", "http://teacher", "teacher")
    projector = asyncio.create_task(Projector(store).run_forever(poll_interval=0.1))
    passes: list[int] = []
    scorer = asyncio.create_task(
        follow(
            store,
            teacher,
            ["live"],
            poll_interval=0.1,
            http=engine(vllm_shaped),
            on_pass=lambda r: passes.append(r.scored),
        )
    )
    try:
        for k in range(3):
            await record(store, f"live{k}", run_id="live")
            deadline = asyncio.get_running_loop().time() + 20
            while await store.pool.fetchval(COUNT) != k + 1:
                assert asyncio.get_running_loop().time() < deadline, "not scored in time"
                await asyncio.sleep(0.05)
        assert sum(passes) == 3
    finally:
        scorer.cancel()
        projector.cancel()
        await asyncio.gather(scorer, projector, return_exceptions=True)
    values = await store.pool.fetchval(
        "SELECT trajstore_float32s(data) FROM side_data WHERE session_id = 'live0'"
    )
    assert values == pytest.approx([-3 / 100, -4 / 100, -5 / 100])  # positions 3, 4, 5
