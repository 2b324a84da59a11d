"""Per-token side data (`store.side_data`): a sample's score and a turn's routed experts, stored
once, aligned with the sample's tokens, readable by SQL and exported."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.store.test_projection import record_session
from tests.support import RecordedSession
from trajstore.store import EventStore, EventType, NewEvent, request_stream
from trajstore.store.errors import BadEvent
from trajstore.store.export import export
from trajstore.store.payloads import SideDataRecorded
from trajstore.store.projection import Projector
from trajstore.store.side_data import (
    EXPERTS,
    LOGPROBS,
    ROUTED_EXPERTS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    absent,
    failed_event,
    narrowest_uint,
    pack,
    read_sample_facts,
    sample_arrays,
    sample_stream,
    scored_event,
    unpack,
)


def test_arrays_pack_and_unpack_with_their_dtypes_and_shapes() -> None:
    experts = np.arange(24, dtype=np.uint8).reshape(4, 3, 2)
    logprobs = np.array([-0.5, -1.25, np.nan], np.float32)
    specs, data = pack({"experts": experts, "logprobs": logprobs})
    assert len(data) == 24 + 12  # no padding, no header: the payload describes them
    back = unpack(specs, data)
    assert back["experts"].dtype == np.uint8 and (back["experts"] == experts).all()
    assert np.array_equal(back["logprobs"], logprobs, equal_nan=True)
    with pytest.raises(BadEvent):
        unpack(specs, data[:-1])
    with pytest.raises(BadEvent):
        pack({"ids": np.arange(3, dtype=np.int64)})  # a dtype wider than any id needs


def test_the_narrowest_dtype_keeps_a_value_free_for_absent() -> None:
    assert narrowest_uint(127) == np.uint8 and narrowest_uint(254) == np.uint8
    assert narrowest_uint(255) == np.uint16  # 256 experts: 255 is a real id
    assert narrowest_uint(70_000) == np.int32
    assert absent(np.dtype(np.uint8)) == 255 and np.isnan(absent(np.dtype(np.float32)))


async def _one_sample(store: EventStore) -> dict:
    await record_session(store, "s1", [([1, 10], [20, 2]), ([1, 10, 20, 2, 30], [40, 41, 2])])
    await Projector(store).run_once()
    return dict(await store.pool.fetchrow("SELECT * FROM samples"))


async def test_a_score_is_aligned_with_the_samples_generated_tokens(store: EventStore) -> None:
    row = await _one_sample(store)
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    behaviour = np.frombuffer(row["logprobs"], "<f4")
    teacher = np.array([-1.0, -2.0, -3.0, -4.0, -5.0], np.float32)
    topk_ids = np.arange(10, dtype=np.uint16).reshape(5, 2)
    topk = (teacher[:, None] * [1, 2]).astype("f4")
    event = scored_event(
        sample_id=row["sample_id"], session_id="s1", run_id="run-1", source="big",
        token_bytes=row["token_ids"], loss_mask=mask, behaviour_logprobs=behaviour,
        arrays={LOGPROBS: teacher, TOPK_IDS: topk_ids, TOPK_LOGPROBS: topk},
        top_k=2,
    )  # fmt: skip
    first = await store.append(sample_stream(row["sample_id"]), [event])
    # The same score again (a restarted scorer) is the same fact: stored once.
    assert await store.append(sample_stream(row["sample_id"]), [event]) == first

    async with store.pool.acquire() as conn:
        facts = await read_sample_facts(conn, [row["sample_id"]])
    [side] = sample_arrays(
        row["token_ids"], mask, row["side"], row["side_data"], facts[row["sample_id"]]
    )
    assert (side.kind, side.source) == ("teacher_logprobs", "big")
    aligned = side.arrays[LOGPROBS]
    assert len(aligned) == len(mask) == 8
    assert aligned[mask == 1].tolist() == teacher.tolist()
    assert np.isnan(aligned[mask == 0]).all()
    assert side.arrays[TOPK_IDS][mask == 1].tolist() == topk_ids.tolist()
    assert (side.arrays[TOPK_IDS][mask == 0] == 65535).all()

    # For people: the view, its decoders, and the means stored with the score.
    rows = await store.pool.fetch(
        "SELECT name, dtype, shape, trajstore_float32s(data) AS f, mean_reverse_kl "
        "FROM side_data WHERE sample_id = $1 ORDER BY name",
        row["sample_id"],
    )
    assert [(r["name"], r["dtype"], r["shape"]) for r in rows] == [
        ("logprobs", "float32", [5]), ("topk_ids", "uint16", [5, 2]),
        ("topk_logprobs", "float32", [5, 2]),
    ]  # fmt: skip
    assert rows[0]["f"] == teacher.tolist()
    assert rows[0]["mean_reverse_kl"] == pytest.approx(-0.25 + 3.0)
    ids = await store.pool.fetchval(
        "SELECT trajstore_uints(data, 2) FROM side_data WHERE name = 'topk_ids'"
    )
    assert ids == topk_ids.ravel().tolist()


async def test_a_rescore_is_a_new_fact_and_readers_take_the_latest(store: EventStore) -> None:
    row = await _one_sample(store)
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    kwargs = dict(
        sample_id=row["sample_id"], session_id="s1", run_id="run-1", source="big",
        token_bytes=row["token_ids"], loss_mask=mask,
        behaviour_logprobs=np.frombuffer(row["logprobs"], "<f4"),
    )  # fmt: skip
    stream = sample_stream(row["sample_id"])
    await store.append(stream, [scored_event(**kwargs, arrays={LOGPROBS: np.full(5, -1, "f4")})])
    await store.append(
        stream, [scored_event(**kwargs, arrays={LOGPROBS: np.full(5, -2, "f4")}, attempt=1)]
    )
    await store.append(
        stream,
        [failed_event(sample_id=row["sample_id"], session_id="s1", run_id="run-1",
                      source="other", reason="vocabulary", message="ids past the vocabulary")],
    )  # fmt: skip
    assert len(await store.read_stream(stream)) == 3  # nothing was updated
    async with store.pool.acquire() as conn:
        facts = (await read_sample_facts(conn, [row["sample_id"]]))[row["sample_id"]]
    [(score, _)] = facts.scores
    assert score.mean_logprob == -2.0
    assert [f.reason for f in facts.failures] == ["vocabulary"]
    failures = await store.pool.fetch("SELECT source, reason FROM scoring_failures")
    assert [tuple(r) for r in failures] == [("other", "vocabulary")]


async def test_a_score_of_other_tokens_is_refused_when_read(store: EventStore) -> None:
    row = await _one_sample(store)
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    event = scored_event(
        sample_id=row["sample_id"], session_id="s1", run_id="run-1", source="big",
        token_bytes=row["token_ids"][:-4] + b"\x07\x00\x00\x00", loss_mask=mask,
        behaviour_logprobs=np.zeros(8, "f4"), arrays={LOGPROBS: np.zeros(5, "f4")},
    )  # fmt: skip
    await store.append(sample_stream(row["sample_id"]), [event])
    async with store.pool.acquire() as conn:
        facts = await read_sample_facts(conn, [row["sample_id"]])
    with pytest.raises(BadEvent, match="other tokens"):
        sample_arrays(row["token_ids"], mask, None, None, facts[row["sample_id"]])


async def test_a_turns_routed_experts_land_at_the_positions_it_added(store: EventStore) -> None:
    # Two turns; each engine answer routes every position of its prompt + completion but the
    # last (never forwarded), as vLLM returns them; layers 2, top-k 2.
    recorded = RecordedSession(store, "s1")
    await recorded.created(task_id="t", group_id="g")
    turns = [([1, 10], [20, 2]), ([1, 10, 20, 2, 30], [40, 2])]
    for n, (prompt, completion) in enumerate(turns):
        rid = f"s1-{n}"
        await recorded.turn(
            {"request_id": rid, "body": {}, "received_at": 1.0 + n}, prompt, completion
        )
        rows = len(prompt) + len(completion) - 1
        experts = (np.arange(rows * 4).reshape(rows, 2, 2) + 100 * n).astype(np.uint16)
        specs, data = pack({EXPERTS: experts})
        side = SideDataRecorded(request_id=rid, kind=ROUTED_EXPERTS, source="e0",
                                n_tokens=rows, arrays=specs)  # fmt: skip
        await store.append(
            request_stream(rid),
            [NewEvent(EventType.SIDE_DATA_RECORDED, session_id="s1", run_id="run-1",
                      payload=side, side_data=data)],
        )  # fmt: skip
    await recorded.finished()
    await Projector(store).run_once()
    row = await store.pool.fetchrow("SELECT * FROM samples")
    [side] = sample_arrays(row["token_ids"], np.frombuffer(row["loss_mask"], np.uint8),
                           row["side"], row["side_data"], None)  # fmt: skip
    experts = side.arrays[EXPERTS]
    assert experts.shape == (7, 2, 2) and side.source == "e0"
    # Positions 0-3 come from turn 0 (rows 0..3 of its 4-token sequence; its last, 3, has none),
    # positions 4-6 from turn 1 (its rows 4..6; 6 is its last token: none).
    first = np.arange(3 * 4).reshape(3, 2, 2)
    assert experts[:3].tolist() == first.tolist()
    assert (experts[3] == 65535).all()
    assert experts[4:6].tolist() == (np.arange(16, 24).reshape(2, 2, 2) + 100).tolist()
    assert (experts[6] == 65535).all()


async def test_the_export_carries_the_side_data(store: EventStore, tmp_path: Path) -> None:
    row = await _one_sample(store)
    mask = np.frombuffer(row["loss_mask"], np.uint8)
    event = scored_event(
        sample_id=row["sample_id"], session_id="s1", run_id="run-1", source="big",
        token_bytes=row["token_ids"], loss_mask=mask, behaviour_logprobs=np.zeros(8, "f4"),
        arrays={LOGPROBS: np.array([-1, -2, -3, -4, -5], "f4")},
    )  # fmt: skip
    await store.append(sample_stream(row["sample_id"]), [event])
    out = tmp_path / "samples.jsonl"
    assert await export(store, out, fmt="jsonl") == 1
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    [side] = record["side_data"]
    assert (side["kind"], side["source"], side["name"]) == ("teacher_logprobs", "big", "logprobs")
    assert side["values"] == [None, None, -1, -2, None, -3, -4, -5]
    assert uuid.UUID(record["sample_id"]) == row["sample_id"]
    parquet = tmp_path / "samples.parquet"
    await export(store, parquet)
    [exported] = pq.read_table(parquet).column("side_data").to_pylist()
    assert exported[0]["values"][2:4] == [-1.0, -2.0]
