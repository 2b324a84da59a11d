"""The README is run, not just read: its example and its SQL must work as written."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from pathlib import Path

import asyncpg

from tests.proxy.fixtures import RunningProxy
from trajstore.store import EventStore
from trajstore.store.connection import asyncpg_dsn
from trajstore.store.projection import Projector

README = (Path(__file__).parent.parent / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.DOTALL)


async def run_agent_example(example: str, proxy: RunningProxy) -> str:
    """Run a README example against `proxy`, in a subprocess that does not block this loop (the
    proxy serves from it); its output."""
    example = example.replace("http://127.0.0.1:8400", proxy.url)
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", example,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(child.communicate(), 60)
    assert child.returncode == 0, err.decode()
    return out.decode()


async def test_the_agent_example_records_a_session_the_trainer_then_reads(
    proxy: RunningProxy, database_url: str
) -> None:
    [example, by_hand, training, _, _] = code_blocks("python")
    prompt, completion = (await run_agent_example(example, proxy)).strip().split("] [")
    assert len(prompt.strip("[").split(",")) == 8 and completion.strip("]")
    # The same session over plain HTTP (in run-2): the same prompt, a second finished session.
    again, completion_again = (await run_agent_example(by_hand, proxy)).strip().split("] [")
    assert again == prompt and completion_again.strip("]")

    # The projector (run by `trajstore up`) makes the finished sessions samples; the training
    # example reads run-1's as a batch.
    async with await EventStore.open(database_url) as store:
        assert await Projector(store).run_once() == 2
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", training, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(child.communicate(), 120)
    assert child.returncode == 0, err.decode()
    shape, generated, rewards = re.fullmatch(
        r"torch.Size\(\[1, (\d+)\]\) (\d+) tensor\(\[(.*)\]\)\n", out.decode()
    ).groups()  # type: ignore[union-attr]
    assert int(shape) > int(generated) > 0 and float(rewards) == 1.0


async def test_the_other_apis_example_records_a_turn_of_each(proxy: RunningProxy) -> None:
    [_, _, _, example, _] = code_blocks("python")
    lines = [line.split() for line in (await run_agent_example(example, proxy)).splitlines()]
    assert [api for api, _, _ in lines] == ["messages", "responses"]
    assert all(int(prompt) > 0 and 0 < int(completion) <= 8 for _, prompt, completion in lines)


def test_the_store_example_runs_and_prints_the_recorded_tokens(database_url: str) -> None:
    [_, _, _, _, example] = code_blocks("python")
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
    sql = code_blocks("sql")[0]  # the event log's; the views' are tested in tests/store
    statements = [s.strip() for s in sql.split(";") if s.strip()]
    assert len(statements) >= 2
    conn = await asyncpg.connect(asyncpg_dsn(database_url))
    try:
        for statement in statements:
            await conn.fetch(statement)
    finally:
        await conn.close()
