"""Advantage estimators against verl 0.9.1 on randomized, ragged batches."""

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from agl_core.algorithms import advantages as ours

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo.ray_trainer import compute_advantage  # noqa: E402

SEEDS = range(5)
T = 24


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def make_batch(seed: int, *, min_group: int = 1, holes: bool = False, dense: bool = False):
    """A ragged batch shaped like a GRPO rollout.

    Groups of 1..6 responses under uid strings, in shuffled row order. Response
    lengths 0..T, with an empty response forced into the batch. The outcome reward
    sits on the last valid token (token 0 for an empty row, so that row still has a
    score). A third of the groups get one reward shared by all members, drawn from
    values whose group mean is exact in float32 (see test_all_equal_group_is_exactly_zero).
    ``holes`` cuts observation spans out of the mask; ``dense`` adds per-token rewards
    everywhere, masked positions included.
    """
    rng = np.random.default_rng(seed)
    sizes = rng.integers(min_group, 7, size=rng.integers(8, 16))
    uids = np.repeat(np.array([f"uid-{seed}-{g}" for g in range(len(sizes))], dtype=object), sizes)
    order = rng.permutation(len(uids))
    uids = uids[order]
    B = len(uids)

    lengths = rng.integers(0, T + 1, size=B)
    lengths[rng.integers(B)] = 0
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    if holes:
        for row in range(B):
            start = rng.integers(0, T)
            mask[row, start : start + rng.integers(1, 5)] = 0.0

    group_reward = rng.choice([0.0, 1.0, 0.5, -1.0], size=len(sizes))
    shared = rng.random(len(sizes)) < 1 / 3
    outcome = np.where(
        np.repeat(shared, sizes)[order], np.repeat(group_reward, sizes)[order], rng.normal(size=B)
    ).astype(np.float32)
    rewards = np.zeros((B, T), dtype=np.float32)
    rewards[np.arange(B), np.maximum(lengths - 1, 0)] = outcome
    if dense:
        rewards += rng.normal(scale=0.1, size=(B, T)).astype(np.float32)

    return {
        "token_level_rewards": torch.from_numpy(rewards),
        "response_mask": torch.from_numpy(mask),
        "values": torch.from_numpy(rng.normal(size=(B, T)).astype(np.float32)),
        "index": uids,
    }


# --------------------------------------------------------------------------- groups


def test_group_ids_dense_in_first_appearance_order():
    gid, n = ours.group_ids(np.array(["b", "a", "b", "c", "a"], dtype=object))
    assert n == 3
    assert gid.dtype == torch.long and gid.tolist() == [0, 1, 0, 2, 1]


@pytest.mark.parametrize(
    "index",
    [np.array([7, 3, 7, 7]), torch.tensor([7, 3, 7, 7]), [7, 3, 7, 7], np.array([7, 3, 7.0, 7], dtype=object)],
)
def test_group_ids_accepts_any_hashable_container(index):
    gid, n = ours.group_ids(index)
    assert (n, gid.tolist()) == (2, [0, 1, 0, 0])


@pytest.mark.parametrize("ids", [
    ["r0", "r0", "r1", "r1", "r1", "r2"],  # each id in one run (an aggregator's rows): numbered by run
    ["r0", "r1", "r0", "r2", "r2", "r1"],  # an id in two runs: looked up per row
    ["a", "b", "c"],  # all distinct
    ["a"],
])
def test_group_ids_runs_of_ids_match_first_appearance(ids):
    """Ids that come in runs take the run-numbering path; every layout numbers the rows as a dict would."""
    first_seen = {}
    expected = [first_seen.setdefault(i, len(first_seen)) for i in ids]
    gid, n = ours.group_ids(np.array(ids, dtype=object))
    assert (n, gid.tolist()) == (len(first_seen), expected)


# --------------------------------------------------------------------------- GAE


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.3)])
def test_gae_matches_verl_with_holes(seed, gamma, lam):
    b = make_batch(seed, holes=True, dense=True)
    adv, ret = ours.gae(
        token_level_rewards=b["token_level_rewards"],
        values=b["values"],
        response_mask=b["response_mask"],
        gamma=gamma,
        lam=lam,
    )
    ref_adv, ref_ret = core_algos.compute_gae_advantage_return(
        b["token_level_rewards"], b["values"], b["response_mask"], gamma, lam
    )
    # verl leaves the off-mask positions filled in (carried, then whitened), so compare everything.
    close(adv, ref_adv)
    close(ret, ref_ret)


def test_gae_matches_verl_compute_advantage_wrapper():
    b = make_batch(0, holes=True, dense=True)
    data = DataProto.from_dict(
        tensors={k: b[k] for k in ("token_level_rewards", "values", "response_mask")},
        non_tensors={"uid": b["index"]},
    )
    data = compute_advantage(data, "gae", gamma=0.9, lam=0.8, config=AlgoConfig())
    adv, ret = ours.gae(
        token_level_rewards=b["token_level_rewards"],
        values=b["values"],
        response_mask=b["response_mask"],
        gamma=0.9,
        lam=0.8,
    )
    close(adv, data.batch["advantages"])
    close(ret, data.batch["returns"])


def test_gae_accepts_bool_mask():
    b = make_batch(1, holes=True)
    args = dict(token_level_rewards=b["token_level_rewards"], values=b["values"], gamma=0.99, lam=0.95)
    for got, want in zip(
        ours.gae(response_mask=b["response_mask"].bool(), **args), ours.gae(response_mask=b["response_mask"], **args)
    ):
        close(got, want)


def test_whitening_needs_two_tokens_like_verl():
    mask = torch.zeros(2, 4)
    mask[0, 0] = 1.0
    x = torch.randn(2, 4)
    with pytest.raises(ValueError):
        ours.gae(token_level_rewards=x, values=x, response_mask=mask, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError):
        core_algos.compute_gae_advantage_return(x, x, mask, 1.0, 1.0)


# --------------------------------------------------------------------------- group baselines


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_verl(seed, norm):
    b = make_batch(seed, dense=seed % 2 == 1)
    adv, ret = ours.grpo(
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        index=b["index"],
        norm_adv_by_std_in_grpo=norm,
    )
    ref, _ = core_algos.compute_grpo_outcome_advantage(
        b["token_level_rewards"], b["response_mask"], b["index"], norm_adv_by_std_in_grpo=norm
    )
    close(adv, ref)
    close(ret, ref)


def test_all_equal_group_is_exactly_zero():
    # Eight equal rewards of 0.7 (a typical group): in float32 torch.mean(group) is one ulp off
    # 0.7, and verl divides that round-off by (std + 1e-6) ~ 1e-6, returning an "advantage" of
    # about 0.056 for every member. Our group mean is taken around the group maximum, so equal
    # rewards give exactly 0; the other group still matches verl.
    rewards = torch.zeros(12, 3)
    rewards[:8, -1] = 0.7
    rewards[8:, -1] = torch.tensor([0.1, 0.2, 0.3, 0.7])
    index = np.array(["a"] * 8 + ["b"] * 4, dtype=object)
    mask = torch.ones(12, 3)
    adv, _ = ours.grpo(token_level_rewards=rewards, response_mask=mask, index=index)
    assert torch.equal(adv[:8], torch.zeros(8, 3))
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask, index)
    close(adv[8:], ref[8:])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_matches_verl(seed, norm):
    b = make_batch(seed, min_group=2)
    # Binary rewards make tied maxima common; the tied gap is 0 whichever row wins.
    rewards = (b["token_level_rewards"] > 0).float() if seed % 2 else b["token_level_rewards"]
    adv, ret = ours.grpo_passk(
        token_level_rewards=rewards,
        response_mask=b["response_mask"],
        index=b["index"],
        norm_adv_by_std_in_grpo=norm,
    )
    ref, _ = core_algos.compute_grpo_passk_outcome_advantage(
        rewards, b["response_mask"], b["index"], config=AlgoConfig(norm_adv_by_std_in_grpo=norm)
    )
    close(adv, ref)
    close(ret, ref)


def test_grpo_passk_rejects_singleton_groups_like_verl():
    rewards, mask = torch.randn(3, 4), torch.ones(3, 4)
    index = np.array(["a", "a", "b"], dtype=object)
    with pytest.raises(ValueError):
        ours.grpo_passk(token_level_rewards=rewards, response_mask=mask, index=index)
    with pytest.raises(ValueError):
        core_algos.compute_grpo_passk_outcome_advantage(rewards, mask, index, config=AlgoConfig())


@pytest.mark.parametrize("seed", SEEDS)
def test_rloo_matches_verl(seed):
    b = make_batch(seed, dense=seed % 2 == 1)
    adv, ret = ours.rloo(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=b["index"]
    )
    ref, _ = core_algos.compute_rloo_outcome_advantage(b["token_level_rewards"], b["response_mask"], b["index"])
    close(adv, ref)
    close(ret, ref)


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_baseline_matches_verl(seed):
    b = make_batch(seed, dense=seed % 2 == 1)
    adv, ret = ours.reinforce_plus_plus_baseline(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], index=b["index"]
    )
    ref, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        b["token_level_rewards"], b["response_mask"], b["index"]
    )
    close(adv, ref)
    close(ret, ref)


# --------------------------------------------------------------------------- per-row returns


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_verl_with_holes(seed, gamma):
    b = make_batch(seed, holes=True, dense=True)
    adv, ret = ours.reinforce_plus_plus(
        token_level_rewards=b["token_level_rewards"], response_mask=b["response_mask"], gamma=gamma
    )
    ref_adv, ref_ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(
        b["token_level_rewards"], b["response_mask"], config=AlgoConfig(gamma=gamma)
    )
    close(adv, ref_adv)
    close(ret, ref_ret)


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_matches_verl_with_holes(seed):
    b = make_batch(seed, holes=True, dense=True)
    baselines = torch.from_numpy(np.random.default_rng(seed).normal(size=len(b["index"])).astype(np.float32))
    adv, ret = ours.remax(
        token_level_rewards=b["token_level_rewards"], reward_baselines=baselines, response_mask=b["response_mask"]
    )
    ref_adv, ref_ret = core_algos.compute_remax_outcome_advantage(
        b["token_level_rewards"], baselines, b["response_mask"]
    )
    close(adv, ref_adv)
    close(ret, ref_ret)


# --------------------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("seed", SEEDS)
def test_masked_mean_and_whiten_match_verl(seed):
    import verl.utils.torch_functional as verl_F

    b = make_batch(seed, holes=True)
    x, m = b["values"], b["response_mask"]
    close(ours.masked_mean(x, m), verl_F.masked_mean(x, m))
    close(ours.masked_mean(x, m, dim=-1), verl_F.masked_mean(x, m, axis=-1))
    close(ours.masked_whiten(x, m), verl_F.masked_whiten(x, m))


def test_estimators_take_their_arguments_positionally_in_documented_order():
    # The estimator plugins call these positionally; keep the order stable.
    b = make_batch(0, min_group=2)
    r, m, v, idx = b["token_level_rewards"], b["response_mask"], b["values"], b["index"]
    baselines = torch.zeros(len(idx))
    calls = [
        (ours.gae(r, v, m, 0.9, 0.8), ours.gae(token_level_rewards=r, values=v, response_mask=m, gamma=0.9, lam=0.8)),
        (ours.grpo(r, m, idx, False, 1e-3), ours.grpo(
            token_level_rewards=r, response_mask=m, index=idx, norm_adv_by_std_in_grpo=False, epsilon=1e-3)),
        (ours.grpo_passk(r, m, idx, False), ours.grpo_passk(
            token_level_rewards=r, response_mask=m, index=idx, norm_adv_by_std_in_grpo=False)),
        (ours.rloo(r, m, idx), ours.rloo(token_level_rewards=r, response_mask=m, index=idx)),
        (ours.reinforce_plus_plus(r, m, 0.9), ours.reinforce_plus_plus(
            token_level_rewards=r, response_mask=m, gamma=0.9)),
        (ours.reinforce_plus_plus_baseline(r, m, idx), ours.reinforce_plus_plus_baseline(
            token_level_rewards=r, response_mask=m, index=idx)),
        (ours.remax(r, baselines, m), ours.remax(token_level_rewards=r, reward_baselines=baselines, response_mask=m)),
    ]
    for positional, keyword in calls:
        for got, want in zip(positional, keyword):
            assert torch.equal(got, want)
