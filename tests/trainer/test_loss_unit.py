"""The off-policy loss on hand-computable cases (no I/O)."""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

from trajstore.trainer.loss import LossConfig, policy_loss, token_logprobs


def batch(
    behaviour: list[float], advantages: list[float], mask: list[bool] | None = None
) -> TensorDict:
    n = len(behaviour)
    return TensorDict(
        {
            "logprobs": torch.tensor([behaviour]),
            "advantages": torch.tensor([advantages]),
            "loss_mask": torch.tensor([mask or [True] * n]),
        },
        batch_size=[1],
    )


def test_equal_logprobs_give_ratio_one_and_minus_the_mean_advantage() -> None:
    b = batch([-1.0, -2.0, -0.5], [1.0, 2.0, -0.5])
    loss, metrics = policy_loss(b["logprobs"].clone(), b)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 - 0.5) / 3)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["kl_k3"] == pytest.approx(0.0)


def test_a_ratio_above_one_plus_eps_is_clipped_for_a_positive_advantage() -> None:
    b = batch([-1.0], [1.0])
    logprobs = (b["logprobs"] + math.log(1.5)).requires_grad_()
    loss, metrics = policy_loss(logprobs, b, config=LossConfig(clip_high=0.2))
    assert loss.item() == pytest.approx(-1.2)  # min(1.5 * 1, 1.2 * 1)
    loss.backward()
    assert logprobs.grad is not None
    assert logprobs.grad.abs().sum().item() == 0.0  # clipped: no push further up
    assert metrics["clip_fraction"] == 1.0
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_a_high_ratio_is_not_clipped_for_a_negative_advantage() -> None:
    b = batch([-1.0], [-1.0])
    loss, metrics = policy_loss(b["logprobs"] + math.log(1.5), b)
    assert loss.item() == pytest.approx(1.5)  # -min(-1.5, -1.2): the pessimistic term
    assert metrics["clip_fraction"] == 0.0


def test_the_tis_cap_truncates_the_importance_weight() -> None:
    b = batch([-3.0, -1.0], [1.0, 1.0])
    old = torch.tensor([[-3.0 + math.log(5.0), -1.0 + math.log(1.5)]])  # weights 5 and 1.5
    loss, metrics = policy_loss(old.clone(), b, old_logprobs=old, config=LossConfig(tis_cap=2.0))
    assert loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert metrics["tis_truncated_fraction"] == 0.5
    uncapped, _ = policy_loss(old.clone(), b, old_logprobs=old, config=LossConfig(tis_cap=None))
    assert uncapped.item() == pytest.approx(-(5.0 + 1.5) / 2)


def test_masked_and_unreported_tokens_do_not_count() -> None:
    b = batch([-1.0, float("nan"), -1.0], [1.0, 100.0, 100.0], mask=[True, True, False])
    loss, metrics = policy_loss(b["logprobs"].nan_to_num(), b)
    assert loss.item() == pytest.approx(-1.0)
    assert metrics["tokens"] == 1.0
    assert metrics["missing_behaviour_fraction"] == 0.5


def test_k3_estimates_the_kl_between_behaviour_and_current_policy() -> None:
    b = batch([-1.0], [0.0])
    _, metrics = policy_loss(b["logprobs"] + 0.5, b)
    assert metrics["kl_k3"] == pytest.approx(math.exp(0.5) - 1 - 0.5)


def test_token_logprobs_line_up_with_the_tokens_they_score() -> None:
    logits = torch.log(torch.tensor([[[0.1, 0.9], [0.7, 0.3], [0.5, 0.5]]]))
    result = token_logprobs(logits, torch.tensor([[0, 1, 0]]))
    assert result[0].tolist() == pytest.approx([0.0, math.log(0.9), math.log(0.7)])


@pytest.mark.parametrize("kwargs", [{"clip_low": 1.0}, {"tis_cap": 0.0}, {"clip_high": -0.1}])
def test_bad_configs_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        LossConfig(**kwargs)


def test_tokens_older_than_the_lag_leave_the_loss_per_token() -> None:
    # One turn cut by a weight switch: its first two tokens by v3, the last two by v5; the
    # trainer is at v5. With max_token_lag 1, only the v5 tokens are trained on.
    b = batch([-1.0, -1.0, -1.0, -1.0], [4.0, 4.0, 1.0, 1.0])
    b["token_staleness"] = torch.tensor([[2, 2, 0, 0]], dtype=torch.int32)
    loss, metrics = policy_loss(b["logprobs"].clone(), b, config=LossConfig(max_token_lag=1))
    assert loss.item() == pytest.approx(-1.0)  # the mean advantage of the last two tokens
    assert metrics["tokens"] == 2.0 and metrics["stale_token_fraction"] == 0.5
    everything, _ = policy_loss(b["logprobs"].clone(), b)
    assert everything.item() == pytest.approx(-2.5)
