"""The real driver on CPU Ray: agl_core's loop → the verl plugin → verl's worker groups, a tiny model, a few steps.

verl's RayResourcePool, RayClassWithInitArgs, colocated RayWorkerGroups,
``@register`` dispatch, ActorRolloutRefWorker / TrainingWorker, its PPO and
value losses and its checkpoint manager all run for real; the engine under
them is the CPU one of ``agl_plugin_verl.cpu``. One module-scoped Ray session
holds two runs: two steps with a checkpoint, then a resume from it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl

from verl_testkit import BanditRollouts, first_and_resumed, mean_baseline, train_bandit

ray = pytest.importorskip("ray")


class BridgeProbe:
    """Asks the workers, during the first step, what verl's registries hold in their processes."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self):
        self.names = None
        self.advantages = None
        self.expected = None

    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        from agl_core.data import Batch
        from agl_plugin_verl.plugin import run_of

        if self.names is not None:
            return
        actor = run_of(ctx).groups.actor
        self.names = actor.agl_registered_names()
        rewards = torch.tensor([[0.0, 1.0], [0.0, 0.5], [1.0, 0.0], [0.0, 0.0]])
        batch = Batch(tensors={"token_level_rewards": rewards, "response_mask": torch.ones(4, 2)},
                      non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)})
        self.advantages = actor.agl_compute_advantage(batch.to_dataproto(), "mean_baseline", {})
        self.expected = mean_baseline(batch, None)[0]


def train(run_dir, model_dir, total_steps: int, resume: str):
    bandit, probe = BanditRollouts(), BridgeProbe()
    trainer = train_bandit(run_dir, model_dir, total_steps, resume, [
        "algorithm.estimator=gae", "algorithm.policy_loss.name=agl_test_clip",
        "algorithm.policy_loss.entropy_coeff=0.01",
    ], [("bandit", bandit), ("bridge_probe", probe)])
    return bandit, probe, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_driver")
    _, first, resumed = first_and_resumed(root, train)
    return root, first, resumed


def test_steps_run_every_stage_through_verl_workers(runs):
    _, (bandit, _, trainer), _ = runs
    assert trainer.ctx.world_size == 2  # verl's data-parallel size of the actor group
    steps = {step: metrics for step, metrics in bandit.records["metrics"]}
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy",
                    "critic/vf_loss", "critic/grad_norm", "timing_s/old_log_prob", "timing_s/ref",
                    "timing_s/values", "timing_s/update_actor", "timing_s/update_critic"):
            assert np.isfinite(metrics[key]), key


def test_actor_learns_the_rewarded_token(runs):
    _, (bandit, _, _), _ = runs
    (_, before), *_ = bandit.records["start"]
    *_, (_, after) = bandit.records["end"]
    assert after > before + 0.2  # mean log-prob of the rewarded token under verl's actor


def test_bridge_holds_inside_ray_workers(runs):
    _, (_, probe, _), _ = runs
    assert len(probe.names) == 2  # one answer per worker process
    for names in probe.names:
        assert "mean_baseline" in names["estimators"]
        assert "agl_test_clip" in names["policy_losses"]
    for advantages in probe.advantages:
        torch.testing.assert_close(advantages, probe.expected)


def test_checkpoint_is_verls_and_resumes(runs):
    root, (first, _, _), (resumed, _, trainer) = runs
    actor_dir = root / "run" / "checkpoints" / "global_step_2" / "verl" / "actor"
    assert {"model_world_size_2_rank_0.pt", "optim_world_size_2_rank_1.pt",
            "extra_state_world_size_2_rank_0.pt"} <= {p.name for p in actor_dir.iterdir()}
    assert (root / "run" / "checkpoints" / "global_step_2" / "verl" / "critic").is_dir()
    assert trainer.ctx.step == 3
    (_, saved), = [record for record in first.records["end"] if record[0] == 2]
    (step, restored), = resumed.records["start"]
    assert step == 3
    assert restored == pytest.approx(saved, abs=1e-6)  # the resumed workers hold the weights saved at step 2
