"""`trajstore export` and `trajstore project --rebuild`, run as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.store.views_data import record_all
from trajstore.store import EventStore
from trajstore.store.projection import Projector


def trajstore(database_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
async def recorded(store: EventStore) -> EventStore:
    await record_all(store)
    await Projector(store).run_once()
    return store


async def test_parquet_export_holds_one_token_exact_record_per_sample(
    recorded: EventStore, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "r1.parquet"
    done = trajstore(database_url, "export", "--run", "r1", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"wrote 4 samples to {out}"  # s1, s2, s3 twice (it diverged)

    frame = pd.read_parquet(out)
    assert list(frame["session_id"]) == ["s1", "s2", "s3", "s3"]
    assert list(frame["branch"]) == [0, 0, 0, 1]
    s1 = frame.iloc[0]
    assert s1["token_ids"].tolist() == [1, 10, 20, 2, 30, 40, 2]
    assert s1["loss_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1]
    assert np.allclose(s1["logprobs"], [0, 0, -0.5, -0.5, 0, -0.5, -0.5])
    assert (s1["reward"], s1["prompt_len"], s1["response_len"], s1["tool_turns"]) == (1.0, 2, 4, 1)
    assert (s1["finish_reason"], s1["status"], list(s1["request_ids"])) == (
        "stop", "completed", ["s1-0", "s1-1"]
    )  # fmt: skip
    messages = json.loads(s1["messages"])
    assert messages[0]["role"] == "user" and messages[-1] == {
        "role": "assistant", "content": "answer 1"
    }  # fmt: skip
    assert json.loads(frame.iloc[3]["divergence"])["reason"] == "history_rewritten"
    assert frame.iloc[1]["reward"] == 0.5  # the corrected reward
    # List columns, typed: what `datasets` and pandas read without conversion.
    schema = pq.read_schema(out)
    assert schema.field("token_ids").type.value_type == pa.int32()
    assert schema.field("logprobs").type.value_type == pa.float32()


async def test_jsonl_export_has_the_same_records_and_statuses_are_opt_in(
    recorded: EventStore, database_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "all.jsonl"
    done = trajstore(
        database_url, "export", "--format", "jsonl", "--out", str(out),
        "--status", "completed", "--status", "timeout",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    # s4 timed out (asked for); s5 was discarded and s6 never finished: never samples.
    assert [r["session_id"] for r in records] == ["s1", "s2", "s3", "s3", "s4"]
    assert records[0]["token_ids"] == [1, 10, 20, 2, 30, 40, 2]
    assert records[4]["status"] == "timeout"
    parquet = tmp_path / "all.parquet"
    assert trajstore(database_url, "export", "--out", str(parquet)).returncode == 0
    assert len(pd.read_parquet(parquet)) == 4  # completed only, by default


async def test_project_rebuild_switches_readers_to_an_equal_new_version(
    recorded: EventStore, database_url: str
) -> None:
    query = (
        "SELECT sample_id, token_ids, loss_mask, logprobs, reward, divergence FROM samples"
        " WHERE projection_version = (SELECT version FROM projection_serving) ORDER BY 1"
    )
    before = [tuple(r) for r in await recorded.pool.fetch(query)]
    done = trajstore(database_url, "project", "--rebuild")
    assert done.returncode == 0, done.stderr
    assert "version 2" in done.stdout and "rebuilding samples" in done.stderr  # the bar
    assert [tuple(r) for r in await recorded.pool.fetch(query)] == before
    assert await recorded.pool.fetchval("SELECT version FROM projection_serving") == 2
