"""Old logs stay readable: logs recorded by earlier releases rebuild into the samples they built.

Each fixture in tests/fixtures/golden was recorded by a release's own proxy, recorder and
projector (`tests/fixtures/golden/record.py`, run from that release's tree): its events, every
column needed to insert them again, how that release read each session back, and the samples it
built from them. Here a database is migrated to that release's revision, given the events as
that release stored them, and migrated to head; today's code must read every session as the
release did (each turn's whole prompt, each choice's tokens and logprobs) and project the
samples it built, token ids, loss mask and behaviour logprobs byte for byte. A change to how an
old payload is read (an upcaster, a default, a field's meaning) that moves one token fails here.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import gzip
import uuid
from pathlib import Path
from typing import Any

import asyncpg
import orjson
import pytest

from tests.fixtures.golden.record import session_as_read
from trajstore.store import EventStore, migrations
from trajstore.store.projection import Projector
from trajstore.store.sessions import rebuild_session

GOLDEN = Path(__file__).parents[1] / "fixtures" / "golden"
FIXTURES = sorted(p.name for p in GOLDEN.glob("*.json.gz"))

#: What a sample must keep across releases: its identity, its arrays, and what it says of them.
KEPT = (
    "session_id", "run_id", "task_id", "group_id", "status", "finish_reason", "reward",
    "token_ids", "loss_mask", "logprobs", "prompt_len", "response_len", "n_turns", "tool_turns",
    "policy_versions", "engines", "request_ids", "policy_version_min", "policy_version_max",
)  # fmt: skip


def _value(value: Any) -> Any:
    """A fixture's value as asyncpg takes it (bytes come base64-encoded)."""
    if isinstance(value, dict) and set(value) == {"b64"}:
        return base64.b64decode(value["b64"])
    return value


def load(name: str) -> dict[str, Any]:
    """A golden fixture: {commit, revision, events, samples}."""
    fixture: dict[str, Any] = orjson.loads(gzip.decompress((GOLDEN / name).read_bytes()))
    return fixture


async def insert_events(url: str, events: list[dict[str, Any]]) -> None:
    """The events as their release stored them, in their log order, in one transaction."""
    conn = await asyncpg.connect(url)
    try:
        await conn.executemany(
            "INSERT INTO events (event_id, stream_id, stream_version, session_id, run_id,"
            " event_type, recorded_at, payload, token_ids, logprobs)"
            " VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9, $10)",
            [
                (
                    uuid.UUID(e["event_id"]),
                    e["stream_id"],
                    e["stream_version"],
                    e["session_id"],
                    e["run_id"],
                    e["event_type"],
                    datetime.datetime.fromisoformat(e["recorded_at"]),
                    e["payload"],
                    _value(e["token_ids"]),
                    _value(e["logprobs"]),
                )
                for e in events
            ],
        )
    finally:
        await conn.close()


async def rebuilt_samples(url: str) -> dict[str, dict[str, Any]]:
    """Today's projection of the log: its samples by id."""
    async with await EventStore.open(url) as store:
        # The readers' horizon is the whole server's: another database's long transaction (a
        # neighbour's test) holds it back, and a projection that ran early would miss events.
        assert await store.settle(120), "the server's oldest transaction did not finish"
        await Projector(store).run_once(settle=0)
        rows = await store.pool.fetch("SELECT * FROM samples")
    return {str(row["sample_id"]): dict(row) for row in rows}


#: Releases whose projection was re-cut by design since, and how. Their samples are compared
#: by the requests they hold, not by id, and may be cut otherwise where the change says so.
RECUT = {
    "0014_sample_images": (
        "lineages (migration 0016's release): a conversation interleaved with another (a side "
        "call) is one sample, where the release before cut it at each switch; sample ids "
        "name the lineage since"
    ),
}


def _chain(sample: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """What a sample is, whatever its id: its session and the requests it holds, in order."""
    return sample["session_id"], tuple(str(r) for r in sample["request_ids"])


def _trained(samples: list[dict[str, Any]]) -> list[tuple[int, bytes]]:
    """Every trained token of a session's samples (loss mask 1): its id and logprob's bytes."""
    tokens = []
    for sample in samples:
        ids, mask, logprobs = (_value(sample[c]) for c in ("token_ids", "loss_mask", "logprobs"))
        for i, kept in enumerate(mask):
            if kept:
                tokens.append(
                    (int.from_bytes(ids[4 * i : 4 * i + 4], "little"), logprobs[4 * i : 4 * i + 4])
                )
    return sorted(tokens)


def _by_session(samples: Any) -> dict[str, list[dict[str, Any]]]:
    sessions: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        sessions.setdefault(sample["session_id"], []).append(sample)
    return sessions


@pytest.mark.parametrize("name", FIXTURES)
async def test_an_old_log_rebuilds_into_the_samples_its_release_built(
    empty_database_url: str, name: str
) -> None:
    fixture = load(name)
    release = f"{name} ({fixture['commit']})"
    await asyncio.to_thread(migrations.upgrade, empty_database_url, fixture["revision"])
    await insert_events(empty_database_url, fixture["events"])
    await asyncio.to_thread(migrations.upgrade, empty_database_url)

    # Every session reads as its release read it: each turn's whole prompt, each choice's
    # tokens, logprobs and ending, byte for byte, whatever the projection makes of them.
    async with await EventStore.open(empty_database_url) as store:
        for session_id, then in fixture["sessions"].items():
            now = rebuild_session(session_id, await store.read_session(session_id))
            assert session_as_read(now) == then, f"{release}: session {session_id} reads otherwise"

    rebuilt = await rebuilt_samples(empty_database_url)

    built = fixture["samples"]
    recut = fixture["revision"] in RECUT
    if not recut:  # the same samples, by id
        assert sorted(rebuilt) == sorted(s["sample_id"] for s in built), f"{release}: other ids"
    now_by_chain = {_chain(s): s for s in rebuilt.values()}
    for then in built:
        now = now_by_chain.get(_chain(then))
        if now is None:
            assert recut, f"{release}: no sample holds requests {_chain(then)} any more"
            continue
        assert recut or str(now["sample_id"]) == then["sample_id"]
        for column in KEPT:
            assert now[column] == _value(then[column]), (
                f"{release}: the sample of requests {_chain(then)} has another {column} than "
                "its release built"
            )
    # Re-cut or not, each session trains the same tokens with the same behaviour logprobs.
    then_sessions, now_sessions = _by_session(built), _by_session(rebuilt.values())
    assert sorted(now_sessions) == sorted(then_sessions), f"{release}: other sessions"
    for session_id, samples in then_sessions.items():
        assert _trained(now_sessions[session_id]) == _trained(samples), (
            f"{release}: session {session_id} trains other tokens than its release did"
        )


def test_the_golden_logs_span_the_releases_they_promise() -> None:
    """Logs from before migration 0016, before 0017 and from today's release are kept."""
    revisions = {load(name)["revision"] for name in FIXTURES}
    assert {"0014_sample_images", "0016_lineages", "0017_partition_keys"} <= revisions
