"""SQL for people: the views, the README's queries, the reader role, `trajstore sql`.

The data is the hand-checkable table in `tests/store/views_data.py`; every expected value
below can be read off that table.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from decimal import Decimal
from pathlib import Path
from typing import Any

import asyncpg
import pytest

from tests.store.views_data import record_all
from trajstore.store import EventStore
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.projection import Projector

README = (Path(__file__).parents[2] / "README.md").read_text()


def readme_query(question: str) -> str:
    """The README's SQL block that starts with `-- <question>`."""
    blocks = re.findall(r"```sql\n(.*?)```", README, flags=re.DOTALL)
    [block] = [b for b in blocks if b.startswith(f"-- {question}\n")]
    return block


@pytest.fixture
async def recorded(store: EventStore) -> EventStore:
    await record_all(store)
    await Projector(store).run_once()
    return store


async def rows(store: EventStore, query: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await store.pool.fetch(query)]


async def test_turns_has_one_row_per_request_with_what_it_cost(recorded: EventStore) -> None:
    found = {
        r["request_id"]: r
        for r in await recorded.pool.fetch("SELECT * FROM turns WHERE session_id IN ('s1', 's4')")
    }
    assert sorted(found) == ["s1-0", "s1-1", "s4-0", "s4-1"]
    first = found["s1-0"]
    assert (first["status"], first["finish_reason"], first["n_tool_calls"]) == (
        "completed",
        "stop",
        1,
    )
    assert first["tool_calls"] is not None and b'"add"' in first["tool_calls"]
    assert (first["prompt_tokens"], first["completion_tokens"]) == (2, 2)
    assert (first["engine"], first["policy_version"], first["ttft_s"]) == ("e1", "1", 0.1)
    assert first["completion_text"] == "answer 0"
    second = found["s1-1"]
    assert (second["n_tool_calls"], second["prompt_tokens"], second["ttft_s"]) == (0, 5, 0.2)
    failed = found["s4-1"]
    assert (failed["status"], failed["failure"], failed["completion_tokens"]) == (
        "failed", "engine_error", 0
    )  # fmt: skip
    # The lineage each turn belongs to, once projected; a failed turn is in none.
    assert [found[r]["lineage"] for r in ("s1-0", "s1-1", "s4-0", "s4-1")] == [0, 0, 0, None]


async def test_trajectories_has_one_row_per_session(recorded: EventStore) -> None:
    found = {r["session_id"]: r for r in await recorded.pool.fetch("SELECT * FROM trajectories")}
    assert sorted(found) == ["s1", "s2", "s3", "s4", "s5", "s6"]
    s1 = found["s1"]
    assert (s1["status"], s1["reward"], s1["turns"], s1["tool_turns"]) == ("completed", 1.0, 2, 1)
    assert (s1["prompt_tokens"], s1["completion_tokens"]) == (7, 4)
    assert (s1["engines"], s1["policy_versions"], s1["divergences"]) == (["e1"], ["1"], 0)
    assert s1["duration_s"] > 0 and s1["task_id"] == "A"
    assert found["s2"]["reward"] == 0.5  # the last reward assigned wins
    assert (found["s3"]["divergences"], found["s3"]["divergence_reasons"]) == (
        1, ["history_rewritten"]
    )  # fmt: skip
    assert (found["s4"]["status"], found["s4"]["failed_turns"], found["s4"]["reward"]) == (
        "timeout", 1, None
    )  # fmt: skip
    assert found["s5"]["discarded"] and found["s5"]["discard_reason"] == "leaked the answer"
    # One conversation each; s3's rewrite made a second sample of it (two calls, two rows).
    assert (s1["lineages"], s1["samples"], s1["calls_per_sample"]) == (1, 1, Decimal("2.00"))
    s3 = found["s3"]
    assert (s3["lineages"], s3["samples"], s3["calls_per_sample"]) == (1, 2, Decimal("1.00"))
    assert (found["s6"]["status"], found["s6"]["finished_at"]) == ("active", None)


async def test_readme_mean_reward_per_run_and_policy_version(recorded: EventStore) -> None:
    assert await rows(recorded, readme_query("mean reward per run and policy version")) == [
        ("r1", "1", 1, Decimal("1.000")),  # s1
        ("r1", "2", 2, Decimal("0.750")),  # s2 (0.5) and s3 (1.0); s4 timed out, s5 discarded
    ]


async def test_readme_finish_reason_breakdown(recorded: EventStore) -> None:
    assert await rows(recorded, readme_query("how completions ended")) == [
        ("stop", 7, Decimal("87.5")),
        ("length", 1, Decimal("12.5")),
    ]


async def test_readme_tool_calls_per_task(recorded: EventStore) -> None:
    assert await rows(recorded, readme_query("tool calls per task")) == [
        ("A", 4, 1, Decimal("0.25")),
        ("B", 5, 0, Decimal("0.00")),
    ]


async def test_readme_divergence_rate_and_reasons(recorded: EventStore) -> None:
    assert await rows(recorded, readme_query("how often histories diverge, and why")) == [
        ("history_rewritten", 1, Decimal("20.0")),  # s3, of the five finished sessions
    ]


async def test_readme_slowest_engines_by_ttft(recorded: EventStore) -> None:
    assert await rows(recorded, readme_query("slowest engines by time to first token")) == [
        ("e2", 3, Decimal("0.500"), Decimal("0.590")),
        ("e1", 5, Decimal("0.100"), Decimal("0.280")),
    ]


async def test_readme_sessions_that_timed_out(recorded: EventStore) -> None:
    [row] = await rows(recorded, readme_query("sessions that timed out"))
    assert row[:5] == ("s4", "r1", "B", 2, 1)


async def test_the_reader_role_reads_the_views_and_nothing_else(
    recorded: EventStore, database_url: str
) -> None:
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await conn.execute("SET ROLE trajstore_reader")
        assert await conn.fetchval("SELECT count(*) FROM trajectories") == 6
        assert await conn.fetchval("SELECT count(*) FROM turns") == 9
        assert await conn.fetchval("SELECT count(*) FROM samples") > 0
        assert await conn.fetchval("SELECT count(messages) FROM turns") == 9
        for statement in [
            "SELECT count(*) FROM events",
            "SELECT count(*) FROM projection_checkpoints",
            "INSERT INTO samples (sample_id) VALUES (gen_random_uuid())",
            "DELETE FROM samples",
            "CREATE TABLE mine (x int)",
        ]:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
    finally:
        await conn.close()


async def test_no_other_role_reads_a_sessions_messages_through_the_views_function(
    recorded: EventStore, database_url: str
) -> None:
    """`trajstore_turn_messages` reads events with its owner's rights: a role of the cluster
    that is not the reader must not call it (by default every role may call a new function)."""
    outsider = f"trajstore_test_outsider_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        await conn.execute(f"CREATE ROLE {outsider}")
        await conn.execute(f"SET ROLE {outsider}")
        asked = """SELECT trajstore_turn_messages('s1', '{"messages_prefix": {"request_id": "x",
                   "n_messages": 0}, "body": {"messages": []}}')"""
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.fetchval(asked)
    finally:
        await conn.execute("RESET ROLE")
        await conn.execute(f"DROP ROLE IF EXISTS {outsider}")
        await conn.close()


def trajstore(
    database_url: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url, "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "trajstore", *args],
        input=stdin, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


async def test_trajstore_sql_prints_a_table(recorded: EventStore, database_url: str) -> None:
    done = trajstore(
        database_url, "sql",
        "SELECT session_id, status, reward, token_ids FROM samples JOIN trajectories"
        " USING (session_id, status, reward) WHERE session_id = 's1'",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    header, *lines = [line for line in done.stdout.splitlines() if "s1" in line or "status" in line]
    assert "session_id" in header and "token_ids" in header
    assert "completed" in lines[0] and "<7 tokens>" in lines[0]
    assert done.stdout.strip().endswith("(1 row)")


async def test_trajstore_sql_is_read_only_and_says_what_is_wrong(
    recorded: EventStore, database_url: str
) -> None:
    refused = trajstore(database_url, "sql", "DELETE FROM samples")
    assert refused.returncode == 1
    assert "read-only transaction" in refused.stderr and "Traceback" not in refused.stderr
    typo = trajstore(database_url, "sql", "SELECT nope FROM trajectories")
    assert typo.returncode == 1 and 'column "nope" does not exist' in typo.stderr
    assert await recorded.pool.fetchval("SELECT count(*) FROM samples") > 0


async def test_trajstore_sql_without_a_query_opens_psql_on_the_store(
    recorded: EventStore, database_url: str
) -> None:
    done = trajstore(database_url, "sql", stdin="SELECT count(*) AS sessions FROM trajectories;\n")
    assert done.returncode == 0, done.stderr
    assert "sessions" in done.stdout and " 6\n" in done.stdout  # psql's table, on this database
