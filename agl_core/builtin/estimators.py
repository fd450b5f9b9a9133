"""Built-in plugin ``estimators``: the advantage estimators, the PPO loss, and the ``advantage`` slot.

The math is in :mod:`agl_core.algorithms`; this module adapts it to the
estimator signature ``fn(batch, config) -> (advantages, returns)``.
"""

from __future__ import annotations

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import checked_estimator_result
from agl_core.lazy_import import LazyModule

AGL_HOOK_API = HOOK_API_VERSION
# The math imports torch: imported when an estimator or the loss first runs, not with the plugin.
A = LazyModule("agl_core.algorithms.advantages", globals(), "A")
losses = LazyModule("agl_core.algorithms.losses", globals())


def _gae(batch, config):
    return A.gae(batch["token_level_rewards"], batch["values"], batch["response_mask"], config.gamma, config.lam)


def _grpo(batch, config):
    return A.grpo(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                  norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)


def _grpo_passk(batch, config):
    return A.grpo_passk(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                        norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)


def _rloo(batch, config):
    return A.rloo(batch["token_level_rewards"], batch["response_mask"], batch["uid"])


def _reinforce_plus_plus(batch, config):
    return A.reinforce_plus_plus(batch["token_level_rewards"], batch["response_mask"], config.gamma)


def _reinforce_plus_plus_baseline(batch, config):
    return A.reinforce_plus_plus_baseline(batch["token_level_rewards"], batch["response_mask"], batch["uid"])


def _remax(batch, config):
    return A.remax(batch["token_level_rewards"], batch["reward_baselines"], batch["response_mask"])


@hookimpl
def register_estimators(register):
    register("gae", _gae, needs_critic=True)
    register("grpo", _grpo)
    register("grpo_passk", _grpo_passk)
    register("rloo", _rloo)
    register("reinforce_plus_plus", _reinforce_plus_plus)
    register("reinforce_plus_plus_baseline", _reinforce_plus_plus_baseline)
    register("remax", _remax)


@hookimpl
def register_policy_losses(register):
    register("vanilla", vanilla_policy_loss)


def vanilla_policy_loss(old_log_prob, log_prob, advantages, response_mask, config, rollout_is_weights=None):
    """The policy loss ``vanilla``: the PPO clipped objective with the recipe's ``algorithm.policy_loss`` bounds.

    ``rollout_is_weights`` (per token) are the off-policy correction's, when ``algorithm.rollout_correction`` is on.
    """
    return losses.ppo_clip_loss(
        old_log_prob, log_prob, advantages, response_mask,
        clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low,
        clip_ratio_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c,
        loss_agg_mode=config.loss_agg_mode, rollout_is_weights=rollout_is_weights,
    )


@hookimpl
def advantage(ctx, batch):
    config = ctx.config.algorithm
    estimator = ctx.components.get("estimator", config.estimator)
    batch["advantages"], batch["returns"] = checked_estimator_result(estimator, estimator.obj(batch, config), batch)
    return batch
