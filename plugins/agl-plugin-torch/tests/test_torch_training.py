"""Real updates of a tiny model: the PPO loss goes down, the first epoch is on-policy, accumulation is exact."""

import pytest
import torch

from agl_core.builtin.estimators import vanilla_policy_loss

from agl_plugin_torch import training
from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import algorithm, sampled_rows, tiny_section


def test_the_ppo_loss_goes_down_on_a_fixed_batch(tmp_path):
    backend = create(TorchConfig.model_validate(tiny_section(actor={"lr": 0.002, "weight_decay": 0.0})), tmp_path,
                     seed=0, with_critic=False)
    batch = sampled_rows(backend)
    # Rows whose first token is even are good: the clipped surrogate rewards raising their probability.
    good = batch["responses"][:, 0] % 2 == 0
    batch["advantages"] = torch.where(good, 1.0, -1.0).unsqueeze(-1) * batch["response_mask"]
    losses = [training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, algorithm(),
                                    vanilla_policy_loss, backend.config.actor)["actor/pg_loss"] for _ in range(5)]
    # The old log-probs stay those of the first policy, so each update lowers the surrogate (until clipped).
    assert all(later < earlier for earlier, later in zip(losses, losses[1:]))
    new_log_probs, _ = backend.logprobs(backend.actor, batch, with_entropy=False)
    moved = (new_log_probs - batch["old_log_probs"])[:, 0]
    assert moved[good].mean() > 0 > moved[~good].mean()


def test_the_first_ppo_epoch_is_on_policy(backend):
    batch = sampled_rows(backend)
    batch["advantages"] = torch.randn(len(batch), 1) * batch["response_mask"]
    metrics = training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, algorithm(),
                                    vanilla_policy_loss, backend.config.actor)
    # One mini-batch, one epoch: the only forward pass is before any step, so the ratio is 1.
    assert abs(metrics["actor/ppo_kl"]) < 1e-6 and metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/lr"] == backend.config.actor.lr and metrics["actor/grad_norm"] > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batches_accumulate_the_mini_batch_gradient(tmp_path, mode):
    whole = create(TorchConfig.model_validate(tiny_section()), tmp_path / "a", seed=0, with_critic=False)
    split = create(TorchConfig.model_validate(tiny_section(actor={"lr": 0.01, "weight_decay": 0.0,
                                                                  "micro_batch_size": 3})),
                   tmp_path / "b", seed=0, with_critic=False)
    batch = sampled_rows(whole)
    batch["advantages"] = torch.randn(len(batch), 1, generator=torch.Generator().manual_seed(1)) \
        * batch["response_mask"]
    config = algorithm(policy_loss={"loss_agg_mode": mode})
    # 16 rows in micro-batches of 3 (the last of 1): weighted by their share, their gradients sum to the whole's.
    norms = [training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, config,
                                   vanilla_policy_loss, backend.config.actor)["actor/grad_norm"]
             for backend in (whole, split)]
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)


def test_warm_up_raises_the_learning_rate_linearly(backend):
    optimizer, scheduler = training.make_optimizer(backend.actor.parameters(),
                                                   backend.config.actor.model_copy(update={"warmup_steps": 4}))
    lrs = []
    for _ in range(6):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.0025, 0.005, 0.0075, 0.01, 0.01, 0.01])


def test_the_critic_learns_the_returns(tmp_path):
    backend = create(TorchConfig.model_validate(tiny_section(critic={"lr": 0.01})), tmp_path, seed=0,
                     with_critic=True)
    batch = sampled_rows(backend)
    batch["returns"] = 0.8 * batch["response_mask"]
    losses = []
    for _ in range(10):
        batch["values"] = backend.values(batch)
        losses.append(training.update_critic(backend.critic, backend.critic_optim, backend.critic_sched, batch,
                                             algorithm(), backend.config.critic)["critic/vf_loss"])
    assert losses[0] == pytest.approx(0.5 * 0.8 ** 2)  # the zero head starts at V = 0
    assert losses[-1] < 0.5 * losses[0]


def test_the_reference_stays_at_the_initial_weights(backend):
    batch = sampled_rows(backend)
    batch["advantages"] = torch.ones(len(batch), 1) * batch["response_mask"]
    initial = batch["old_log_probs"]
    training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, algorithm(ppo_epochs=3),
                          vanilla_policy_loss, backend.config.actor)
    reference, _ = backend.logprobs(backend.reference(), batch, with_entropy=False)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(reference[mask], initial[mask])
    assert not torch.allclose(backend.logprobs(backend.actor, batch, with_entropy=False)[0][mask], initial[mask])
    assert not any(p.requires_grad for p in backend.reference().parameters())
