"""Bytes per generated token of each kind of side data, against the tokens and logprobs
themselves, as PostgreSQL stores them (`store.side_data`).

    python benchmarks/side_data.py [--quick] [--tokens 4096] [--samples 8]

Records `--samples` sessions of one turn of `--tokens` generated tokens (16-token chunks, as the
proxy writes them), then for each sample: a teacher's logprobs, its top-8 and top-20 (ids as
uint16: a vocabulary under 65,535), and the turn's routed experts in two shapes: the tiny MoE's
(2 layers x top-2 of 8 experts, uint8) and Qwen3-30B-A3B's (48 layers x top-8 of 128 experts,
uint8). Reported per generated token: the raw bytes (`octet_length`) and what the row holds
(`pg_column_size`, after lz4 where the server has it) of the side-data column, beside the
tokens' own `token_ids` + `logprobs`. Values are random (logprobs from a normal, experts and
top-k ids uniform): compression gains nothing on them; real ones (skewed experts, sorted
top-k logprobs) compress somewhat better. The database is TRAJSTORE_DATABASE_URL's server,
else the embedded one.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np
from ingest import Databases  # benchmarks/ingest.py, next to this file

from trajstore.store import EventStore, EventType, NewEvent, request_stream, session_stream
from trajstore.store.embedded import database_url
from trajstore.store.payloads import SideDataRecorded
from trajstore.store.side_data import (
    EXPERTS,
    LOGPROBS,
    ROUTED_EXPERTS,
    TOPK_IDS,
    TOPK_LOGPROBS,
    pack,
    sample_stream,
    scored_event,
)

SIZES = """
SELECT event_type, payload ->> 'source' AS source, coalesce(payload ->> 'top_k', '') AS k,
       sum(octet_length(token_ids) + coalesce(octet_length(logprobs), 0)) AS token_raw,
       sum(pg_column_size(token_ids) + coalesce(pg_column_size(logprobs), 0)) AS token_stored,
       sum(octet_length(side_data)) AS side_raw, sum(pg_column_size(side_data)) AS side_stored,
       sum(pg_column_size(payload)) AS payload
FROM events WHERE event_type IN ('completion_chunk', 'sample_scored', 'side_data_recorded')
GROUP BY 1, 2, 3 ORDER BY 1, 2, 3
"""


async def record(store: EventStore, samples: int, tokens: int) -> None:
    rng = np.random.default_rng(0)
    for k in range(samples):
        sid, rid = f"s{k}", f"r{k}"
        ids = rng.integers(0, 150_000, tokens).astype(np.int32)
        logprobs = -np.abs(rng.normal(0, 2, tokens)).astype(np.float32)
        chunks = [
            NewEvent(EventType.COMPLETION_CHUNK, session_id=sid, run_id="bytes",
                     payload={"choice": 0, "text": ""}, token_ids=ids[i : i + 16],
                     logprobs=logprobs[i : i + 16])
            for i in range(0, tokens, 16)
        ]  # fmt: skip
        await store.append(request_stream(rid), chunks)
        for name, layers, top_k in (("tiny-moe", 2, 2), ("qwen3-30b-a3b", 48, 8)):
            experts = rng.integers(0, 8 if layers == 2 else 128, (tokens, layers, top_k), np.uint8)
            specs, data = pack({EXPERTS: experts})
            side = SideDataRecorded(request_id=rid, kind=ROUTED_EXPERTS, source=name,
                                    n_tokens=tokens, arrays=specs)  # fmt: skip
            await store.append(request_stream(rid), [
                NewEvent(EventType.SIDE_DATA_RECORDED, session_id=sid, run_id="bytes",
                         payload=side, side_data=data)
            ])  # fmt: skip
        token_bytes = ids.tobytes()
        mask = np.ones(tokens, np.uint8)
        for top_k in (0, 8, 20):
            teacher = -np.abs(rng.normal(0, 2, tokens)).astype(np.float32)
            arrays = {LOGPROBS: teacher}
            if top_k:
                arrays[TOPK_IDS] = rng.integers(0, 65_000, (tokens, top_k)).astype(np.uint16)
                arrays[TOPK_LOGPROBS] = np.sort(-np.abs(rng.normal(0, 3, (tokens, top_k))), axis=1)[
                    :, ::-1
                ].astype(np.float32)
            event = scored_event(
                sample_id=f"00000000-0000-0000-0000-{k:012d}", session_id=sid, run_id="bytes",
                source=f"top{top_k}", token_bytes=token_bytes, loss_mask=mask,
                behaviour_logprobs=logprobs, arrays=arrays, top_k=top_k,
            )  # fmt: skip
            await store.append(sample_stream(f"s{k}-{top_k}"), [event])
        await store.append(session_stream(sid), [
            NewEvent(EventType.SESSION_FINISHED, session_id=sid, run_id="bytes", payload={})
        ])  # fmt: skip


async def main(args: argparse.Namespace) -> None:
    databases = Databases(await asyncio.to_thread(database_url))
    await databases.setup()
    try:
        async with await EventStore.open(await databases.fresh()) as store:
            await record(store, args.samples, args.tokens)
            rows = await store.pool.fetch(SIZES)
    finally:
        await databases.drop_all()
    n = args.samples * args.tokens
    print(f"{args.samples} samples x {args.tokens} generated tokens; bytes per generated token")
    print("| what | raw | stored | payload JSON |")
    print("| --- | ---: | ---: | ---: |")
    for row in rows:
        if row["event_type"] == "completion_chunk":
            name = "token ids + behaviour logprobs (completion chunks)"
            raw, stored = row["token_raw"], row["token_stored"]
        elif row["event_type"] == "side_data_recorded":
            name = f"routed experts, {row['source']}"
            raw, stored = row["side_raw"], row["side_stored"]
        else:
            k = int(row["k"] or 0)
            name = "teacher logprobs" + (f" + top-{k} (ids uint16, logprobs)" if k else "")
            raw, stored = row["side_raw"], row["side_stored"]
        print(f"| {name} | {raw / n:.2f} | {stored / n:.2f} | {row['payload'] / n:.3f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=8)
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.tokens, arguments.samples = 512, 2
    asyncio.run(main(arguments))
