"""Loss pieces against verl 0.9.1: values, metrics and gradients."""

import pytest
import torch
from torch.testing import assert_close

from agl_core.algorithms import losses as ours

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
import verl.utils.torch_functional as verl_F  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402

SEEDS = range(4)
MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
B, T, V = 12, 16, 11


def close(actual, expected) -> None:
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def ragged_mask(gen: torch.Generator) -> torch.Tensor:
    """(B, T) right-padded mask with random lengths, two of them empty."""
    lengths = torch.randint(0, T + 1, (B,), generator=gen)
    lengths[:2] = 0
    return (torch.arange(T)[None, :] < lengths[:, None]).float()


def leaf(x: torch.Tensor) -> torch.Tensor:
    return x.clone().requires_grad_(True)


# --------------------------------------------------------------------------- agg_loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_matches_verl(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    loss_mat, mask = torch.randn(B, T, generator=gen), ragged_mask(gen)
    close(ours.agg_loss(loss_mat, mask, mode), core_algos.agg_loss(loss_mat, mask, mode))


@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_global_batch_normalisation_matches_verl(mode):
    gen = torch.Generator().manual_seed(7)
    loss_mat, mask = torch.randn(B, T, generator=gen), ragged_mask(gen)
    kwargs = dict(dp_size=4, batch_num_tokens=317, global_batch_size=45, loss_scale_factor=64)
    close(ours.agg_loss(loss_mat, mask, mode, **kwargs), core_algos.agg_loss(loss_mat, mask, mode, **kwargs))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float32, torch.int64, torch.bool])
def test_agg_loss_value_equals_agg_loss_even_with_inf_and_nan_outside_the_mask(mode, mask_dtype):
    gen = torch.Generator().manual_seed(3)
    loss_mat, mask = torch.randn(B, T, generator=gen), ragged_mask(gen).to(mask_dtype)
    expected = core_algos.agg_loss(loss_mat, mask.float(), mode)
    assert ours.agg_loss_value(loss_mat, mask, mode) == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)
    outside = ~mask.bool()
    loss_mat[outside] = torch.where(torch.arange(int(outside.sum())) % 2 == 0, torch.inf, torch.nan)
    assert ours.agg_loss_value(loss_mat, mask, mode) == pytest.approx(expected.item(), rel=1e-5, abs=1e-6)


def test_agg_loss_rejects_unknown_mode_and_missing_global_counts():
    x = torch.ones(2, 3)
    with pytest.raises(ValueError):
        ours.agg_loss(x, x, "seq-sum")
    with pytest.raises(ValueError):
        ours.agg_loss(x, x, "token-mean", dp_size=2)
    with pytest.raises(ValueError):
        ours.agg_loss(x, x, "seq-mean-token-mean", dp_size=2)


# --------------------------------------------------------------------------- PPO clip


def policy_batch(seed: int):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen) * 3
    # Log-ratios up to ±1.5 push ratios well past 1 ± 0.2 and past the dual-clip bound.
    new = old + torch.randn(B, T, generator=gen) * 0.6
    advantages = torch.randn(B, T, generator=gen)
    return old, new, advantages, ragged_mask(gen)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "clip",
    [
        dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=None, clip_ratio_c=3.0),
        dict(clip_ratio=0.2, clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=1.5),
    ],
)
def test_ppo_clip_loss_matches_verl(seed, mode, clip):
    old, new, advantages, mask = policy_batch(seed)
    ours_new, verl_new = leaf(new), leaf(new)
    loss, metrics = ours.ppo_clip_loss(old, ours_new, advantages, mask, loss_agg_mode=mode, **clip)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **clip)
    ref_loss, ref_metrics = core_algos.compute_policy_loss_vanilla(
        old, verl_new, advantages, mask, loss_agg_mode=mode, config=config
    )
    close(loss, ref_loss)
    # verl prefixes the keys with "actor/"; our callers add that prefix themselves.
    assert {f"actor/{key}" for key in metrics} == ref_metrics.keys()
    for key in metrics:
        assert metrics[key] == pytest.approx(ref_metrics[f"actor/{key}"], abs=1e-6)
    loss.backward()
    ref_loss.backward()
    close(ours_new.grad, verl_new.grad)
    if clip["clip_ratio_c"] == 1.5:  # the data really exercises both clips
        assert metrics["pg_clipfrac"] > 0 and metrics["pg_clipfrac_lower"] > 0


def test_ppo_clip_loss_forwards_global_batch_info_like_verl():
    old, new, advantages, mask = policy_batch(0)
    info = dict(dp_size=2, batch_num_tokens=250)
    loss, _ = ours.ppo_clip_loss(old, new, advantages, mask, global_batch_info=info)
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, global_batch_info=info)
    ref_loss, _ = core_algos.compute_policy_loss_vanilla(old, new, advantages, mask, config=config)
    close(loss, ref_loss)


def test_ppo_clip_loss_rejects_dual_clip_bound_at_most_one():
    old, new, advantages, mask = policy_batch(0)
    with pytest.raises(ValueError):
        ours.ppo_clip_loss(old, new, advantages, mask, clip_ratio_c=1.0)


# --------------------------------------------------------------------------- KL estimators

KL_KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KL_KINDS + [k + "+" for k in KL_KINDS])
def test_kl_penalty_matches_verl_values_and_gradients(seed, kind):
    gen = torch.Generator().manual_seed(seed)
    logprob = -torch.rand(B, T, generator=gen) * 5
    # Wide spread so k3's clamps (log-ratio ±20, estimate ≤ 10) are hit too.
    ref = logprob + torch.randn(B, T, generator=gen) * 8
    ours_lp, ours_ref, verl_lp, verl_ref = leaf(logprob), leaf(ref), leaf(logprob), leaf(ref)
    got = ours.kl_penalty(ours_lp, ours_ref, kind)
    want = core_algos.kl_penalty(verl_lp, verl_ref, kind)
    close(got, want)
    weights = torch.randn(B, T, generator=gen)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    close(ours_lp.grad, verl_lp.grad)
    close(ours_ref.grad, verl_ref.grad)


def test_kl_penalty_rejects_unknown_kind():
    x = torch.zeros(2, 3)
    for kind in ("full", "k4", "kl++"):
        with pytest.raises(ValueError):
            ours.kl_penalty(x, x, kind)


# --------------------------------------------------------------------------- entropy


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_from_logits_matches_verl(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 4
    ours_logits, verl_logits = leaf(logits), leaf(logits)
    got, want = ours.entropy_from_logits(ours_logits), verl_F.entropy_from_logits(verl_logits)
    close(got, want)
    got.sum().backward()
    want.sum().backward()
    close(ours_logits.grad, verl_logits.grad)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_entropy_loss_matches_verl(seed, mode):
    gen = torch.Generator().manual_seed(seed)
    logits, mask = torch.randn(B, T, V, generator=gen), ragged_mask(gen)
    close(ours.entropy_loss(logits, mask, mode), core_algos.compute_entropy_loss(logits, mask, mode))


# --------------------------------------------------------------------------- value loss


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cliprange_value", [0.0, 0.2, 5.0])
def test_value_loss_matches_verl(seed, mode, cliprange_value):
    gen = torch.Generator().manual_seed(seed)
    values, returns, mask = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen), ragged_mask(gen)
    vpreds = values + torch.randn(B, T, generator=gen) * 0.5
    ours_v, verl_v = leaf(vpreds), leaf(vpreds)
    loss, clipfrac = ours.value_loss(ours_v, returns, values, mask, cliprange_value, mode)
    ref_loss, ref_clipfrac = core_algos.compute_value_loss(verl_v, returns, values, mask, cliprange_value, mode)
    close(loss, ref_loss)
    close(clipfrac, ref_clipfrac)
    loss.backward()
    ref_loss.backward()
    close(ours_v.grad, verl_v.grad)


def test_value_loss_forwards_global_batch_info_like_verl():
    gen = torch.Generator().manual_seed(3)
    values, returns, mask = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen), ragged_mask(gen)
    info = dict(dp_size=2, global_batch_size=30)
    loss, _ = ours.value_loss(values * 1.1, returns, values, mask, 0.2, "seq-mean-token-mean", global_batch_info=info)
    ref_loss, _ = core_algos.compute_value_loss(values * 1.1, returns, values, mask, 0.2, "seq-mean-token-mean", **info)
    close(loss, ref_loss)
