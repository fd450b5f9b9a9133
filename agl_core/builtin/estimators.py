"""Built-in plugin ``estimators``: the advantage estimators, the PPO loss, and the ``advantage`` slot.

The math is in :mod:`agl_core.algorithms`; this module adapts it to the
estimator signature ``fn(batch, config) -> (advantages, returns)``, or
``fn(batch, config, ctx)`` for the step-level ones (``gigpo``, ``turn_grpo``),
which report their groups in the step's metrics.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import call_estimator
from agl_core.lazy_import import LazyModule

AGL_HOOK_API = HOOK_API_VERSION
# The math imports torch: imported when an estimator or the loss first runs, not with the plugin.
A = LazyModule("agl_core.algorithms.advantages", globals(), "A")
T = LazyModule("agl_core.algorithms.turn_advantages", globals(), "T")
batch_calls = LazyModule("agl_core.builtin.batch_calls", globals())
losses = LazyModule("agl_core.algorithms.losses", globals())
torch = LazyModule("torch", globals())
np = LazyModule("numpy", globals())


class GiGPOConfig(BaseModel):
    """``plugins.estimators.gigpo``: GiGPO's own settings (its discount is ``algorithm.gamma``)."""

    model_config = ConfigDict(extra="forbid")
    step_weight: float = Field(1.0, ge=0, description="omega: weight of the step-level advantage against the "
                                                      "episode-level one (A = A_episode + omega * A_step)")
    mode: Literal["mean_norm", "mean_std_norm"] = Field(
        "mean_norm", description="mean_norm: advantages are centred within their groups; mean_std_norm: also "
                                 "divided by the group's std (verl-agent's algorithm.gigpo.mode)")
    epsilon: float = Field(1e-6, gt=0, description="added to a group's std before dividing by it")


class EstimatorsConfig(BaseModel):
    """The recipe section ``plugins.estimators`` of the built-in estimators."""

    model_config = ConfigDict(extra="forbid")
    gigpo: GiGPOConfig = Field(default_factory=GiGPOConfig)


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


@contextlib.contextmanager
def _one_thread():
    """torch's intra-op parallelism off for the step-level math over calls. Most of it is NumPy's (one thread);
    the torch ops left (the masks where only some calls have a state, an outcome fallback's scatters,
    ``torch.unique`` past the presence tables' bound) hold one entry per call (32,768 for 4,096 rollouts of 8
    turns), too short for handing work to a second thread to pay. The passes over the tokens, ten times longer,
    keep the threads. Restored after, also on an error."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _call_rewards(calls):
    """Each call's reward r_t, KL penalty included."""
    reward = T.per_call_rewards(calls.reward, calls.own, calls.rollout, calls.rank, calls.n_rollouts)
    return reward if calls.kl is None else reward + calls.kl


def _on_tokens(advantage, calls, batch):
    """``(advantages, returns)`` of the estimator: each call's advantage on its tokens, both."""
    advantages = T.to_tokens(advantage, calls.call_slot, calls.token_slot, calls.n_slots, batch["response_mask"])
    return advantages, advantages


def _report(ctx, metrics: dict[str, float]) -> None:
    if ctx is not None:
        ctx.step_metrics.update(metrics)


def _gigpo(batch, config, ctx=None, *, settings: GiGPOConfig):
    calls = batch_calls.batch_calls(batch)
    with _one_thread():
        reward = _call_rewards(calls)
        # A step group: the calls of one group (task) made in one state (equal state ids).
        state_group, n_states = T.state_groups(calls.group, calls.state, _n_groups(calls))
        n_keyed = int(np.count_nonzero(state_group.numpy() >= 0))
        advantage = T.gigpo(reward, calls.rollout, calls.rank, calls.rollout_group, state_group, calls.n_rollouts,
                            calls.length, config.gamma, step_weight=settings.step_weight,
                            norm_by_std=settings.mode == "mean_std_norm", epsilon=settings.epsilon,
                            rectangular=calls.rectangular)
        _report(ctx, {"advantage/calls": float(len(reward)), "advantage/calls_with_state_key": float(n_keyed),
                      "advantage/step_group_size_mean": n_keyed / n_states if n_states else 0.0,
                      "advantage/rollouts_outcome_only": float(calls.n_rollouts - _rollouts_with_own(calls))})
    return _on_tokens(advantage, calls, batch)


def _n_groups(calls) -> int:
    return int(calls.rollout_group.numpy().max()) + 1 if calls.n_rollouts else 0


def _rollouts_with_own(calls) -> int:
    """Rollouts with at least one call that has its own reward (the others fall back to their outcome)."""
    if calls.own.numpy().all():  # an agent that rewards every call: all of them, with no scatter over the calls
        return calls.n_rollouts
    return int(T.rollouts_with_own(calls.own, calls.rollout, calls.n_rollouts).sum())


def _turn_grpo(batch, config, ctx=None):
    calls = batch_calls.batch_calls(batch)
    with _one_thread():
        reward = _call_rewards(calls)
        # A turn group: a task's t-th calls.
        turn_group = T.group_keys(torch.from_numpy(calls.group.numpy() * calls.length + calls.rank.numpy()),
                                  _n_groups(calls) * calls.length)
        advantage = T.turn_grpo(reward, calls.rollout, calls.rank, turn_group, calls.n_rollouts, calls.length,
                                config.gamma, norm_by_std=config.norm_adv_by_std_in_grpo,
                                rectangular=calls.rectangular)
        _report(ctx, {"advantage/calls": float(len(reward)),
                      "advantage/rollouts_outcome_only": float(calls.n_rollouts - _rollouts_with_own(calls))})
    return _on_tokens(advantage, calls, batch)


@hookimpl
def plugin_config_schema():
    return EstimatorsConfig


@hookimpl
def register_estimators(register, settings):
    settings = settings or EstimatorsConfig()  # None: the plugin set was loaded without a recipe
    register("gae", _gae, needs_critic=True)
    register("grpo", _grpo)
    register("grpo_passk", _grpo_passk)
    register("rloo", _rloo)
    register("reinforce_plus_plus", _reinforce_plus_plus)
    register("reinforce_plus_plus_baseline", _reinforce_plus_plus_baseline)
    register("remax", _remax)
    register("gigpo", functools.partial(_gigpo, settings=settings.gigpo))
    register("turn_grpo", _turn_grpo)


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
    batch["advantages"], batch["returns"] = call_estimator(estimator, batch, config, ctx)
    return batch
