"""Estimators and policy losses of either side, usable by name on the other.

agl_core names a component ``fn(batch, config)`` (estimators) or
``fn(old_log_prob, log_prob, advantages, response_mask, config)`` (policy
losses); verl keys its own by name in ``ADV_ESTIMATOR_REGISTRY`` and
``POLICY_LOSS_REGISTRY`` with verl's signatures. This module adapts each to
the other:

- agl_core → verl: :func:`install` registers every agl_core component whose
  name verl lacks into verl's registries. verl's registries are module
  globals, so :func:`install` runs in every process that looks names up: the
  driver, and each Ray worker in its ``__init__`` (see ``workers.py``).
- verl → agl_core: :func:`verl_estimators` / :func:`verl_policy_losses` are
  what the plugin's ``register_*`` hooks register, for every verl name the
  built-in plugins do not provide (except :data:`NEEDS_VERL_SETTINGS`). A verl
  estimator is run through verl's own ``compute_advantage``, so it gets
  exactly the inputs verl's trainer gives it.

Names both sides have (gae, grpo, rloo, vanilla, ...) keep each side's own
implementation; they compute the same numbers (``tests/test_verl_bridge.py``).
verl is imported inside the functions: importing this module is free.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from agl_core.config import AlgorithmConfig, PolicyLossConfig
from agl_core.data import Batch

BRIDGED = "__agl_verl_bridged__"
"""Attribute set on every adapter; its value names the side the wrapped component comes from."""


@dataclass
class Registrations:
    """The agl_core components to make visible in verl's registries (picklable: shipped to Ray workers)."""

    estimators: dict[str, Callable] = field(default_factory=dict)
    policy_losses: dict[str, Callable] = field(default_factory=dict)

    @classmethod
    def from_components(cls, components) -> Registrations:
        """The estimators and policy losses of a run's ``ctx.components``, minus those that wrap verl's own."""

        def own(kind: str) -> dict[str, Callable]:
            found = {name: components.get(kind, name).obj for name in components.names(kind)}
            return {name: fn for name, fn in found.items() if getattr(fn, BRIDGED, None) != "verl"}

        return cls(own("estimator"), own("policy_loss"))


def _mark(fn: Callable, side: str, name: str) -> Callable:
    setattr(fn, BRIDGED, side)
    fn.__name__ = fn.__qualname__ = f"{side}_{name}"
    return fn


# --------------------------------------------------------------------------- agl_core → verl


def _algorithm_config(name: str, verl_config: Any) -> AlgorithmConfig:
    """agl_core's ``algorithm`` section from what verl hands an estimator (its AlgoConfig, or None)."""
    shared = ("gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty")
    values = {key: getattr(verl_config, key) for key in shared
              if verl_config is not None and getattr(verl_config, key, None) is not None}
    return AlgorithmConfig(estimator=name, **values)


def agl_estimator_for_verl(name: str, fn: Callable) -> Callable:
    """verl's estimator signature around agl_core's ``fn(batch, config)``.

    The batch is made of what verl passes (``token_level_rewards``,
    ``response_mask``, ``index`` as the ``uid`` column, ``values``,
    ``reward_baselines``, and the whole ``batch``/``non_tensor_batch`` when
    verl hands them over: then the per-call columns too, ``turn_ids`` and the
    ``call_*`` arrays, which the step-level estimators read). An estimator
    that reads another column fails with a KeyError naming it: verl's
    ``compute_advantage`` hands the whole batch to GDPO alone, so ``gigpo``
    and ``turn_grpo`` run in agl_core's ``advantage`` slot, where the batch
    has every column.
    """

    def estimator(token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None,
                  config: Any = None, batch: Any = None, non_tensor_batch: dict | None = None,
                  **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = dict(batch.items()) if batch is not None else {}
        tensors.update({k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        tensors.update(token_level_rewards=token_level_rewards, response_mask=response_mask)
        arrays = dict(non_tensor_batch or {})
        if index is not None:
            arrays["uid"] = np.asarray(index, dtype=object)
        return fn(Batch(tensors=tensors, non_tensors=arrays), _algorithm_config(name, config))

    return _mark(estimator, "agl", name)


def _policy_loss_config(name: str, loss_agg_mode: str, verl_config: Any) -> PolicyLossConfig:
    """agl_core's ``algorithm.policy_loss`` section from verl's actor config."""
    shared = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "entropy_coeff",
              "use_kl_loss", "kl_loss_coef", "kl_loss_type")
    values = {key: getattr(verl_config, key) for key in shared
              if verl_config is not None and getattr(verl_config, key, None) is not None}
    return PolicyLossConfig(name=name, loss_agg_mode=loss_agg_mode, **values)


def agl_policy_loss_for_verl(name: str, fn: Callable) -> Callable:
    """verl's policy-loss signature around agl_core's ``fn(old_log_prob, log_prob, advantages, response_mask, config)``.

    agl_core losses take no rollout importance weights: a call with
    ``rollout_is_weights`` is refused rather than silently unweighted.
    """

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
                    rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if rollout_is_weights is not None:
            raise ValueError(f"agl_core policy loss {name!r} takes no rollout importance weights; "
                             "disable verl's algorithm.rollout_correction or use a verl loss")
        return fn(old_log_prob, log_prob, advantages, response_mask,
                  _policy_loss_config(name, loss_agg_mode, config))

    return _mark(policy_loss, "agl", name)


def _install_into(registry: dict[str, Callable], register: Callable, components: dict[str, Callable],
                  adapt: Callable[[str, Callable], Callable]) -> list[str]:
    added = []
    for name, fn in components.items():
        current = registry.get(name)
        if current is not None and getattr(current, BRIDGED, None) != "agl":
            continue  # verl implements this name itself: verl's code keeps verl's implementation
        registry.pop(name, None)  # an adapter an earlier run of this process installed
        register(name)(adapt(name, fn))
        added.append(name)
    return added


def install(registrations: Registrations) -> dict[str, list[str]]:
    """Register the agl_core components verl has no implementation of into verl's registries, in this process.

    A name verl implements keeps verl's implementation; an adapter installed
    by an earlier run in the same process is replaced. Returns the names
    installed, by registry.
    """
    from verl.trainer.ppo import core_algos

    return {"estimators": _install_into(core_algos.ADV_ESTIMATOR_REGISTRY, core_algos.register_adv_est,
                                        registrations.estimators, agl_estimator_for_verl),
            "policy_losses": _install_into(core_algos.POLICY_LOSS_REGISTRY, core_algos.register_policy_loss,
                                           registrations.policy_losses, agl_policy_loss_for_verl)}


def registered_names() -> dict[str, list[str]]:
    """The names in verl's two registries in this process."""
    from verl.trainer.ppo import core_algos

    return {"estimators": sorted(core_algos.ADV_ESTIMATOR_REGISTRY),
            "policy_losses": sorted(core_algos.POLICY_LOSS_REGISTRY)}


# --------------------------------------------------------------------------- verl → agl_core


def verl_algo_config(config: AlgorithmConfig) -> Any:
    """verl's ``AlgoConfig`` with the estimator settings of agl_core's ``algorithm`` section."""
    from verl.trainer.config import AlgoConfig, KLControlConfig

    kl = config.kl_ctrl
    return AlgoConfig(gamma=config.gamma, lam=config.lam, adv_estimator=config.estimator,
                      norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
                      use_kl_in_reward=config.use_kl_in_reward, kl_penalty=config.kl_penalty,
                      kl_ctrl=KLControlConfig(type=kl.type, kl_coef=kl.kl_coef, horizon=kl.horizon,
                                              target_kl=kl.target_kl))


def verl_advantage(data: Any, name: str, config: AlgorithmConfig) -> Any:
    """verl's own ``compute_advantage`` of estimator ``name`` on a DataProto (adds ``advantages``, ``returns``)."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    return compute_advantage(data, name, gamma=config.gamma, lam=config.lam,
                             norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo,
                             config=verl_algo_config(config))


def verl_estimator_for_agl(name: str) -> Callable:
    """agl_core's ``fn(batch, config)`` for verl's estimator ``name``, run through verl's ``compute_advantage``."""

    def estimator(batch: Batch, config: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
        # to_dataproto shares the tensors but not the TensorDict: verl's writes stay out of ``batch``.
        data = verl_advantage(batch.to_dataproto(), name, config)
        return data.batch["advantages"], data.batch["returns"]

    return _mark(estimator, "verl", name)


def verl_actor_config(name: str, config: PolicyLossConfig) -> Any:
    """verl's FSDP actor config carrying the policy-loss settings of agl_core's ``algorithm.policy_loss``."""
    from verl.workers.config import FSDPActorConfig
    from verl.workers.config import PolicyLossConfig as VerlPolicyLossConfig

    low = config.clip_ratio if config.clip_ratio_low is None else config.clip_ratio_low
    high = config.clip_ratio if config.clip_ratio_high is None else config.clip_ratio_high
    # rollout_n and the micro-batch size are required by verl's constructor; a loss never reads them.
    return FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                           clip_ratio=config.clip_ratio, clip_ratio_low=low, clip_ratio_high=high,
                           clip_ratio_c=config.clip_ratio_c, loss_agg_mode=config.loss_agg_mode,
                           entropy_coeff=config.entropy_coeff, use_kl_loss=config.use_kl_loss,
                           kl_loss_coef=config.kl_loss_coef, kl_loss_type=config.kl_loss_type,
                           policy_loss=VerlPolicyLossConfig(loss_mode=name))


def verl_policy_loss_for_agl(name: str) -> Callable:
    """agl_core's policy-loss signature for verl's loss ``name``; metric names lose verl's ``actor/`` prefix."""

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, config: PolicyLossConfig) -> tuple[torch.Tensor, dict[str, float]]:
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        loss, metrics = get_policy_loss_fn(name)(
            old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
            response_mask=response_mask.bool(), loss_agg_mode=config.loss_agg_mode,
            config=verl_actor_config(name, config))
        return loss, {key.removeprefix("actor/"): float(value) for key, value in metrics.items()}

    return _mark(policy_loss, "verl", name)


def _builtin_names(hook: str) -> set[str]:
    """Names the agl_core built-in plugin registers through ``hook`` (verl's versions are not added for those)."""
    from agl_core.builtin import estimators
    from agl_core.plugins import call

    names: set[str] = set()
    call(getattr(estimators, hook), {"register": lambda name, obj, **options: names.add(name), "settings": None})
    return names


NEEDS_VERL_SETTINGS = {
    "gdpo": "algorithm.gdpo_reward_keys and per-component reward columns, which agl_core batches do not carry",
    "dro": "actor.policy_loss.dro_beta, which agl_core's algorithm.policy_loss has no key for",
}
"""verl components that cannot run on agl_core's inputs alone, with what they need; not offered to agl_core
(inside verl's workers they remain usable by name, configured through ``plugins.verl``)."""


def _verl_own(registry: dict[str, Callable], taken: set[str]) -> list[str]:
    """verl's names in ``registry`` that agl_core can use, minus ``taken``; :func:`install`'s entries are agl_core's."""
    return sorted(name for name, fn in registry.items()
                  if name not in taken and name not in NEEDS_VERL_SETTINGS and getattr(fn, BRIDGED, None) != "agl")


def verl_estimators() -> dict[str, Callable]:
    """agl_core estimators for each verl estimator the built-ins lack, by verl's name."""
    from verl.trainer.ppo import core_algos

    names = _verl_own(core_algos.ADV_ESTIMATOR_REGISTRY, _builtin_names("register_estimators"))
    return {name: verl_estimator_for_agl(name) for name in names}


def verl_policy_losses() -> dict[str, Callable]:
    """agl_core policy losses for each verl loss the built-ins lack, by verl's name."""
    from verl.trainer.ppo import core_algos

    names = _verl_own(core_algos.POLICY_LOSS_REGISTRY, _builtin_names("register_policy_losses"))
    return {name: verl_policy_loss_for_agl(name) for name in names}
