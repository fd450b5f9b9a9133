"""Estimators and policy losses by name on either side.

For every estimator name in agl_core's registry (built-ins, the verl
plugin's, a plugin's own) and in verl's: the advantages agl_core's
``advantage`` path computes (the component registered under the name) equal
those verl's own ``compute_advantage`` computes under that name. The same
for policy losses (agl_core's component vs verl's ``get_policy_loss_fn``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import Components
from agl_core.config import AlgorithmConfig, PolicyLossConfig, load
from agl_core.data import Batch

from agl_plugin_verl import bridge
from agl_plugin_verl.bridge import NEEDS_VERL_SETTINGS, Registrations, install, verl_actor_config

from verl.trainer.ppo import core_algos
from verl_testkit import mean_baseline, test_policy_loss

ROWS, LENGTH, GROUP = 16, 6, 4


class OwnComponents:
    """A third-party plugin with components verl has no name for."""

    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def register_estimators(self, register):
        register("mean_baseline", mean_baseline)

    @hookimpl
    def register_policy_losses(self, register):
        register("agl_test_clip", test_policy_loss)


@pytest.fixture(scope="module")
def components(tmp_path_factory):
    _, plugins = load(None, [f"trainer.run_dir={tmp_path_factory.mktemp('bridge')}", "plugins.verl.trainer.nnodes=1"],
                      extra_plugins=[("own", OwnComponents())])
    registry = Components.collect(plugins)
    install(Registrations.from_components(registry))
    return registry


def batch(name: str = "remax") -> Batch:
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(ROWS, LENGTH)
    lengths = torch.randint(2, LENGTH + 1, (ROWS,), generator=generator)
    mask[torch.arange(LENGTH) >= lengths.unsqueeze(1)] = 0
    mask[3, 1] = 0  # a hole: an observation token inside a response
    rewards = torch.zeros(ROWS, LENGTH)
    rewards[torch.arange(ROWS), lengths - 1] = torch.rand(ROWS, generator=generator)  # outcome on the last token
    tensors = {"token_level_rewards": rewards, "response_mask": mask,
               "values": torch.randn(ROWS, LENGTH, generator=generator) * mask,
               "reward_baselines": torch.rand(ROWS, generator=generator),
               "old_log_probs": -torch.rand(ROWS, LENGTH, generator=generator) * mask,
               "sum_pi_squared": torch.rand(ROWS, LENGTH, generator=generator) * mask}
    if name != "remax":
        # verl's compute_advantage passes reward_baselines to any estimator when the batch has it, and
        # grpo_vectorized takes no such argument: only ReMax batches carry it, in verl's trainer too.
        del tensors["reward_baselines"]
    return Batch(tensors=tensors, non_tensors={"uid": np.array([f"g{i // GROUP}" for i in range(ROWS)], dtype=object)})


def all_estimators(registry) -> list[str]:
    return sorted(set(registry.names("estimator")) | set(core_algos.ADV_ESTIMATOR_REGISTRY))


def test_both_registries_hold_every_name(components):
    """Each side has every name of the other, but the verl components that need settings agl_core cannot give."""
    agl, verl = set(components.names("estimator")), set(core_algos.ADV_ESTIMATOR_REGISTRY)
    assert verl - agl == {"gdpo"} and agl - verl == set()
    assert {"mean_baseline", "optimal_token_baseline", "gpg", "grpo"} <= agl
    losses, verl_losses = set(components.names("policy_loss")), set(core_algos.POLICY_LOSS_REGISTRY)
    assert verl_losses - losses == {"dro"} and losses - verl_losses == set()
    assert {"vanilla", "gspo", "agl_test_clip"} <= losses
    assert set(NEEDS_VERL_SETTINGS) == {"gdpo", "dro"}


def verl_compute_advantage(rows: Batch, name: str, config: AlgorithmConfig):
    """verl's own path: its trainer's compute_advantage with its own AlgoConfig, nothing of this plugin."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    verl_config = AlgoConfig(gamma=config.gamma, lam=config.lam, adv_estimator=name,
                             norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo)
    return compute_advantage(rows.to_dataproto(), name, gamma=config.gamma, lam=config.lam,
                             norm_adv_by_std_in_grpo=config.norm_adv_by_std_in_grpo, config=verl_config)


@pytest.mark.parametrize("name", sorted(set(core_algos.ADV_ESTIMATOR_REGISTRY) - {"gdpo"} | {"mean_baseline"}))
@pytest.mark.parametrize("norm", [True, False], ids=["std", "nostd"])
def test_estimator_gives_the_same_advantages_through_either_path(components, name, norm):
    config = AlgorithmConfig(estimator=name, gamma=0.97, lam=0.9, norm_adv_by_std_in_grpo=norm)
    agl_advantages, agl_returns = components.get("estimator", name).obj(batch(name), config)
    data = verl_compute_advantage(batch(name), name, config)
    torch.testing.assert_close(agl_advantages, data.batch["advantages"])
    torch.testing.assert_close(agl_returns, data.batch["returns"])


def test_verl_path_leaves_the_batch_alone(components):
    rows = batch()
    components.get("estimator", "gpg").obj(rows, AlgorithmConfig(estimator="gpg"))
    assert "advantages" not in rows


def loss_inputs():
    generator = torch.Generator().manual_seed(2)
    mask = (torch.rand(ROWS, LENGTH, generator=generator) > 0.2).float()
    old = -torch.rand(ROWS, LENGTH, generator=generator)
    return old, old + 0.3 * torch.randn(ROWS, LENGTH, generator=generator), \
        torch.randn(ROWS, LENGTH, generator=generator), mask


@pytest.mark.parametrize("name", sorted(set(core_algos.POLICY_LOSS_REGISTRY) - {"dro"} | {"agl_test_clip"}))
def test_policy_loss_is_the_same_through_either_path(components, name):
    config = PolicyLossConfig(name=name, clip_ratio=0.2, clip_ratio_high=0.28,
                              loss_agg_mode="seq-mean-token-mean")
    old, new, advantages, mask = loss_inputs()
    agl_loss, _ = components.get("policy_loss", name).obj(old, new, advantages, mask, config)
    verl_loss, _ = core_algos.get_policy_loss_fn(name)(
        old_log_prob=old, log_prob=new, advantages=advantages, response_mask=mask.bool(),
        loss_agg_mode=config.loss_agg_mode, config=verl_actor_config(name, config))
    torch.testing.assert_close(agl_loss, verl_loss)


def test_agl_losses_refuse_rollout_weights():
    loss = bridge.agl_policy_loss_for_verl("agl_test_clip", test_policy_loss)
    old, new, advantages, mask = loss_inputs()
    with pytest.raises(ValueError, match="takes no rollout importance weights"):
        loss(old, new, advantages, mask, rollout_is_weights=torch.ones_like(old))


def test_install_keeps_verls_names_and_replaces_its_own_adapters(components):
    grpo = core_algos.ADV_ESTIMATOR_REGISTRY["grpo"]
    first = core_algos.ADV_ESTIMATOR_REGISTRY["mean_baseline"]
    added = install(Registrations(estimators={"grpo": mean_baseline, "mean_baseline": mean_baseline}))
    assert added == {"estimators": ["mean_baseline"], "policy_losses": []}
    assert core_algos.ADV_ESTIMATOR_REGISTRY["grpo"] is grpo
    assert core_algos.ADV_ESTIMATOR_REGISTRY["mean_baseline"] is not first


def test_registrations_leave_out_verls_own_components(components):
    registrations = Registrations.from_components(components)
    assert "mean_baseline" in registrations.estimators and "gpg" not in registrations.estimators
    assert "agl_test_clip" in registrations.policy_losses and "gspo" not in registrations.policy_losses
    assert registrations.estimators["grpo"] is components.get("estimator", "grpo").obj  # agl_core's own
