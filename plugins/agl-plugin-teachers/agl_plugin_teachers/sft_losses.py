"""Supervised fine-tuning as a policy loss: the token negative log-likelihood of the rows kept.

``sft`` is the NLL alone (rejection-sampling fine-tuning when a filter keeps
the good rows); ``sft_ppo`` adds ``coef`` times it to the PPO clipped objective
(the built-in ``vanilla`` loss), so the policy learns from the reward and
imitates its successes at once. Both follow the registered-loss signature
(:func:`agl_core.hookspecs.register_policy_losses`); ``sft_mask`` (per token,
1 on the kept rows) comes from the ``sft`` plugin's stage.
"""

from __future__ import annotations

import torch

from agl_core.algorithms.losses import agg_loss, ppo_clip_loss


def token_nll(log_prob: torch.Tensor, mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """``-log p`` of the masked tokens, aggregated like every loss (``loss_agg_mode``); 0 when none is masked."""
    if not mask.bool().any():
        return (log_prob * 0).sum()  # no kept token in this micro-batch: no gradient, never NaN
    return agg_loss(-log_prob, mask, loss_agg_mode)


def sft_loss(old_log_prob, log_prob, advantages, response_mask, config, sft_mask=None, rollout_is_weights=None):
    """The policy loss ``sft``: the token NLL of the response tokens of the kept rows."""
    mask = response_mask if sft_mask is None else response_mask * sft_mask
    nll = token_nll(log_prob, mask, config.loss_agg_mode)
    return nll, {"sft_nll": nll.item()}


def sft_ppo_loss(old_log_prob, log_prob, advantages, response_mask, config, coef: float = 1.0, sft_mask=None,
                 rollout_is_weights=None):
    """The policy loss ``sft_ppo``: PPO's clipped objective plus ``coef`` times :func:`sft_loss`."""
    pg_loss, metrics = ppo_clip_loss(
        old_log_prob, log_prob, advantages, response_mask, clip_ratio=config.clip_ratio,
        clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode, rollout_is_weights=rollout_is_weights)
    nll, _ = sft_loss(old_log_prob, log_prob, advantages, response_mask, config, sft_mask)
    return pg_loss + coef * nll, {**metrics, "sft_nll": nll.item(), "ppo_loss": pg_loss.item()}
