"""Off-policy correction between the policy that served the rollouts and the trainer's old policy.

In asynchronous training (and whenever the serving engine's numerics differ
from the trainer's) a response was sampled by π_rollout, the weights that
served the call, while PPO's ratio is taken against π_old, the trainer's
weights at the step. Truncated importance sampling (TIS) reweights each
response token's policy-gradient loss by ``min(π_old / π_rollout, cap)``.

Shapes are ``(B, T)``: B responses, T response tokens; masks are 0/1.
"""

from __future__ import annotations

import torch

from agl_core.algorithms.advantages import masked_mean

SAFETY_BOUND = 20.0
"""The log-ratio is clamped to ±this before ``exp`` (verl's ``SAFETY_BOUND``): weights stay finite."""


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level truncated importance weights ``min(exp(clamp(log π_old - log π_rollout, ±20)), cap)``.

    Zero on the tokens ``response_mask`` leaves out, and detached: the
    weights change the measure, not the objective, so no gradient flows
    through them. Equals ``compute_rollout_correction_weights(log_ratio,
    mask, rollout_is="token", rollout_is_threshold=cap)`` of verl 0.9.1.

    Metrics, over the masked tokens, of the weights before the cap
    (``rollout_corr/tis_mean``, ``rollout_corr/tis_max``) and the share of
    tokens whose weight the cap cut (``rollout_corr/tis_capped_share``).
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap (algorithm.rollout_correction.rollout_is_threshold) must be > 0, got {cap}")
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"old log-probs {tuple(old_log_probs.shape)}, rollout log-probs "
                         f"{tuple(rollout_log_probs.shape)} and response mask {tuple(response_mask.shape)} "
                         f"must have the same shape")
    log_ratio = torch.clamp(old_log_probs - rollout_log_probs, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    raw = torch.exp(log_ratio) * response_mask
    weights = raw.clamp(max=cap).detach()
    mask = response_mask.bool()
    metrics: dict[str, float] = {}
    if mask.any():
        metrics = {"rollout_corr/tis_mean": masked_mean(raw, response_mask).item(),
                   "rollout_corr/tis_max": raw[mask].max().item(),
                   "rollout_corr/tis_capped_share": masked_mean((raw > cap).float(), response_mask).item()}
    return weights, metrics
