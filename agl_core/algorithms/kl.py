"""KL penalty folded into the reward, with fixed or adaptive coefficient β.

    r_t <- score_t - β * KL_t(π_old || π_ref)

The adaptive controller is the one of Ziegler et al. 2019 (arXiv:1909.08593): β grows
when the measured KL is above target and shrinks when below, by at most 20% per horizon.
Matches ``FixedKLController``, ``AdaptiveKLController`` (verl/trainer/ppo/core_algos.py)
and ``apply_kl_penalty`` (verl/trainer/ppo/ray_trainer.py) of verl 0.9.1.
"""

import torch

from agl_core.algorithms.advantages import masked_mean
from agl_core.algorithms.losses import kl_penalty as kl_estimate

__all__ = ["AdaptiveKLController", "FixedKLController", "apply_kl_penalty"]


class FixedKLController:
    """Constant β: ``.value`` never changes."""

    def __init__(self, kl_coef: float):
        self.value = kl_coef

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers share one interface."""


class AdaptiveKLController:
    """Proportional controller steering the measured KL towards ``target_kl``.

        e = clip(KL / target - 1, -0.2, 0.2),     β <- β * (1 + e * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        self.value = init_kl_coef
        self.target = target_kl
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust β after ``n_steps`` samples whose mean KL was ``current_kl``."""
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.value *= 1 + error * n_steps / self.horizon


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_probs: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kl_penalty: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Subtract β times the per-token KL estimate from the scores, then update β.

    Args:
        token_level_scores, old_log_probs, ref_log_prob, response_mask: (B, T).
        kl_ctrl: controller holding β; updated in place with the batch's KL and
            ``n_steps = B``, after β was read for this batch.
        kl_penalty: estimator name, see ``agl_core.algorithms.losses.kl_penalty``.

    Returns:
        ``(token_level_rewards (B, T), metrics)`` with
        ``actor/reward_kl_penalty``: the KL averaged over each row's tokens, then over
        rows (empty rows count as 0), and ``actor/reward_kl_penalty_coeff``: the β used.
    """
    kl = kl_estimate(old_log_probs, ref_log_prob, kl_penalty) * response_mask
    beta = kl_ctrl.value
    token_level_rewards = token_level_scores - beta * kl
    current_kl = masked_mean(kl, response_mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl=current_kl, n_steps=token_level_scores.shape[0])
    metrics = {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}
    return token_level_rewards, metrics
