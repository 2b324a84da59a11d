"""The training ledger: one `training_step` event per training step, and the exact replay of one.

Each step of a training run is an event in the stream `training-<run>`, appended with the
expected stream version `step - 1`: steps are numbered from 1, recorded in order, and a step can
never be recorded twice (a second attempt raises `StepAlreadyRecorded`). The payload:

    training_run, step, model_version
    sample_ids  the batch's samples, in row order
    samples     per sample: session_id, row, reward, advantage, policy_version, staleness,
                n_tokens, checksum (CRC-32 of its stored arrays)
    layout      batch_size, token_budget, pack: how the batch was laid out
    replay      anything else the trainer passes (selection, seed, ...), for the record
    metrics     the step's loss metrics

`rebuild_step` reads the step back, fetches its samples by id from the served projection
(sample ids survive rebuilds), checks each checksum, and lays them out exactly as recorded: with
the recorded rewards and advantages (which depended on the whole selection at training time),
the result is the training batch, bit for bit.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import click
import torch
from rich.console import Console
from rich.table import Table
from tensordict import TensorDict

from trajstore.store import ConcurrencyError, EventStore, EventType, NewEvent, sample_reads
from trajstore.store.payloads_session import TrainingStep
from trajstore.trainer.arrays import decode_arrays
from trajstore.trainer.collate import Layout, ReplaySample, collate, sample_ids
from trajstore.trainer.errors import (
    SampleChanged,
    SampleGone,
    StepAlreadyRecorded,
    StepNotFound,
    TrainerError,
)
from trajstore.trainer.index import open_store
from trajstore.trainer.lag import token_staleness


def training_stream(training_run: str) -> str:
    """The ledger stream of one training run."""
    return f"training-{training_run}"


async def record_step(
    store: EventStore,
    training_run: str,
    step: int,
    batch: TensorDict,
    *,
    layout: Layout,
    metrics: Mapping[str, float],
    model_version: str | int | None = None,
    replay: Mapping[str, Any] | None = None,
) -> int:
    """Append the step's event; return its position in the log. Steps count from 1, in order."""
    if step < 1:
        raise TrainerError(f"steps are numbered from 1, got {step}")
    samples = batch.get_non_tensor("samples")
    payload = TrainingStep(
        training_run=training_run,
        step=step,
        model_version=model_version,
        sample_ids=sample_ids(batch),
        samples=samples,
        layout=layout.as_json(),
        replay=dict(replay or {}),
        metrics=dict(metrics),
    )
    stream = training_stream(training_run)
    try:
        (position,) = await store.append(
            stream, [NewEvent(EventType.TRAINING_STEP, payload=payload)], expected_version=step - 1
        )
    except ConcurrencyError as exc:
        if exc.actual >= step:
            raise StepAlreadyRecorded(
                f"step {step} of training run {training_run!r} is already recorded"
            ) from exc
        raise TrainerError(
            f"training run {training_run!r} has {exc.actual} steps recorded; "
            f"the next one to record is {exc.actual + 1}, not {step}"
        ) from exc
    return position


async def read_step(store: EventStore, training_run: str, step: int) -> TrainingStep:
    """The payload of a recorded step; `StepNotFound` says which steps exist."""
    stream = training_stream(training_run)
    events = await store.read_stream(stream, after_version=max(step - 1, 0), limit=1)
    if step >= 1 and events and events[0].stream_version == step:
        return TrainingStep.read(events[0].payload)
    recorded = await store.read_stream(stream)
    if not recorded:
        raise StepNotFound(f"no training run {training_run!r} in the ledger")
    raise StepNotFound(
        f"training run {training_run!r} has steps 1 to {len(recorded)}; there is no step {step}"
    )


async def rebuild_step(store: EventStore, training_run: str, step: int) -> TensorDict:
    """The batch of a recorded step, bit for bit; `SampleGone`/`SampleChanged` when it cannot be."""
    recorded = await read_step(store, training_run, step)
    entries = recorded.samples
    ids = [uuid.UUID(s.sample_id) for s in entries]
    rows = {row["sample_id"]: row for row in await sample_reads.read_served(store, ids)}
    missing = [str(i) for i in ids if i not in rows]
    if missing:
        raise SampleGone(
            f"step {step} of training run {training_run!r} used {len(missing)} samples that are "
            f"no longer in the samples projection (e.g. {missing[0]}): their sessions were "
            "discarded, or the projection was rebuilt without them"
        )
    rows_of_batch: list[list[ReplaySample]] = []
    for entry, sample_id in zip(entries, ids, strict=True):
        row = rows[sample_id]
        tokens, mask, logprobs, versions = decode_arrays(
            row["token_ids"], row["loss_mask"], row["logprobs"], row["version_spans"]
        )
        current = entry.policy_version + entry.staleness
        sample = ReplaySample(
            sample_id,
            entry.session_id,
            tokens,
            mask,
            logprobs,
            reward=entry.reward,
            advantage=entry.advantage,
            policy_version=entry.policy_version,
            staleness=entry.staleness,
            token_versions=versions,
            token_staleness=token_staleness(versions, current if entry.staleness >= 0 else None),
        )
        if sample.checksum != entry.checksum:
            raise SampleChanged(
                f"sample {sample_id} (session {entry.session_id!r}) holds other tokens than "
                f"at step {step} of training run {training_run!r}: it was re-projected differently"
            )
        while len(rows_of_batch) <= entry.row:
            rows_of_batch.append([])
        rows_of_batch[entry.row].append(sample)
    return collate(rows_of_batch)


def summary_table(recorded: TrainingStep) -> Table:
    """A rich table of a step: its samples (id, session, reward, advantage, length), metrics."""
    title = (
        f"training run {recorded.training_run} · step {recorded.step} · "
        f"model {recorded.model_version} · layout {recorded.layout}"
    )
    table = Table(title=title)
    for column in ("row", "sample", "session", "reward", "advantage", "tokens", "staleness"):
        table.add_column(column, justify="right" if column not in ("sample", "session") else "left")
    for s in recorded.samples:
        table.add_row(
            str(s.row),
            s.sample_id,
            s.session_id,
            f"{s.reward:.4g}",
            f"{s.advantage:+.4g}",
            str(s.n_tokens),
            str(s.staleness),
        )
    metrics = ", ".join(f"{k}={v:.4g}" for k, v in recorded.metrics.items())
    table.caption = f"metrics: {metrics}"
    return table


def replay_step_command(ctx: click.Context, training_run: str, step: int, out: Path | None) -> None:
    """`trajstore replay --training-run T --step N [--out FILE]`: rebuild, summarise, save."""
    from trajstore.store.embedded import database_url

    settings = ctx.find_root().ensure_object(dict)["settings"]

    async def run() -> tuple[TrainingStep, TensorDict]:
        async with open_store(database_url(settings)) as store:
            recorded = await read_step(store, training_run, step)
            return recorded, await rebuild_step(store, training_run, step)

    try:
        recorded, batch = asyncio.run(run())
    except TrainerError as exc:
        raise click.ClickException(str(exc)) from exc
    console = Console()
    console.print(summary_table(recorded))
    console.print(
        f"rebuilt batch: {batch.batch_size[0]} rows x {batch['input_ids'].shape[1]} tokens, "
        f"{int(batch['loss_mask'].sum())} trained tokens"
    )
    if out is not None:
        torch.save(batch, out)
        console.print(f"saved to {out} (load with torch.load(path, weights_only=False))")
