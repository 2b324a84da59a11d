"""The README is run, not just read: its example and its SQL must work as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg

from store.connection import asyncpg_dsn

README = (Path(__file__).parent.parent / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


def test_the_python_example_runs_and_prints_the_recorded_tokens(database_url: str) -> None:
    [example] = code_blocks("python")
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    done = subprocess.run(
        [sys.executable, "-c", example], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].split()[1] == "session_created"
    assert lines[1].split(maxsplit=2)[1:] == ["completion_chunk", "[9707   11 1879]"]


async def test_the_sql_examples_run(database_url: str) -> None:
    [sql] = code_blocks("sql")
    statements = [s.strip() for s in sql.split(";") if s.strip()]
    assert len(statements) >= 2
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        for statement in statements:
            await conn.fetch(statement)
    finally:
        await conn.close()
