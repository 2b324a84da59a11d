"""The learner on the CPU: per-sample attention in packed rows, micro-batches, device, autocast,
prefetch (no database: batches collated from samples made here, the generated tiny model)."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch

from trajstore.tiny_model import build_tiny_model
from trajstore.trainer.collate import ReplaySample, collate
from trajstore.trainer.device import resolve_device
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.prefetch import Waits, prefetched


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def samples(lengths: list[int], seed: int = 0) -> list[ReplaySample]:
    """Samples of random tokens, a quarter of each a prompt, with behaviour logprobs."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = (np.arange(n) >= n // 4).astype(np.uint8)
        out.append(
            ReplaySample(
                uuid.uuid4(), f"s{i}", rng.integers(3, 500, n).astype(np.int32), mask,
                np.where(mask == 1, -2.0, 0.0).astype(np.float32),
                float(i % 2), 1.0 if i % 2 else -1.0, 0, 0,
            )
        )  # fmt: skip
    return out


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_a_packed_row_gives_each_sample_the_logprobs_it_has_alone(
    model_dir: Path, attention: str
) -> None:
    learner = Learner.load(model_dir, LearnerConfig(device="cpu", attention=attention))
    parts = samples([37, 50, 9, 61])
    packed = collate([parts[:3], parts[3:]])  # row 0: three samples, row 1: one, padded
    with torch.no_grad():
        together = learner.logprobs(packed, packed=True)
        for sample in parts:
            row = packed.get_non_tensor("samples")
            entry = next(e for e in row if e["sample_id"] == str(sample.sample_id))
            start = sum(e["n_tokens"] for e in row if e["row"] == entry["row"] and
                        row.index(e) < row.index(entry))  # fmt: skip
            alone_batch = collate([[sample]])
            alone = learner.logprobs(alone_batch, packed=False)[0]
            got = together[entry["row"], start : start + len(sample.token_ids)]
            torch.testing.assert_close(got, alone, atol=2e-5, rtol=1e-5)
    assert not torch.isnan(together).any()  # padding attends to itself: no NaN to poison a sum


def test_micro_batches_take_the_same_step_as_the_whole_batch(model_dir: Path) -> None:
    batch = collate([[s] for s in samples([20, 64, 33, 48, 12, 40])])
    whole = Learner.load(model_dir, LearnerConfig(device="cpu"))
    micro = Learner.load(model_dir, LearnerConfig(device="cpu", micro_token_budget=100))
    prepared_whole, prepared_micro = whole.prepare(batch), micro.prepare(batch)
    assert len(prepared_whole.micro) == 1
    assert len(prepared_micro.micro) >= 3  # 100 tokens: at most two rows of 48
    # Each micro-batch is cut to its own longest row: less padding than the batch had.
    cells = sum(m.tensors["input_ids"].numel() for m in prepared_micro.micro)
    assert cells < batch["input_ids"].numel()
    m_whole = whole.step(prepared_whole)
    m_micro = micro.step(prepared_micro)
    assert m_micro["tokens"] == m_whole["tokens"]
    assert m_micro["loss"] == pytest.approx(m_whole["loss"], rel=1e-4, abs=1e-6)
    for a, b in zip(whole.model.parameters(), micro.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # a step is ~3e-3


def test_devices_resolve_and_a_missing_gpu_is_named() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    if not torch.cuda.is_available():
        with pytest.raises(TrainerError, match=r"sees no CUDA GPU.*--device cpu"):
            resolve_device("cuda")
    with pytest.raises(TrainerError, match="unknown device"):
        resolve_device("tpu")


def test_autocast_computes_in_bf16_and_keeps_float32_master_weights(model_dir: Path) -> None:
    plain = Learner.load(model_dir, LearnerConfig(device="cpu"))
    mixed = Learner.load(model_dir, LearnerConfig(device="cpu", autocast=True))
    assert not plain.autocast  # off on the CPU unless asked
    batch = collate([[s] for s in samples([30, 45])])
    with torch.no_grad():
        exact = plain.logprobs(batch, packed=False)
        rounded = mixed.logprobs(batch, packed=False)
    assert not torch.equal(exact, rounded)  # bf16 did compute the passes
    torch.testing.assert_close(rounded, exact, atol=0.1, rtol=0.05)
    before = [p.detach().clone() for p in mixed.model.parameters()]
    metrics = mixed.step(mixed.prepare(batch))
    assert np.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in mixed.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, mixed.model.parameters(), strict=True))


async def test_prefetch_prepares_the_next_item_while_the_step_runs() -> None:
    next_prepared = threading.Event()

    async def source() -> AsyncIterator[int]:
        for i in range(4):
            yield i

    def prepare(item: int) -> int:
        if item == 1:
            next_prepared.set()
        return item * 10

    got, waits = [], Waits()
    async for item, prepared in prefetched(source(), prepare, depth=1, waits=waits):
        if item == 0:
            # The step of item 0 runs (in a thread, as the recipe runs it); item 1 is prepared
            # meanwhile. Serially, this would wait forever.
            assert await asyncio.to_thread(next_prepared.wait, 10)
        got.append((item, prepared))
    assert got == [(0, 0), (1, 10), (2, 20), (3, 30)]
    assert len(waits.seconds) == 5  # one wait per item, and the one that found the end


async def test_prefetch_raises_a_failure_where_the_item_would_have_come() -> None:
    async def source() -> AsyncIterator[int]:
        yield 1
        raise TrainerError("the store went away")

    got = []

    async def consume() -> None:
        async for item, _ in prefetched(source(), lambda i: i, depth=2):
            got.append(item)

    with pytest.raises(TrainerError, match="went away"):
        await consume()
    assert got == [1]


def test_training_packed_rows_with_flex_on_the_cpu_says_what_to_use(model_dir: Path) -> None:
    learner = Learner.load(model_dir, LearnerConfig(device="cpu", attention="flex"))
    prepared = learner.prepare(collate([samples([20, 30])]))
    with pytest.raises(TrainerError, match=r"no backward pass on the CPU.*attention='sdpa'"):
        learner.step(prepared)
