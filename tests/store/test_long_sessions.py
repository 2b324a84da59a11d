"""A session of thousands of turns through every read path (issue 35): each completes, none
recurses over the session's history, and what each answers grows with the turns, not their
square. The session is opencode-shaped (`tests.long_session`): every prompt and message list
stored as a reference to the turn before, a chain 3,000 long (past Python's recursion limit)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest

from tests.long_session import COMPLETION, LongSession, record_long_session
from tests.store.partition_clock import days_ago, days_with_partitions, recorded_on
from trajstore.store import EventStore
from trajstore.store.archive import archive
from trajstore.store.export import export
from trajstore.store.pages import Page, rebuild_with_lineages, session_pieces
from trajstore.store.projection import Projector
from trajstore.store.sessions import rebuild_session
from trajstore.store.timeline import timeline

TURNS = 3_000
SIDE_EVERY = 50  # a title call every 50 calls: 60 one-turn side lineages


def without_tools(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in t.items() if k not in ("tools", "tools_from")} for t in turns]


@pytest.fixture
async def long(store: EventStore) -> LongSession:
    assert sys.getrecursionlimit() < TURNS  # a reader that recursed over the chain would fail
    written = await record_long_session(store, TURNS, side_every=SIDE_EVERY)
    assert written.main_turns == TURNS - TURNS // SIDE_EVERY
    return written


async def test_the_session_s_answer_gives_each_turn_once_with_its_lineage(
    store: EventStore, long: LongSession
) -> None:
    record, forest = rebuild_with_lineages("long", await store.read_session("long"))
    pieces = list(session_pieces(record, Page(whole=TURNS - 2)))
    answer = orjson.loads(b"".join(pieces))
    turns = answer["turns"]
    assert [t["index"] for t in turns] == list(range(TURNS))
    assert all(t["status"] == "completed" for t in turns)
    # One main lineage holding the main loop, one lineage per title call.
    main = [t for t in turns if t["lineage"] == 0]
    assert len(main) == long.main_turns and all(t["branch"] == 0 for t in main)
    assert len(answer["lineages"]) == 1 + TURNS // SIDE_EVERY
    assert answer["lineages"][0]["role"] == "main" and answer["main_lineage"] == 0
    # Each turn gives what it added: the answer is linear in the turns (the whole prompts would
    # be 200 M ids), and one turn asked for whole comes whole.
    assert len(b"".join(pieces)) < TURNS * 2_000
    assert max(len(t["prompt_added"]) for t in turns[1:]) < 100
    # The tools, sent with every main-loop request, are given once: the others name that turn.
    assert turns[0]["tools"] is not None and turns[0]["tools_from"] is None
    assert {t["tools_from"] for t in main[1:]} == {0} and all(t["tools"] is None for t in main[1:])
    last = turns[TURNS - 2]
    assert len(last["prompt_token_ids"]) == long.prompt_tokens[TURNS - 2] == last["n_prompt_tokens"]
    assert len(last["messages"]) == 2 + 2 * (long.main_turns - 1)
    # Written a few dozen turns at a time, never as one document.
    plain = list(session_pieces(record, Page(), forest=forest))
    assert len(plain) > TURNS // 100 and max(len(p) for p in plain) < 200_000
    # A page: 1,000 turns from 1,000 on, saying there are more.
    paged = orjson.loads(
        b"".join(session_pieces(record, Page(first=1000, limit=1000), "next", forest))
    )
    assert [t["index"] for t in paged["turns"]] == list(range(1000, 2000))
    assert paged["next"] == "next" and paged["n_turns"] == TURNS
    assert without_tools(paged["turns"]) == without_tools(turns[1000:2000])
    assert paged["turns"][0]["tools"] == turns[0]["tools"]  # a page gives them once too


async def test_samples_export_and_timeline_of_a_long_session(
    store: EventStore, long: LongSession, tmp_path: Path
) -> None:
    assert await Projector(store).run_once() == 1
    out = tmp_path / "long.parquet"
    assert await export(store, out) == 1 + TURNS // SIDE_EVERY
    frame = pd.read_parquet(out)
    main = frame[frame["role"] == "main"].iloc[0]
    assert (main["lineage"], main["branch"], main["n_turns"]) == (0, 0, long.main_turns)
    assert len(main["token_ids"]) == max(long.prompt_tokens) + COMPLETION
    assert main["loss_mask"].sum() == long.main_turns * COMPLETION
    # The conversation: the last request's whole messages and the reply.
    assert len(json.loads(main["messages"])) == 2 + 2 * (long.main_turns - 1) + 1
    sides = frame[frame["role"] == "side"]
    assert len(sides) == TURNS // SIDE_EVERY and sides["parent"].isna().all()

    events = await store.read_session("long")
    entries = timeline(rebuild_session("long", events), events)
    requests = [e for e in entries if e.kind == "request"]
    assert len(requests) == TURNS
    # What each request added: the tool call's output (never the whole history again).
    assert all(len(e.details["new_messages"]) <= 2 for e in requests[1:])


async def test_replay_session_prints_a_long_session(long: LongSession, database_url: str) -> None:
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "trajstore", "replay", "session", "long", "--json"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    document = json.loads(done.stdout)
    assert len([e for e in document["timeline"] if e["kind"] == "completion"]) == TURNS
    assert {t["lineage"] for t in document["session"]["turns"]} == set(range(1 + TURNS // 50))


async def test_archive_show_rebuilds_a_long_archived_session(
    store: EventStore, database_url: str, tmp_path: Path
) -> None:
    old = days_ago(3)
    await days_with_partitions(store, old)
    async with recorded_on(store, old):
        long = await record_long_session(store, TURNS, side_every=SIDE_EVERY)
    await archive(store, days_ago(1), tmp_path)
    assert await store.read_session("long") == []  # only the archive holds it now
    env = {**os.environ, "TRAJSTORE_DATABASE_URL": database_url}
    command = [sys.executable, "-m", "trajstore", "archive", "show", str(tmp_path), "long"]
    shown = {}
    for what in ("samples", "timeline"):
        done = await asyncio.to_thread(
            subprocess.run, [*command, "--what", what],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        shown[what] = [json.loads(line) for line in done.stdout.splitlines()]
    main = shown["samples"][0]
    assert (main["lineage"], main["role"], main["is_final"]) == (0, "main", True)
    assert len(main["token_ids"]) == max(long.prompt_tokens) + COMPLETION
    assert len(shown["samples"]) == 1 + TURNS // SIDE_EVERY
    completions = [e for e in shown["timeline"] if e["kind"] == "completion"]
    assert len(completions) == TURNS and completions[49]["lineage"] == 1
