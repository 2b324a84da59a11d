"""Retention without loss: archive whole days to Parquet, verify, then detach and drop; archived
sessions rebuild identically; a failed or partial archive drops nothing; active days refused."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from tests.store.partition_clock import days_ago, days_with_partitions, recorded_on
from tests.support import RecordedSession
from trajstore.store import EventStore
from trajstore.store import archive as archiving
from trajstore.store.archive import archive, rebuild_archived_session
from trajstore.store.errors import ArchiveError
from trajstore.store.export import export
from trajstore.store.partitions import list_partitions, partition_name
from trajstore.store.projection import Projector
from trajstore.store.samples import build_samples
from trajstore.store.sessions import rebuild_session
from trajstore.store.timeline import timeline

OLD = days_ago(5)


async def record_session(store: EventStore, session_id: str, *, finish: bool = True) -> None:
    recording = RecordedSession(store, session_id)
    await recording.created(task_id="t1")
    for n in range(2):
        await recording.turn(
            {"request_id": f"{session_id}-r{n}", "messages": [{"role": "user", "content": "hi"}]},
            prompt_ids=[1, 2, 3, 4 + n],
            completion=[7, 8, 9],
        )
    if finish:
        await recording.finished(reward=0.5)


async def events_bytes(store: EventStore) -> int:
    return int(
        await store.pool.fetchval(
            "SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits "
            "WHERE inhparent = 'events'::regclass"
        )
    )


async def partition_names(store: EventStore) -> list[str]:
    async with store.pool.acquire() as conn:
        return [p.name for p in await list_partitions(conn)]


async def test_archive_then_drop_frees_the_space_and_the_session_rebuilds_identically(
    store: EventStore, tmp_path: Path
) -> None:
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        await record_session(store, "s1")
    await record_session(store, "s2")  # today's, stays in the log
    events = await store.read_session("s1")
    samples_before = build_samples(rebuild_session("s1", events, packed=True))
    lineage_of = {t: s.lineage for s in samples_before for t in s.turns}
    timeline_before = timeline(rebuild_session("s1", events), events, lineage_of)
    assert samples_before
    async with store.pool.acquire() as conn:
        [old] = [p for p in await list_partitions(conn) if p.day == OLD]
    size_before = await events_bytes(store)

    result = await archive(store, days_ago(1), tmp_path)

    [entry] = result.partitions
    assert (entry.name, entry.rows, result.dropped) == (old.name, len(events), True)
    assert await events_bytes(store) == size_before - old.bytes
    assert partition_name(OLD) not in await partition_names(store)
    assert await store.read_session("s1") == []
    assert len(await store.read_session("s2")) > 0
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [p["name"] for p in manifest["partitions"]] == [old.name]

    rebuilt = rebuild_archived_session(tmp_path, "s1")
    assert [(e.position, e.event_id) for e in rebuilt.events] == [
        (e.position, e.event_id) for e in events
    ]
    assert rebuilt.samples == samples_before  # every field, the packed arrays byte for byte
    assert [s.token_ids for s in rebuilt.samples] == [s.token_ids for s in samples_before]
    assert rebuilt.timeline == timeline_before
    # The stream's versions continue past the archived events.
    await RecordedSession(store, "s1").finished(reward=None, status="completed")
    assert (await store.read_session("s1"))[0].stream_version == 4


async def test_an_active_sessions_day_is_refused(store: EventStore, tmp_path: Path) -> None:
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        await record_session(store, "done")
        await record_session(store, "live", finish=False)
    with pytest.raises(ArchiveError, match=r"still active.*live"):
        await archive(store, days_ago(1), tmp_path / "out")
    assert partition_name(OLD) in await partition_names(store)
    assert not (tmp_path / "out").exists()  # refused before writing anything


async def test_an_unwritable_out_drops_nothing(store: EventStore, tmp_path: Path) -> None:
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        await record_session(store, "s1")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ArchiveError, match="cannot write the archive"):
        await archive(store, days_ago(1), blocker / "archive")
    assert partition_name(OLD) in await partition_names(store)
    assert len(await store.read_session("s1")) == 11


async def test_a_file_cut_short_before_verification_drops_nothing(
    store: EventStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        await record_session(store, "s1")
    write = archiving.export_partition

    async def write_then_truncate(*args: object) -> archiving.ArchivedPartition:
        entry = await write(*args)  # type: ignore[arg-type]
        path = tmp_path / entry.file
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
        return entry

    monkeypatch.setattr(archiving, "export_partition", write_then_truncate)
    with pytest.raises(ArchiveError, match="nothing was dropped"):
        await archive(store, days_ago(1), tmp_path)
    assert partition_name(OLD) in await partition_names(store)
    assert len(await store.read_session("s1")) == 11
    assert not (tmp_path / "manifest.json").exists()


async def test_keep_detaches_without_dropping(store: EventStore, tmp_path: Path) -> None:
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        await record_session(store, "s1")
    result = await archive(store, days_ago(1), tmp_path, keep=True)
    assert not result.dropped
    assert partition_name(OLD) not in await partition_names(store)
    kept = await store.pool.fetchval(f"SELECT count(*) FROM {partition_name(OLD)}")
    assert kept == 11
    assert await store.read_session("s1") == []


async def test_nothing_before_the_date_is_a_no_op(store: EventStore, tmp_path: Path) -> None:
    await days_with_partitions(store, OLD)
    result = await archive(store, OLD, tmp_path)  # the day itself is not wholly before
    assert result.partitions == []
    assert isinstance(OLD, dt.date)


async def test_the_export_reads_archived_messages_from_the_archive(
    store: EventStore, tmp_path: Path
) -> None:
    # Samples stay in the database; the messages of their requests left with their day.
    await days_with_partitions(store, OLD)
    async with recorded_on(store, OLD):
        recording = RecordedSession(store, "s1")
        await recording.created(task_id="t1")
        messages = [{"role": "user", "content": "add 2 and 3"}]
        await recording.turn(
            {"request_id": "s1-r0", "body": {"messages": messages}},
            prompt_ids=[1, 2, 3],
            completion=[7, 8, 9],
        )
        await recording.finished(reward=1.0)
    await Projector(store).run_once()

    async def exported(name: str, **options: Path) -> list[dict[str, object]]:
        out = tmp_path / name
        await export(store, out, fmt="jsonl", **options)
        return [json.loads(line) for line in out.read_text().splitlines()]

    before = await exported("before.jsonl")
    assert before and all(json.loads(str(r["messages"])) for r in before)
    await archive(store, days_ago(1), tmp_path / "archive")

    without = await exported("without.jsonl")
    assert [json.loads(str(r["messages"])) for r in without] == [[] for _ in before]
    assert [r["token_ids"] for r in without] == [r["token_ids"] for r in before]
    assert await exported("with.jsonl", archive=tmp_path / "archive") == before
