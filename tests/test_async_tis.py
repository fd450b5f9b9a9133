"""The truncated importance-sampling correction equals verl 0.9.1's, weights and loss, on ragged masks."""

from __future__ import annotations

import pytest
import torch

from agl_core.algorithms.losses import ppo_clip_loss
from agl_core.algorithms.rollout_correction import tis_weights

verl_corr = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
verl_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.workers.config import ActorConfig  # noqa: E402 - verl is optional: skipped above without it


def ragged(seed: int, rows: int = 6, width: int = 11):
    """Log-probs of a trainer and of a serving policy that drifted from it, over responses of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, width, generator=gen) * 3
    # Some tokens far apart (weights above the cap, and a log-ratio past the safety clamp).
    rollout = old + torch.randn(rows, width, generator=gen) * 0.8
    rollout[0, 0] = old[0, 0] - 30.0
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[1] = width
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    mask[2, 3] = 0.0  # a hole: an observation inside a trajectory row
    return old, rollout, mask, gen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [1.5, 2.0, 5.0])
def test_weights_equal_verls_token_tis(seed, cap):
    old, rollout, mask, _ = ragged(seed)
    ours, metrics = tis_weights(old, rollout, mask, cap)
    theirs, _ = verl_corr.compute_rollout_correction_weights(old - rollout, mask, rollout_is="token",
                                                             rollout_is_threshold=cap)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert not ours.requires_grad
    raw = torch.exp(torch.clamp(old - rollout, -20, 20))[mask.bool()]
    assert metrics["rollout_corr/tis_max"] == pytest.approx(raw.max().item(), rel=1e-6)
    assert metrics["rollout_corr/tis_capped_share"] == pytest.approx((raw > cap).float().mean().item(), abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cap", [0.5, 2.0, 5.0])
def test_weights_equal_verls_sequence_tis(seed, cap):
    old, rollout, mask, _ = ragged(seed)
    rollout[3] = old[3] - 0.01  # a response close to the trainer's: a weight under the cap
    ours, metrics = tis_weights(old, rollout, mask, cap, level="sequence")
    theirs, _ = verl_corr.compute_rollout_correction_weights(old - rollout, mask, rollout_is="sequence",
                                                             rollout_is_threshold=cap)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert not ours.requires_grad
    # One weight per response, on each of its tokens; the metrics count responses.
    raw = torch.exp(torch.clamp(((old - rollout) * mask).sum(-1), -20, 20))
    expected = raw.clamp(max=cap)[:, None].expand_as(mask) * mask
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=0)
    assert metrics["rollout_corr/tis_mean"] == pytest.approx(raw.mean().item(), rel=1e-5)
    assert metrics["rollout_corr/tis_capped_share"] == pytest.approx((raw > cap).float().mean().item(), abs=1e-6)


def test_an_unknown_level_is_refused_naming_the_key():
    old, rollout, mask, _ = ragged(0)
    with pytest.raises(ValueError, match="algorithm.rollout_correction.rollout_is"):
        tis_weights(old, rollout, mask, 2.0, level="geometric")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_weighted_ppo_loss_and_gradient_equal_verls(mode):
    old, rollout, mask, gen = ragged(7)
    advantages = torch.randn(old.shape, generator=gen)
    weights, _ = tis_weights(old, rollout, mask, 2.0)
    new_ours = (old + torch.randn(old.shape, generator=gen) * 0.3).requires_grad_()
    new_theirs = new_ours.detach().clone().requires_grad_()

    loss, metrics = ppo_clip_loss(old, new_ours, advantages, mask, clip_ratio=0.2, loss_agg_mode=mode,
                                  rollout_is_weights=weights)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2)
    theirs, verl_metrics = verl_algos.compute_policy_loss_vanilla(
        old, new_theirs, advantages, mask, loss_agg_mode=mode, config=config, rollout_is_weights=weights)
    torch.testing.assert_close(loss, theirs, rtol=0, atol=1e-5)
    loss.backward()
    theirs.backward()
    torch.testing.assert_close(new_ours.grad, new_theirs.grad, rtol=0, atol=1e-5)
    assert metrics["pg_clipfrac"] == pytest.approx(verl_metrics["actor/pg_clipfrac"], abs=1e-6)


def test_unweighted_loss_is_unchanged():
    old, rollout, mask, gen = ragged(3)
    advantages = torch.randn(old.shape, generator=gen)
    new = old + 0.1
    plain, _ = ppo_clip_loss(old, new, advantages, mask)
    ones, _ = ppo_clip_loss(old, new, advantages, mask, rollout_is_weights=torch.ones_like(old))
    assert torch.equal(plain, ones)


def test_bad_inputs_are_named():
    old, rollout, mask, _ = ragged(0)
    with pytest.raises(ValueError, match="rollout_is_threshold"):
        tis_weights(old, rollout, mask, 0.0)
    with pytest.raises(ValueError, match="same shape"):
        tis_weights(old, rollout[:, :3], mask, 2.0)
