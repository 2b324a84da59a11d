"""Logprobs through the output layer in chunks (`trainer.logprobs`) and the learner's memory
options, on the CPU: the same logprobs and gradients as the full logits, the same step with
gradient checkpointing, and a 16 k-token sample trained within a stated memory bound."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.trainer.test_learner_unit import samples
from trajstore.tiny_model import build_tiny_model
from trajstore.trainer.activations import checkpointed_layers
from trajstore.trainer.collate import collate
from trajstore.trainer.errors import TrainerError
from trajstore.trainer.learner import Learner, LearnerConfig
from trajstore.trainer.logprobs import chunked_logprobs, needed_positions, row_logprobs
from trajstore.trainer.loss import policy_loss, token_logprobs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.mark.parametrize("chunk_tokens", [1, 5, 64, 1000])
def test_chunked_logprobs_and_gradients_equal_the_full_log_softmax(chunk_tokens: int) -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=generator, requires_grad=True)
    weight = torch.randn(300, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (37,), generator=generator)
    upstream = torch.randn(37, generator=generator)  # a per-token gradient, as a loss gives

    full = torch.log_softmax(hidden @ weight.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    full_grads = torch.autograd.grad((full * upstream).sum(), (hidden, weight))
    chunked = chunked_logprobs(hidden, weight, targets, chunk_tokens=chunk_tokens)
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))

    torch.testing.assert_close(chunked, full, atol=1e-5, rtol=0)
    for got, expected in zip(chunked_grads, full_grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_row_logprobs_line_up_with_token_logprobs_and_skip_unneeded_tokens() -> None:
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 9, 8, generator=generator)
    weight = torch.randn(50, 8, generator=generator)
    input_ids = torch.randint(0, 50, (2, 9), generator=generator)
    needed = torch.rand(2, 9, generator=generator) > 0.3
    expected = token_logprobs(hidden @ weight.T, input_ids)
    got = row_logprobs(hidden, weight, input_ids, needed, chunk_tokens=4)
    keep = needed.clone()
    keep[:, 0] = False
    torch.testing.assert_close(got[keep], expected[keep], atol=1e-5, rtol=0)
    assert (got[~keep] == 0).all()  # never computed: nothing asks for them


@pytest.mark.parametrize("packed", [False, True])
def test_the_learner_chunked_gives_the_full_logprobs_and_gradients(
    model_dir: Path, packed: bool
) -> None:
    parts = samples([40, 64, 23, 51])
    batch = collate([parts[:3], parts[3:]] if packed else [[s] for s in parts])
    full = Learner.load(model_dir, LearnerConfig(device="cpu", logprobs="full"))
    chunked = Learner.load(
        model_dir, LearnerConfig(device="cpu", logprobs="chunked", logprob_chunk_tokens=16)
    )
    needed = needed_positions(batch["loss_mask"], batch["position_ids"])
    results = []
    for learner in (full, chunked):
        logprobs = learner.logprobs(batch, packed=packed)
        # A ratio away from 1 and mixed advantages: every token's gradient differs.
        old = logprobs.detach() + 0.05 * torch.randn(logprobs.shape, generator=_seeded(2))
        loss, _ = policy_loss(logprobs, batch, old_logprobs=old)
        grads = torch.autograd.grad(loss, list(learner.model.parameters()))
        results.append((logprobs.detach(), loss.detach(), grads))
    (lp_full, loss_full, g_full), (lp_chunked, loss_chunked, g_chunked) = results
    torch.testing.assert_close(lp_chunked[needed], lp_full[needed], atol=1e-5, rtol=0)
    torch.testing.assert_close(loss_chunked, loss_full, atol=1e-6, rtol=1e-5)
    for got, expected in zip(g_chunked, g_full, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in g_chunked) > 0


@pytest.mark.parametrize(("mode", "layers"), [("full", None), ("selective", None), ("full", 1)])
def test_gradient_checkpointing_takes_the_same_step(
    model_dir: Path, mode: str, layers: int | None
) -> None:
    batch = collate([[s] for s in samples([30, 64, 17])])
    plain = Learner.load(model_dir, LearnerConfig(device="cpu"))
    config = LearnerConfig(
        device="cpu", gradient_checkpointing=True, checkpoint_mode=mode, checkpoint_layers=layers
    )
    checkpointed = Learner.load(model_dir, config)
    on = [layer.gradient_checkpointing for layer in checkpointed_layers(checkpointed.model)]
    assert on == ([True, True] if layers is None else [True, False])  # the tiny model's 2
    assert not any(layer.gradient_checkpointing for layer in checkpointed_layers(plain.model))
    m_plain = plain.step(plain.prepare(batch))
    m_checkpointed = checkpointed.step(checkpointed.prepare(batch))
    assert m_checkpointed["loss"] == pytest.approx(m_plain["loss"], rel=1e-6, abs=1e-8)
    assert m_checkpointed["grad_norm"] == pytest.approx(m_plain["grad_norm"], rel=1e-5)
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_row_longer_than_the_micro_budget_goes_alone_and_whole(model_dir: Path) -> None:
    batch = collate([[s] for s in samples([90, 20, 25, 12])])
    learner = Learner.load(model_dir, LearnerConfig(device="cpu", micro_token_budget=50))
    prepared = learner.prepare(batch)
    widths = [(m.tensors.batch_size[0], m.tensors["input_ids"].shape[1]) for m in prepared.micro]
    assert widths[0] == (1, 90)  # over the budget: alone, not cut
    assert sum(rows for rows, _ in widths) == 4 and all(w <= 50 for _, w in widths[1:])
    assert sum(m.trained_tokens for m in prepared.micro) == int(
        (batch["loss_mask"] & torch.isfinite(batch["logprobs"])).sum()
    )
    assert learner.step(prepared)["micro_batches"] == len(prepared.micro)


def test_an_unknown_logprobs_mode_is_named() -> None:
    with pytest.raises(TrainerError, match="unknown logprobs 'fast': use one of chunked, full"):
        LearnerConfig(logprobs="fast")
    with pytest.raises(TrainerError, match="unknown checkpoint_mode 'some': use one of full, sel"):
        LearnerConfig(checkpoint_mode="some")
    with pytest.raises(TrainerError, match="checkpoint_layers=4 needs gradient_checkpointing"):
        LearnerConfig(checkpoint_layers=4)  # would be ignored: said, not silently


def test_liger_without_its_package_says_what_to_use(model_dir: Path) -> None:
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("liger-kernel is installed here: the GPU benchmark measures that path")
    learner = Learner.load(model_dir, LearnerConfig(device="cpu", logprobs="liger"))
    with pytest.raises(TrainerError, match=r"needs the liger-kernel package.*'chunked'"):
        learner.logprobs(collate([samples([20])]), packed=False)


#: The 16 k-token step, in a fresh process so that its peak RSS is its own. The model has a
#: scaled-down but wide vocabulary (32,768 ids): one [16 k, vocab] float32 tensor is 2.1 GB, the
#: full path keeps several; the chunked path with checkpointing must stay under BOUND_MB.
LONG_STEP = textwrap.dedent(
    """
    import json, resource, sys, uuid
    import numpy as np, torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trajstore.trainer.collate import ReplaySample, collate
    from trajstore.trainer.learner import Learner, LearnerConfig

    tokens, vocab = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=tokens, tie_word_embeddings=True)
    learner = Learner(Qwen2ForCausalLM(config), LearnerConfig(
        device="cpu", gradient_checkpointing=True, logprob_chunk_tokens=512))
    rng = np.random.default_rng(0)
    mask = (np.arange(tokens) >= tokens // 4).astype(np.uint8)
    sample = ReplaySample(uuid.uuid4(), "s", rng.integers(3, vocab, tokens).astype(np.int32),
                          mask, np.where(mask == 1, -2.0, 0.0).astype(np.float32),
                          1.0, 1.0, 0, 0)
    prepared = learner.prepare(collate([[sample]]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    metrics = learner.step(prepared)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mb": (after - before) / 1024, "loss": metrics["loss"],
                      "tokens": metrics["tokens"], "grad_norm": metrics["grad_norm"]}))
    """
)
BOUND_MB = 512  # a quarter of ONE full-logits tensor of this step (2,048 MiB); measured 77-166


@pytest.mark.slow
def test_a_16k_token_sample_trains_on_the_cpu_within_a_memory_bound() -> None:
    tokens, vocab = 16_384, 32_768
    done = subprocess.run(
        [sys.executable, "-c", LONG_STEP, str(tokens), str(vocab)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    full_logits_mb = tokens * vocab * 4 / 2**20
    assert figures["tokens"] == tokens - tokens // 4  # every generated token trained, none cut
    assert torch.isfinite(torch.tensor(figures["loss"])) and figures["grad_norm"] > 0
    assert figures["peak_growth_mb"] < BOUND_MB <= full_logits_mb / 4, figures


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
