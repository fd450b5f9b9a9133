"""Off-policy correction between the policy that served the rollouts and the trainer's old policy.

In asynchronous training (and whenever the serving engine's numerics differ
from the trainer's) a response was sampled by π_rollout, the weights that
served the call, while PPO's ratio is taken against π_old, the trainer's
weights at the step. Truncated importance sampling (TIS) reweights each
response token's policy-gradient loss by ``min(π_old / π_rollout, cap)``, the
ratio of that token or of the whole response.

Shapes are ``(B, T)``: B responses, T response tokens; masks are 0/1.
"""

from __future__ import annotations

import torch

SAFETY_BOUND = 20.0
"""The log-ratio is clamped to ±this before ``exp`` (verl's ``SAFETY_BOUND``): weights stay finite."""

LEVELS = ("token", "sequence")
"""What one weight covers: a response token, or a whole response (verl's ``rollout_is``)."""


def tis_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
                cap: float, level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance weights ``min(exp(clamp(log-ratio, ±20)), cap)``, per token or per response.

    ``level="token"``: the log-ratio of each token, ``log π_old - log π_rollout``.
    ``level="sequence"``: the sum of a response's token log-ratios (the
    ratio of the whole response's probabilities), the same weight on each of
    its tokens. A multi-turn trajectory's earlier answers made the state a
    later token was sampled in; the token level corrects only the token's own
    draw, the sequence level the whole trajectory's, with more variance.

    Zero on the tokens ``response_mask`` leaves out, and detached: the
    weights change the measure, not the objective, so no gradient flows
    through them. Equals ``compute_rollout_correction_weights(log_ratio,
    mask, rollout_is=level, rollout_is_threshold=cap)`` of verl 0.9.1.

    Metrics of the weights before the cap (``rollout_corr/tis_mean``,
    ``rollout_corr/tis_max``) and the share the cap cut
    (``rollout_corr/tis_capped_share``): over the masked tokens, or over
    the responses at the sequence level.
    """
    if cap <= 0:
        raise ValueError(f"the TIS cap (algorithm.rollout_correction.rollout_is_threshold) must be > 0, got {cap}")
    if level not in LEVELS:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be one of {LEVELS}, got {level!r}")
    if old_log_probs.shape != rollout_log_probs.shape or old_log_probs.shape != response_mask.shape:
        raise ValueError(f"old log-probs {tuple(old_log_probs.shape)}, rollout log-probs "
                         f"{tuple(rollout_log_probs.shape)} and response mask {tuple(response_mask.shape)} "
                         f"must have the same shape")
    log_ratio = old_log_probs - rollout_log_probs
    if level == "sequence":
        log_ratio = torch.where(response_mask.bool(), log_ratio, 0.0).sum(dim=-1, keepdim=True)
    ratio = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))  # (B, T), or (B, 1) per response
    weights = (ratio.expand_as(response_mask) * response_mask).clamp(max=cap).detach()
    # The metrics count the weights before the cap: of the masked tokens, or of the responses with any.
    units = ratio[response_mask.bool()] if level == "token" else ratio[response_mask.bool().any(dim=-1), 0]
    metrics: dict[str, float] = {}
    if units.numel():
        metrics = {"rollout_corr/tis_mean": units.mean().item(), "rollout_corr/tis_max": units.max().item(),
                   "rollout_corr/tis_capped_share": (units > cap).float().mean().item()}
    return weights, metrics
