"""Teacher scoring on the real vLLM: a run recorded from a student through the proxy, scored by a
teacher engine (the same tokenizer, other weights): every sample's teacher logprobs are the
teacher's own `prompt_logprobs` for its ids; a scorer killed mid-run and started again finishes
with each sample scored once; samples the teacher refuses get a recorded failure."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.proxy.fixtures import ProxyFactory, served_vllm
from tests.support import RecordedSession
from trajstore.store import EventStore
from trajstore.store.projection import Projector
from trajstore.store.side_data import (
    LOGPROBS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    read_sample_facts,
    sample_arrays,
)
from trajstore.teacher import Teacher, score_run
from trajstore.tiny_model import build_tiny_model, reweighted_copy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_LEN = 2048
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def teacher_engine() -> Iterator[str]:
    """A real vLLM serving a teacher: the test student's tokenizer (seed 0), other weights."""
    workdir = Path(tempfile.mkdtemp(prefix="trajstore-teacher-"))
    student = build_tiny_model(workdir / "student", seed=0)
    teacher = reweighted_copy(student, workdir / "teacher", seed=7)
    with served_vllm(teacher, workdir, served_model_name="teacher", max_model_len=MAX_LEN) as url:
        yield url


async def record_run(proxy: ProxyFactory, sessions: int) -> None:
    """`sessions` two-turn sessions from the student, rewarded and finished."""
    for k in range(sessions):
        session = await proxy.new_session(run_id="student", group_id="g")
        agent = proxy.agent(session)
        messages: list[dict[str, str]] = [{"role": "user", "content": f"count to {k}"}]
        for turn in range(2):
            reply = await agent.chat.completions.create(
                model="tiny", messages=messages, max_tokens=12, temperature=1.0, seed=k * 10 + turn
            )  # type: ignore[call-overload]
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "go on"}]  # fmt: skip
        sid = session["session_id"]
        await proxy.http.post(f"{proxy.url}/sessions/{sid}/reward", json={"value": k % 2})
        await proxy.http.post(f"{proxy.url}/sessions/{sid}/finish", json={"status": "completed"})


async def teachers_own(url: str, ids: list[int], top_k: int) -> list[dict[str, dict]]:
    """The teacher's prompt_logprobs for `ids`, asked alone."""
    async with httpx.AsyncClient(timeout=120) as http:
        body = {"model": "teacher", "prompt": [ids], "max_tokens": 1, "prompt_logprobs": top_k}
        response = await http.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    return response.json()["choices"][0]["prompt_logprobs"]  # type: ignore[no-any-return]


async def test_a_student_run_scored_by_a_teacher_holds_the_teachers_prompt_logprobs(
    start_proxy: ProxyFactory, vllm: str, teacher_engine: str, store: EventStore
) -> None:
    proxy = await start_proxy([vllm])
    await record_run(proxy, 4)
    await Projector(store).run_once()
    rows = await store.pool.fetch("SELECT * FROM samples WHERE run_id = 'student'")
    assert len(rows) == 4

    teacher = Teacher("seven", teacher_engine, "teacher", top_k=3, batch_size=3, concurrency=2)
    report = await score_run(store, teacher, ["student"])
    assert (report.scored, dict(report.failed)) == (4, {})

    async with store.pool.acquire() as conn:
        facts = await read_sample_facts(conn, [r["sample_id"] for r in rows])
    for row in rows:
        ids = np.frombuffer(row["token_ids"], "<i4")
        mask = np.frombuffer(row["loss_mask"], np.uint8)
        [side] = sample_arrays(row["token_ids"], mask, None, None, facts[row["sample_id"]])
        own = await teachers_own(teacher_engine, ids.tolist(), 3)
        generated = np.flatnonzero(mask == 1)
        expected = [own[t][str(ids[t])]["logprob"] for t in generated]
        assert np.allclose(side.arrays[LOGPROBS][generated], expected, rtol=0, atol=1e-5)
        assert np.isnan(side.arrays[LOGPROBS][mask == 0]).all()
        for t in generated[:5]:
            best = sorted((v["rank"], int(k), v["logprob"]) for k, v in own[t].items())
            best = [b for b in best if b[0] <= 3]
            assert side.arrays[TOPK_IDS][t].tolist() == [b[1] for b in best]
            assert np.allclose(side.arrays[TOPK_LOGPROBS][t], [b[2] for b in best], atol=1e-5)

    # Scoring again scores nothing; another teacher's scores sit beside these.
    assert (await score_run(store, teacher, ["student"])).scored == 0
    other = Teacher("seven-k0", teacher_engine, "teacher")
    assert (await score_run(store, other, ["student"])).scored == 4
    async with store.pool.acquire() as conn:
        facts = await read_sample_facts(conn, [rows[0]["sample_id"]])
    assert sorted(p.source for p, _ in facts[rows[0]["sample_id"]].scores) == [
        "seven", "seven-k0"
    ]  # fmt: skip


async def test_a_killed_scorer_started_again_scores_each_sample_once(
    teacher_engine: str, store: EventStore, database_url: str
) -> None:
    # Samples recorded as the proxy records them (the student's engine is not needed here).
    rng = np.random.default_rng(0)
    for k in range(24):
        recorded = RecordedSession(store, f"s{k}", run_id="kill")
        await recorded.created(task_id="t", group_id="g")
        prompt = rng.integers(3, 500, 40).tolist()
        completion = rng.integers(3, 500, 30).tolist()
        await recorded.turn({"request_id": f"r{k}", "body": {}}, prompt, completion)
        await recorded.finished()
    await Projector(store).run_once()

    command = [
        sys.executable, "-m", "trajstore", "--database-url", database_url, "score",
        "--run", "kill", "--teacher", "t", "--engine", teacher_engine, "--model", "teacher",
        "--batch-size", "1", "--concurrency", "1",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    scorer = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    count = "SELECT count(*) FROM side_data WHERE run_id = 'kill' AND name = 'logprobs'"
    for _ in range(1200):
        if await store.pool.fetchval(count) >= 3:
            break
        await asyncio.sleep(0.05)
    scorer.send_signal(signal.SIGKILL)
    await scorer.wait()
    done_before = await store.pool.fetchval(count)
    assert 3 <= done_before < 24, "the scorer was killed before it finished"

    again = await asyncio.create_subprocess_exec(
        *command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    output = (await asyncio.wait_for(again.communicate(), 600))[0].decode()
    assert again.returncode == 0, output
    assert f"scored {24 - done_before} samples" in output
    per_sample = await store.pool.fetch(
        "SELECT sample_id, count(*) AS n FROM side_data WHERE run_id = 'kill' "
        "AND name = 'logprobs' GROUP BY sample_id"
    )
    assert len(per_sample) == 24 and {r["n"] for r in per_sample} == {1}


async def test_samples_the_teacher_refuses_get_a_recorded_failure(
    teacher_engine: str, store: EventStore
) -> None:
    cases = {
        "fine": ([5, 6, 7], [8, 9]),
        "other-vocabulary": ([5, 6, 7], [8, 40_000]),  # an id past the teacher's vocabulary
        "too-long": (list(range(3, 403)) * 6, [8, 9]),  # 2,402 tokens, the teacher serves 2,048
    }
    for name, (prompt, completion) in cases.items():
        recorded = RecordedSession(store, name, run_id="bad")
        await recorded.created()
        await recorded.turn({"request_id": name, "body": {}}, prompt, completion)
        await recorded.finished()
    await Projector(store).run_once()

    teacher = Teacher("t", teacher_engine, "teacher", batch_size=3)
    report = await score_run(store, teacher, ["bad"])
    assert report.scored == 1
    assert dict(report.failed) == {"vocabulary": 1, "too_long": 1}
    failures = await store.pool.fetch(
        "SELECT session_id, reason, message FROM scoring_failures ORDER BY session_id"
    )
    assert [(r["session_id"], r["reason"]) for r in failures] == [
        ("other-vocabulary", "vocabulary"), ("too-long", "too_long")
    ]  # fmt: skip
    assert "out of vocabulary" in failures[0]["message"]
    assert "2048" in failures[1]["message"]
