"""Rollout-level advantage: an outcome estimator over rollouts, not rows.

With the transition aggregator (or a trajectory that broke into several
rows) a rollout has several rows. Handing those rows to a group estimator
such as GRPO makes a rollout of 8 turns count 8 times in its group's mean
and standard deviation: the turn-count bias reported against the reference.
These wrappers compute the estimator on one representative per rollout, a
row whose reward is the rollout's reward (the mean of its rows' summed
``token_level_rewards``, see :func:`~agl_plugin_traces.filters.rollout_rewards`)
in the rollout's group, then give every row of the rollout that advantage
on its trainable tokens. The estimator math is agl_core's
(:mod:`agl_core.algorithms.advantages`), unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from agl_core.algorithms import advantages as A
from agl_core.data import Batch

from agl_plugin_traces.filters import rollout_rewards

# outcome estimator fn(token_level_rewards, response_mask, index, config) -> (advantages, returns)
OutcomeEstimator = Callable[[torch.Tensor, torch.Tensor, np.ndarray, object], tuple[torch.Tensor, torch.Tensor]]


def rollout_level(outcome: OutcomeEstimator) -> Callable[[Batch, object], tuple[torch.Tensor, torch.Tensor]]:
    """An estimator ``fn(batch, config) -> (advantages, returns)`` that applies ``outcome`` per rollout.

    The representatives are one-token rows, one per rollout: reward = the
    rollout's reward, group = its ``uid``. ``outcome`` returns one advantage
    per representative (the outcome estimators give every token of a row the
    same value); each row of the batch gets its rollout's advantage times its
    ``response_mask``. Returns are the advantages, as for the wrapped
    estimators.
    """

    def estimator(batch: Batch, config: object) -> tuple[torch.Tensor, torch.Tensor]:
        # token_level_rewards: the scores, minus the KL penalty when it is in the reward.
        rollout, reward = rollout_rewards(batch, "token_level_rewards")
        first_row = np.unique(rollout.numpy(), return_index=True)[1]  # rollouts are numbered by first row
        representatives = reward.to(batch["token_level_rewards"].dtype).unsqueeze(-1)
        advantage, _ = outcome(representatives, torch.ones_like(representatives), batch["uid"][first_row], config)
        advantages = advantage[:, 0][rollout].unsqueeze(-1) * batch["response_mask"]
        return advantages, advantages

    return estimator


ROLLOUT_ESTIMATORS = {
    "grpo_rollout": rollout_level(
        lambda r, m, index, config: A.grpo(r, m, index, norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)),
    "grpo_passk_rollout": rollout_level(
        lambda r, m, index, config: A.grpo_passk(r, m, index,
                                                 norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)),
    "rloo_rollout": rollout_level(lambda r, m, index, config: A.rloo(r, m, index)),
    "reinforce_plus_plus_baseline_rollout": rollout_level(
        lambda r, m, index, config: A.reinforce_plus_plus_baseline(r, m, index)),
}
"""The rollout-level estimators this plugin registers, by name."""
