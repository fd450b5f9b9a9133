"""Advantage estimators: pure functions over masked ``(B, T)`` tensors.

Shapes used throughout:
    B  responses in the batch (rows), T  response tokens per row (columns).
    ``response_mask`` is 1 on tokens the policy generated and 0 on padding and on
    observation tokens spliced into multi-turn responses (so a row may have holes).
    ``index`` holds one hashable group id per row (verl passes an object array of uid
    strings); responses sampled from the same prompt share an id.

Every estimator returns ``(advantages, returns)``, both ``(B, T)``, and computes the
same numbers as the verl 0.9.1 function named in its docstring
(``verl/trainer/ppo/core_algos.py``), edge cases included: groups of one response,
rows with an all-zero mask, groups whose rewards are all equal. On that last one we
are exact where verl is not: its float32 group mean can miss the common value by an
ulp (eight rewards of 0.7, say), and GRPO divides that by std + ε = 1e-6 into a
spurious advantage of ~0.05; ours is exactly 0.

Group statistics are vectorised (weighted bincounts over dense group ids) rather than
verl's Python loops over rows, and the two recurrences over time
(GAE, REINFORCE++) run on a time-major copy so that each step touches one contiguous row.
"""

from collections.abc import Hashable, Sequence

import numpy as np
import torch

__all__ = [
    "gae",
    "group_ids",
    "grpo",
    "grpo_passk",
    "masked_mean",
    "masked_whiten",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]


# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over the elements where ``mask`` is set.

    ``values`` and ``mask`` share a shape; ``mask`` is 0/1 (bool, int or float).
    Reduces over ``dim`` (all elements when None). The denominator gets +1e-8, so an
    all-zero mask yields 0 rather than NaN. Elements outside the mask never reach
    the sum, even when they are NaN or inf.
    Matches ``verl.utils.torch_functional.masked_mean`` for 0/1 masks.
    """
    total = torch.where(mask.bool(), values, 0.0).sum(dim=dim)
    return total / (mask.sum(dim=dim) + 1e-8)


@torch.no_grad()
def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with mean and unbiased variance over ``mask``.

    Any shape; the statistics are taken over all masked elements, the transform is
    applied to every element (positions outside the mask are shifted and scaled too).
    The result is a new contiguous tensor, outside autograd (whitened advantages are
    targets, not something to differentiate). Raises ValueError when fewer than two
    elements are masked, since the unbiased variance is then undefined.
    Matches ``verl.utils.torch_functional.masked_whiten(values, mask, shift_mean=True)``.
    """
    valid = mask.bool()
    n = torch.count_nonzero(valid)  # much faster than summing a bool tensor
    if n < 2:
        raise ValueError(f"masked_whiten needs at least two masked elements, got {int(n)}")
    mean = torch.where(valid, values, 0.0).sum() / (n + 1e-8)
    # The output buffer doubles as the centred values; it is contiguous even for a transposed input.
    centered = torch.sub(values, mean, out=torch.empty_like(values, memory_format=torch.contiguous_format))
    sum_sq = torch.where(valid, centered, 0.0).square_().sum()
    # Bessel's correction, n / (n - 1), turns the masked mean square into the unbiased variance.
    variance = sum_sq / (n + 1e-8) * (n / (n - 1))
    return centered.mul_(torch.rsqrt(variance + 1e-8))


# ---------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------


def group_ids(index: Sequence[Hashable] | np.ndarray | torch.Tensor) -> tuple[torch.Tensor, int]:
    """Map arbitrary hashable group ids to dense ids ``0..G-1``.

    Args:
        index: length-B sequence of hashable ids (object array of uid strings,
            integer array, list, or tensor).

    Returns:
        ``(gid, G)``: ``gid`` is a LongTensor of shape (B,) on the CPU, numbered in
        order of first appearance; ``G`` is the number of distinct ids.

    Ids are grouped the way verl's ``defaultdict`` grouping does it (by hash and
    equality), not by sorting, so any hashable works and 65,536 uid strings take a
    few milliseconds: ``dict.fromkeys`` and ``map`` run the per-row work in C.
    """
    if isinstance(index, np.ndarray) and index.ndim == 1 and len(index):
        # Rows come in runs of one id (an aggregator lists a rollout's rows, and a task's rollouts, together):
        # the ids are those of the runs' first rows, and where each id has one run, a row's id is its run's
        # number, with no lookup per row. The distinct ids first seen are the runs' either way.
        starts = np.empty(len(index), dtype=bool)
        starts[0] = True
        starts[1:] = index[1:] != index[:-1]
        first_seen = dict.fromkeys(index[starts].tolist())
        if len(first_seen) == int(np.count_nonzero(starts)):
            return torch.from_numpy(np.cumsum(starts, dtype=np.int64) - 1), len(first_seen)
        ids = index.tolist()
    else:
        # .tolist() unboxes numeric arrays into Python scalars; object arrays yield their items.
        ids = index.tolist() if isinstance(index, torch.Tensor) else list(index)
        first_seen = dict.fromkeys(ids)
        if len(first_seen) == len(ids):  # all distinct (a row per rollout): numbered in order, with no lookup
            return torch.arange(len(ids)), len(ids)
    dense = dict(zip(first_seen, range(len(first_seen))))
    gid = np.fromiter(map(dense.__getitem__, ids), dtype=np.int64, count=len(ids))
    return torch.from_numpy(gid), len(dense)


def _group_outcomes(
    token_level_rewards: torch.Tensor, index: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scores, gid, count, mean, std)`` of the outcome estimators: each row's summed reward R (B,),
    its dense group id (B,), and the per-group count, mean and std of R (G,) from :func:`_group_mean_std`."""
    scores = token_level_rewards.sum(dim=-1)
    gid, n_groups = group_ids(index)
    return scores, gid, *_group_mean_std(scores, gid, n_groups)


def _group_mean_std(
    scores: torch.Tensor, gid: torch.Tensor, n_groups: int, with_std: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-group count, mean and unbiased std (``torch.std``) of ``scores``.

    Args:
        scores: (B,) float; gid: (B,) long in ``0..n_groups-1``; CPU tensors.

    Returns:
        ``(count, mean, std)``, each (G,) in ``scores.dtype``. ``std`` is NaN for groups
        of one; callers apply verl's convention for those. ``with_std=False``: ``std`` is
        None (not computed). An id no score has gets count 0 and NaN mean and std.

    Scores are shifted by a member of their group before summing, so a group whose
    scores are all equal sums zeros: it gets exactly that score as mean and exactly 0
    as std. The sums are NumPy's weighted bincounts (accumulated in float64), a pass
    each with no thread hand-off: a third of torch's ``index_add`` and
    ``scatter_reduce`` on the CPU.
    """
    x, g = scores.numpy(), gid.numpy()
    count = np.bincount(g, minlength=n_groups).astype(x.dtype)
    shift = np.zeros(n_groups, dtype=x.dtype)
    shift[g] = x  # where a group id repeats, one of its members' scores lands: any one will do
    with np.errstate(invalid="ignore", divide="ignore"):  # std of a group of one: 0 / 0, NaN as documented
        mean = (shift + np.bincount(g, x - shift.take(g), n_groups) / count).astype(x.dtype, copy=False)
        if not with_std:
            return torch.from_numpy(count), torch.from_numpy(mean), None
        deviation = x - mean.take(g)
        std = np.sqrt(np.bincount(g, deviation * deviation, n_groups) / (count - 1)).astype(x.dtype, copy=False)
    return torch.from_numpy(count), torch.from_numpy(mean), torch.from_numpy(std)


# ---------------------------------------------------------------------------
# Recurrences over time
# ---------------------------------------------------------------------------


def _reverse_scan_over_valid(x: torch.Tensor, valid: torch.Tensor, discount: float) -> torch.Tensor:
    """Discounted reverse scan that skips masked tokens.

    Time-major: ``x`` (T, B) float and ``valid`` (T, B) bool, both contiguous.
    Returns y of shape (T + 1, B) with ``y[T] = 0`` and, going backwards,
        y[t] = x[t] + discount * y[t + 1]   where valid[t]
        y[t] = y[t + 1]                     elsewhere,
    i.e. masked tokens pass the running value through untouched. This is the carry
    rule of verl's GAE and REINFORCE++ loops; the arithmetic order is theirs too.
    Each step reads and writes one contiguous row of B floats, which is what makes
    this loop much cheaper than verl's, whose steps gather strided columns.
    """
    y = x.new_zeros(x.shape[0] + 1, x.shape[1])
    for t in reversed(range(x.shape[0])):
        torch.where(valid[t], x[t] + discount * y[t + 1], y[t + 1], out=y[t])
    return y


# ---------------------------------------------------------------------------
# Estimators
# ---------------------------------------------------------------------------


@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

        δ_t = r_t + γ V_{t'} - V_t,   A_t = δ_t + γλ A_{t'},   R_t = A_t + V_t

    where t' is the next *valid* token after t (V_{t'} = A_{t'} = 0 past the end).
    Masked tokens are skipped: their reward and value are ignored, and they carry
    the advantage of the next valid token. Advantages are then whitened over the mask.

    Args:
        token_level_rewards, values, response_mask: (B, T).
        gamma: discount γ; lam: GAE λ.

    Returns:
        advantages (B, T): whitened A, defined at every position (not zeroed off-mask,
            exactly like verl); returns (B, T): un-whitened A + V, at every position.

    Matches ``compute_gae_advantage_return`` of verl 0.9.1.
    """
    valid = response_mask.T.bool().contiguous()
    v = values.T.contiguous()
    # With no discount the skip-scan gives, at s, the value of the first valid token at or
    # after s; shifted by one that is V_{t'}, the value of the next valid token after t.
    next_value = _reverse_scan_over_valid(v, valid, 0.0)[1:]
    delta = next_value.mul_(gamma).add_(token_level_rewards.T).sub_(v)
    advantages = _reverse_scan_over_valid(delta, valid, gamma * lam)[:-1].T
    returns = values + advantages  # values first: the sum takes its contiguous (B, T) layout
    return masked_whiten(advantages, response_mask), returns


@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, arXiv:2402.03300).

        A_i = (R_i - mean_g R) / (std_g R + ε)     (or R_i - mean_g R, Dr.GRPO)

    with R_i the row's reward sum (over all T positions), mean/std over the rows sharing
    its group id (unbiased std). A group of one uses mean 0 and std 1, as verl does;
    a group of equal rewards gets exactly 0 (see the module docstring).

    Args:
        token_level_rewards, response_mask: (B, T); index: (B,) group ids.
        norm_adv_by_std_in_grpo: divide by the group std (False gives Dr.GRPO).
        epsilon: ε added to the std.

    Returns:
        ``(A * response_mask, same tensor)``, (B, T).

    Matches ``compute_grpo_outcome_advantage`` of verl 0.9.1.
    """
    scores, gid, count, mean, std = _group_outcomes(token_level_rewards, index)
    singleton = count == 1
    mean = mean.masked_fill(singleton, 0.0)
    advantage = scores - mean[gid]
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std.masked_fill(singleton, 1.0)[gid] + epsilon)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    norm_adv_by_std_in_grpo: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO advantage (Chen et al. 2025, arXiv:2503.19595).

    Only the best response of each group is credited:
        A_best = (R_max - R_second) / (std_g R + ε)    (no division when not normalising)
    and every other response gets 0. When the maximum is tied the gap is 0, so which of
    the tied rows is "best" does not matter.

    Args:
        token_level_rewards, response_mask: (B, T); index: (B,) group ids.
        norm_adv_by_std_in_grpo: divide by the unbiased group std.
        epsilon: ε added to the std.

    Returns:
        ``(A * response_mask, same tensor)``, (B, T).

    Raises:
        ValueError: a group has fewer than two responses.

    Matches ``compute_grpo_passk_outcome_advantage`` of verl 0.9.1 (which reads the
    normalisation flag from ``config.norm_adv_by_std_in_grpo``).
    """
    scores, gid, count, _, std = _group_outcomes(token_level_rewards, index)
    if bool((count < 2).any()):
        raise ValueError("Pass@k needs at least two responses in every group")

    def group_max(x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(len(count)).scatter_reduce(0, gid, x, reduce="amax", include_self=False)

    best_score = group_max(scores)
    # One best row per group: the lowest row index attaining the maximum.
    rows = torch.arange(scores.shape[0], device=scores.device)
    candidates = torch.where(scores == best_score[gid], rows, scores.shape[0])
    best_row = torch.full_like(best_score, scores.shape[0], dtype=torch.long)
    best_row = best_row.scatter_reduce(0, gid, candidates, reduce="amin")
    second_score = group_max(scores.index_fill(0, best_row, float("-inf")))

    gap = best_score - second_score
    if norm_adv_by_std_in_grpo:
        gap = gap / (std + epsilon)
    advantage = scores.new_zeros(scores.shape).index_copy_(0, best_row, gap)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out advantage (Ahmadian et al. 2024, arXiv:2402.14740).

        A_i = R_i - mean_{j != i} R_j = n/(n-1) * (R_i - mean_g R)

    over the n rows of the group. A group of one has no baseline: A_i = R_i.

    Args:
        token_level_rewards, response_mask: (B, T); index: (B,) group ids.
        epsilon: unused, kept for signature parity with verl.

    Returns:
        ``(A * response_mask, same tensor)``, (B, T).

    Matches ``compute_rloo_outcome_advantage`` of verl 0.9.1.
    """
    scores, gid, count, mean, _ = _group_outcomes(token_level_rewards, index)
    n = count[gid]
    advantage = torch.where(n > 1, (scores - mean[gid]) * n / (n - 1), scores)
    advantages = advantage.unsqueeze(-1) * response_mask
    return advantages, advantages


@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantage (Hu 2025, arXiv:2501.03262).

        G_t = r_t + γ G_{t'}   (t' the next valid token; masked tokens carry G through)
        A   = whiten(G) over the mask

    Args:
        token_level_rewards, response_mask: (B, T); gamma: discount γ.

    Returns:
        advantages (B, T): whitened G, zero off-mask; returns (B, T): G, zero off-mask.

    Matches ``compute_reinforce_plus_plus_outcome_advantage`` of verl 0.9.1
    (which takes γ from ``config.gamma``).
    """
    valid = response_mask.T.bool().contiguous()
    running = _reverse_scan_over_valid(token_level_rewards.T.contiguous(), valid, gamma)[:-1].T
    returns = response_mask * running  # mask first: the product takes its contiguous (B, T) layout
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262).

        A_i = whiten over the batch's masked tokens of (R_i - mean_g R)

    A group of one uses mean 0. Each row's centred score is broadcast to its tokens
    before whitening, so longer responses weigh more in the batch statistics.

    Args:
        token_level_rewards, response_mask: (B, T); index: (B,) group ids.
        epsilon: unused, kept for signature parity with verl.

    Returns:
        ``(A * response_mask, same tensor)``, (B, T).

    Matches ``compute_reinforce_plus_plus_baseline_outcome_advantage`` of verl 0.9.1.
    """
    scores, gid, count, mean, _ = _group_outcomes(token_level_rewards, index)
    centered = scores - mean.masked_fill(count == 1, 0.0)[gid]
    advantages = masked_whiten(centered.unsqueeze(-1) * response_mask, response_mask) * response_mask
    return advantages, advantages


@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax advantage (Li et al. 2023, arXiv:2310.10505).

        G_t = sum_{s >= t} m_s r_s,     A_t = G_t - b * m_t

    with b the reward of the greedy response to the same prompt.

    Args:
        token_level_rewards, response_mask: (B, T); reward_baselines: (B,) b.

    Returns:
        advantages (B, T), returns G (B, T). Neither is zeroed off-mask: a masked
        token before a later valid one keeps the reward-to-go, as in verl.

    Matches ``compute_remax_outcome_advantage`` of verl 0.9.1.
    """
    # Reward-to-go as a cumulative sum over the time-reversed row.
    returns = (token_level_rewards * response_mask).flip(-1).cumsum(-1).flip(-1)
    advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns
