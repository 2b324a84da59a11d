"""The off-policy policy loss: PPO's clipped ratio and truncated importance sampling (TIS).

Three policies meet in a step, per token t of a generated completion:

    pi_behaviour  the inference engine's policy that sampled the token: its logprob is recorded
                  (`batch["logprobs"]`);
    pi_old        the trainer's policy at the start of the step (`old_logprobs`, computed by
                  the trainer without gradients); when not given, pi_old is pi_behaviour;
    pi_theta      the policy being trained (`logprobs`, with gradients).

    ratio  r = pi_theta / pi_old        clipped to [1 - clip_low, 1 + clip_high] (PPO)
    weight w = min(pi_old / pi_behaviour, tis_cap), no gradient                 (TIS)
    loss     = - sum_t mask_t * w_t * min(r_t A_t, clip(r_t) A_t) / sum_t mask_t

The weight corrects for the engine and the trainer not computing the same probabilities (other
kernels, precision, or an older policy version for off-policy samples); truncating it at
`tis_cap` bounds the variance a rare token could add. The loss is a token mean over every trained
token of the batch (long completions weigh more than short ones, as in DAPO).

Tokens trained on: `loss_mask` true and a finite behaviour logprob. A generated token whose
logprob the engine did not report (NaN) is left out and counted (`missing_behaviour_fraction`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict


@dataclass(frozen=True)
class LossConfig:
    """The knobs of `policy_loss`; the defaults are PPO's usual clip and a TIS cap of 2."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    tis_cap: float | None = 2.0  #: None: no importance weight at all (w = 1)

    def __post_init__(self) -> None:
        if self.clip_low < 0 or self.clip_high < 0:
            raise ValueError("clip_low and clip_high must be >= 0")
        if self.clip_low >= 1:
            raise ValueError("clip_low must be below 1 (the ratio's lower bound is 1 - clip_low)")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError("tis_cap must be > 0, or None to switch TIS off")


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """`[rows, length]`: the logprob of each token given the ones before it (0 at position 0).

    Logits at position t predict token t + 1; the result is shifted back so that it lines up with
    `input_ids`, `loss_mask` and the behaviour `logprobs` of a batch.
    """
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(picked, (1, 0))


def policy_loss(
    logprobs: torch.Tensor,
    batch: TensorDict,
    *,
    old_logprobs: torch.Tensor | None = None,
    config: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of the module docstring, and the metrics that show the correction at work.

    Metrics: `ratio_mean`, `ratio_max` (of r), `clip_fraction` (tokens whose clipped term was
    chosen and differs), `kl_k3` (Schulman's k3 estimate of KL(pi_behaviour || pi_theta)),
    `tis_truncated_fraction` (tokens whose weight hit the cap), `tis_weight_mean`,
    `missing_behaviour_fraction`, `tokens` (how many were trained on).
    """
    loss, metrics = policy_loss_terms(logprobs, batch, old_logprobs=old_logprobs, config=config)
    return loss, {key: float(value) for key, value in metrics.items()}


def policy_loss_terms(
    logprobs: torch.Tensor,
    batch: TensorDict,
    *,
    old_logprobs: torch.Tensor | None = None,
    config: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`policy_loss` with its metrics left as 0-d tensors on the batch's device.

    Reading a GPU tensor's value waits for the GPU: the learner reads a step's metrics once,
    after all its micro-batches, so that the host queues the next pass while the GPU computes.
    """
    config = config or LossConfig()
    behaviour = batch["logprobs"]
    advantages = batch["advantages"]
    known = torch.isfinite(behaviour)
    mask = batch["loss_mask"] & known
    behaviour = torch.where(known, behaviour, torch.zeros_like(behaviour))
    old = behaviour if old_logprobs is None else old_logprobs.detach()
    n_tokens = mask.sum().clamp(min=1)

    ratio = torch.exp(logprobs - old)
    clipped = ratio.clamp(1 - config.clip_low, 1 + config.clip_high)
    surrogate = torch.minimum(ratio * advantages, clipped * advantages)
    raw_weight = torch.exp(old - behaviour)
    weight = raw_weight if config.tis_cap is None else raw_weight.clamp(max=config.tis_cap)
    loss = -(weight * surrogate * mask).sum() / n_tokens

    with torch.no_grad():
        m = mask.float()
        log_r = (logprobs - behaviour).detach()  # log pi_theta / pi_behaviour
        k3 = torch.exp(log_r) - 1 - log_r
        chose_clip = (clipped * advantages < ratio * advantages) & mask
        truncated = (
            (raw_weight > config.tis_cap) & mask
            if config.tis_cap is not None
            else torch.zeros_like(mask)
        )
        # The largest ratio among trained tokens, 1 when there are none (no boolean indexing:
        # its result's size would have to be read from the device).
        highest = torch.where(mask, ratio.detach(), torch.full_like(ratio, -torch.inf)).amax()
        metrics = {
            "ratio_mean": (ratio.detach() * m).sum() / n_tokens,
            "ratio_max": torch.where(mask.any(), highest, torch.ones_like(highest)),
            "clip_fraction": chose_clip.sum() / n_tokens,
            "kl_k3": (k3 * m).sum() / n_tokens,
            "tis_truncated_fraction": truncated.sum() / n_tokens,
            "tis_weight_mean": (weight * m).sum() / n_tokens,
            "missing_behaviour_fraction": (batch["loss_mask"] & ~known).sum()
            / batch["loss_mask"].sum().clamp(min=1),
            "tokens": mask.sum().float(),
        }
    return loss, metrics
