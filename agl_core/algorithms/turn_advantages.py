"""Step-level advantages: credit per model call (turn), then on the call's tokens. Pure functions over tensors.

A multi-turn rollout is a sequence of calls ``t = 0..L-1`` with rewards
``r_t``. These estimators give each call its own advantage and put it on the
tokens that call generated (``turn_ids``), so the calls of one rollout, even
merged into one training row, are credited apart.

Shapes used throughout:
    K  calls in the batch, in any order; ``rank`` (:func:`call_ranks`) orders those of one rollout.
    B, T  rows and response tokens, as in :mod:`agl_core.algorithms.advantages`.

Groups are dense ids (:func:`~agl_core.algorithms.advantages.group_ids`). The
group statistics are those of GRPO (:func:`~agl_core.algorithms.advantages._group_mean_std`:
unbiased std, exact on groups of equal values).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agl_core.algorithms.advantages import _group_mean_std, group_ids
from agl_core.data import REWARD_FROM_CALL, Batch

__all__ = ["BatchCalls", "batch_calls", "call_ranks", "discounted_returns", "gigpo", "group_normalized",
           "per_call_rewards", "to_tokens", "turn_grpo"]


def call_ranks(rollout: torch.Tensor, turn: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(rank, length)``: each call's rank among its rollout's calls by turn (0: the first one in the batch),
    and the most calls of one rollout. ``rollout`` (K,) long dense rollout ids; ``turn`` (K,) long positions
    in the trace."""
    if rollout.numel() == 0:
        return torch.zeros(0, dtype=torch.long), 0
    order = torch.argsort(rollout * (int(turn.max()) + 1) + turn)
    sorted_rollout = rollout[order]
    starts = torch.ones_like(sorted_rollout, dtype=torch.bool)
    starts[1:] = sorted_rollout[1:] != sorted_rollout[:-1]
    position = torch.arange(len(order))
    first = torch.cummax(torch.where(starts, position, 0), 0).values  # where each call's rollout starts
    rank = torch.empty_like(order)
    rank[order] = position - first
    return rank, int(rank.max()) + 1


def per_call_rewards(call_reward: torch.Tensor, own: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor,
                     n_rollouts: int) -> torch.Tensor:
    """Each call's reward ``r_t`` (K,) float64.

    A rollout with at least one call that has its own reward (``own``) gets
    those, 0 on its other calls. A rollout where no call has its own reward
    falls back to an outcome reward: its reward (``call_reward`` of its calls,
    which all hold the rollout's) on its last call, 0 on the others.
    """
    call_reward = call_reward.to(torch.float64)
    has_own = torch.zeros(n_rollouts, dtype=torch.bool).index_put_((rollout,), own, accumulate=True)
    last = torch.full((n_rollouts,), -1, dtype=torch.long).scatter_reduce(0, rollout, rank, "amax")
    fallback = ~has_own[rollout] & (rank == last[rollout])
    return torch.where(own | fallback, call_reward, 0.0)


def discounted_returns(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, n_rollouts: int,
                       length: int, gamma: float) -> torch.Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t+1}`` along each rollout's calls (by ``rank``), (K,).

    Laid out as a (rollouts, length) matrix and scanned backwards over its
    columns: ``length`` vector steps, however many rollouts.
    """
    rewards = reward.new_zeros(n_rollouts, length + 1)
    rewards[rollout, rank] = reward
    for t in reversed(range(length)):
        rewards[:, t] += gamma * rewards[:, t + 1]
    return rewards[rollout, rank]


def group_normalized(values: torch.Tensor, gid: torch.Tensor, n_groups: int, norm_by_std: bool,
                     epsilon: float = 1e-6, singleton: str = "grpo") -> torch.Tensor:
    """``(v - mean_g) / (std_g + epsilon)`` (or ``v - mean_g`` without ``norm_by_std``) within each group.

    A group of one: ``singleton="grpo"`` takes mean 0 and std 1 (verl's GRPO, GiGPO's episode groups: the value
    itself); ``"zero"`` takes its own value as the mean (GiGPO's step groups: advantage 0).
    """
    count, mean, std = _group_mean_std(values, gid, n_groups)
    alone = count == 1
    if singleton == "grpo":
        mean = mean.masked_fill(alone, 0.0)
    centered = values - mean[gid]
    if norm_by_std:
        centered = centered / (std.masked_fill(alone, 1.0)[gid] + epsilon)
    return centered


def gigpo(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, episode_group: torch.Tensor,
          state_group: torch.Tensor, n_rollouts: int, length: int, gamma: float, step_weight: float = 1.0,
          norm_by_std: bool = False, epsilon: float = 1e-6) -> torch.Tensor:
    """GiGPO's advantage of each call (Feng et al. 2025, arXiv:2505.10978, Eq. 3-8), (K,) float64.

    Episode level (Eq. 3): a rollout's return is the sum of its calls'
    rewards; ``A^E`` is that return normalized within its group of rollouts
    (``episode_group[r]``, one entry per rollout; a group of one keeps its
    return, as GRPO). Step level (Eq. 5-7): the discounted return-to-go
    ``G_t`` (``gamma``) of each call, normalized among the calls of one
    episode group made in the same state (``state_group``, -1: no state
    key); a call alone in its state, or without a key, gets ``A^S = 0``.
    Eq. 8: ``A = A^E + step_weight * A^S``. ``norm_by_std``: divide by the
    group's std + ``epsilon`` ("mean_std_norm"), else only centre ("mean_norm",
    verl-agent's default).

    Args: ``reward``, ``rollout``, ``rank``, ``state_group`` (K,) per call;
    ``episode_group`` (n_rollouts,) dense group ids of the rollouts.
    """
    episode_return = reward.new_zeros(n_rollouts).index_add_(0, rollout, reward)
    n_groups = int(episode_group.max()) + 1 if n_rollouts else 0
    episode = group_normalized(episode_return, episode_group, n_groups, norm_by_std, epsilon, singleton="grpo")
    advantage = episode[rollout]
    keyed = state_group >= 0
    if bool(keyed.any()):
        returns = discounted_returns(reward, rollout, rank, n_rollouts, length, gamma)
        states = state_group[keyed]
        step = group_normalized(returns[keyed], states, int(states.max()) + 1, norm_by_std, epsilon,
                                singleton="zero")
        advantage = advantage.index_add(0, keyed.nonzero(as_tuple=True)[0], step_weight * step)
    return advantage


def turn_grpo(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, turn_group: torch.Tensor,
              n_rollouts: int, length: int, gamma: float, norm_by_std: bool = True,
              epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO at turn level, (K,) float64: each call's discounted return-to-go ``G_t`` (``gamma``), normalized
    among the calls of its ``turn_group`` (the same task at the same rank: the t-th call of each sample),
    with GRPO's conventions (a group of one keeps its value). With one call per rollout it is GRPO."""
    returns = discounted_returns(reward, rollout, rank, n_rollouts, length, gamma)
    n_groups = int(turn_group.max()) + 1 if turn_group.numel() else 0
    return group_normalized(returns, turn_group, n_groups, norm_by_std, epsilon, singleton="grpo")


def to_tokens(call_advantage: torch.Tensor, token_call: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages (B, T): each token gets its call's advantage (``token_call`` (B, T): index of the
    call in ``call_advantage``, -1 for a token no call generated, which gets 0), times ``response_mask``."""
    values = torch.cat([call_advantage, call_advantage.new_zeros(1)])  # index -1 reads the trailing 0
    return values[token_call].to(torch.float32) * response_mask


# ---------------------------------------------------------------------------
# The calls of a batch
# ---------------------------------------------------------------------------


@dataclass
class BatchCalls:
    """The calls of a batch's rows, one entry each (K calls), as the step-level estimators read them."""

    reward: torch.Tensor  # (K,) float64: ``call_rewards`` (the call's own, else its rollout's)
    own: torch.Tensor  # (K,) bool: the reward is the call's own
    kl: torch.Tensor  # (K,) float64: the KL penalty in the reward on the call's tokens (0 without one)
    turn: torch.Tensor  # (K,) long: position in the trace
    rollout: torch.Tensor  # (K,) long: dense rollout id
    n_rollouts: int
    group: torch.Tensor  # (K,) long: dense id of the call's group (its row's ``uid``)
    rollout_group: torch.Tensor  # (n_rollouts,) long: dense group id of each rollout
    state: torch.Tensor  # (K,) long: dense id of the call's state key, -1 for a call without one
    token_call: torch.Tensor  # (B, T) long: index of each token's call, -1 for a token no call generated


def batch_calls(batch: Batch) -> BatchCalls:
    """The calls of ``batch`` from its per-call columns (:data:`agl_core.data.CALL_COLUMNS`, ``turn_ids``).

    Rows without those columns (an aggregator that does not write them)
    are taken as one call each: its turn the row's ``turn_index`` (0 when
    absent), its reward the row's summed scores, the rollout's. The rows
    need ``uid`` and ``rollout_id`` (every aggregator writes them). With the
    KL penalty in the reward (``token_level_rewards`` is not
    ``token_level_scores``), each call's ``kl`` is the penalty summed over
    its tokens. A token whose ``turn_ids`` names no call of its row is a
    ValueError.
    """
    mask = batch["response_mask"]
    n = mask.shape[0]
    rewards = batch["token_level_rewards"]
    scores = batch["token_level_scores"] if "token_level_scores" in batch else rewards
    if "call_turns" in batch and "turn_ids" in batch:
        call_turns = batch["call_turns"]
        valid = call_turns >= 0  # boolean indexing reads the calls row by row, each row's in call order
        row = np.repeat(np.arange(n), valid.sum(1))
        turn = torch.from_numpy(call_turns[valid])
        reward = torch.from_numpy(batch["call_rewards"][valid].astype(np.float64, copy=False))
        own = torch.from_numpy(batch["call_reward_sources"][valid] == REWARD_FROM_CALL)
        keys = batch["call_state_keys"][valid]
        turn_ids = batch["turn_ids"]
    else:
        row = np.arange(n)
        turn = torch.from_numpy(np.asarray(batch["turn_index"], dtype=np.int64)) if "turn_index" in batch \
            else torch.zeros(n, dtype=torch.long)
        call_turns = turn.numpy()[:, None]
        reward = scores.sum(-1, dtype=torch.float64)
        own = torch.zeros(n, dtype=torch.bool)
        keys = np.full(n, None, dtype=object)
        turn_ids = torch.where(mask.bool(), turn[:, None], -1).to(torch.int32)
    rows = torch.from_numpy(row)
    token_call = _token_calls(call_turns, turn_ids)
    kl = torch.zeros(len(turn), dtype=torch.float64)
    if rewards.data_ptr() != scores.data_ptr() and len(turn):  # the KL penalty is in the reward
        on_call = token_call >= 0
        kl.index_add_(0, token_call[on_call], (rewards - scores).to(torch.float64)[on_call])
    rollout_of_row, n_rollouts = group_ids(batch["rollout_id"])
    # A rollout's rows share its uid: the groups are read off each rollout's first row.
    first_row = torch.full((n_rollouts,), n, dtype=torch.long).scatter_reduce(0, rollout_of_row, torch.arange(n),
                                                                               "amin")
    rollout_group, _ = group_ids(np.asarray(batch["uid"])[first_row.numpy()])
    rollout = rollout_of_row[rows]
    keyed = np.flatnonzero(keys != None)  # noqa: E711 - elementwise over an object array
    state = torch.full((len(turn),), -1, dtype=torch.long)
    if len(keyed):
        state[torch.from_numpy(keyed)] = group_ids(keys[keyed])[0]
    return BatchCalls(reward=reward, own=own, kl=kl, turn=turn, rollout=rollout, n_rollouts=n_rollouts,
                      group=rollout_group[rollout], rollout_group=rollout_group, state=state, token_call=token_call)


def _token_calls(call_turns: np.ndarray, turn_ids: torch.Tensor) -> torch.Tensor:
    """Each token's call (B, T) long, -1 where ``turn_ids`` is -1: one gather from a (B, W) table of each row's
    calls by turn id (offset by the row's first call's; W the widest span of turn ids in a row)."""
    valid = call_turns >= 0
    n = call_turns.shape[0]
    first = np.where(valid.any(1), call_turns[:, 0], 0)
    offset = (call_turns - first[:, None])[valid]
    width = int(offset.max()) + 1 if len(offset) else 1
    table = np.full((n, width), -1, dtype=np.int64)
    table[np.repeat(np.arange(n), valid.sum(1)), offset] = np.arange(len(offset))
    # In NumPy: a dozen passes over (B, T) small ints, each cheaper than a torch op's dispatch and thread hand-off.
    ids = turn_ids.numpy()
    relative = ids - first.astype(ids.dtype)[:, None]
    at = np.clip(relative, 0, width - 1)
    call = np.take_along_axis(table, at, 1)
    on_call = ids >= 0
    missing = on_call & ((call < 0) | (at != relative))
    if missing.any():
        bad_row = int(np.flatnonzero(missing.any(1))[0])
        raise ValueError(f"row {bad_row}: turn_ids names a call that call_turns does not list "
                         f"({sorted(set(ids[bad_row][missing[bad_row]].tolist()))})")
    call[~on_call] = -1
    return torch.from_numpy(call)
