"""Step-level advantages: credit per model call (turn), then on the call's tokens. Pure functions over tensors.

A multi-turn rollout is a sequence of calls ``t = 0..L-1`` with rewards
``r_t``. These estimators give each call its own advantage and put it on the
tokens that call generated (``turn_ids``), so the calls of one rollout, even
merged into one training row, are credited apart.

Shapes used throughout:
    K  calls in the batch, in any order; ``rank`` (:func:`call_ranks`) orders those of one rollout.
    B, T  rows and response tokens, as in :mod:`agl_core.algorithms.advantages`.

Groups are dense ids (:func:`~agl_core.algorithms.advantages.group_ids` of strings,
:func:`dense_ids` of integer keys). The
group statistics are those of GRPO (:func:`~agl_core.algorithms.advantages._group_mean_std`:
unbiased std, exact on groups of equal values).
"""

from __future__ import annotations

import numpy as np
import torch

from agl_core.algorithms.advantages import _group_mean_std, group_ids

__all__ = ["call_ranks", "dense_ids", "discounted_returns", "gigpo", "group_keys", "group_normalized",
           "keyed_calls", "numbered", "per_call_rewards", "rollouts_with_own", "state_groups", "to_tokens",
           "turn_grpo"]


def call_ranks(rollout: torch.Tensor, turn: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(rank, length)``: each call's rank among its rollout's calls by turn (0: the first one in the batch),
    and the most calls of one rollout. ``rollout`` (K,) long dense rollout ids; ``turn`` (K,) long positions
    in the trace."""
    if rollout.numel() == 0:
        return torch.zeros(0, dtype=torch.long), 0
    rollout_, turn_ = rollout.numpy(), turn.numpy()
    key = rollout_ * (int(turn_.max()) + 1) + turn_
    # The aggregators list each rollout's calls together and in turn order: then the calls need no sort.
    order = None if bool((key[1:] > key[:-1]).all()) else np.argsort(key, kind="stable")
    sorted_rollout = rollout_ if order is None else rollout_[order]
    starts = np.flatnonzero(np.diff(sorted_rollout, prepend=-1))  # where each rollout's calls start
    rank = np.arange(len(key)) - np.repeat(starts, np.diff(starts, append=len(key)))
    if order is not None:
        unsorted = np.empty_like(rank)
        unsorted[order] = rank
        rank = unsorted
    return torch.from_numpy(rank), int(rank.max()) + 1


def _few_keys(size: int, n: int) -> bool:
    """Whether a table with a slot per possible key (``size``) costs less than sorting ``n`` keys."""
    return size <= 4 * n + 1024


def dense_ids(key: torch.Tensor, size: int) -> tuple[torch.Tensor, int]:
    """``(ids, n)``: the keys (K,) long in ``0..size-1`` numbered ``0..n-1`` in increasing order of key (what
    ``torch.unique(key, return_inverse=True)`` numbers them), and n the distinct keys."""
    if not _few_keys(size, len(key)):  # a presence table would outweigh a sort
        values, ids = torch.unique(key, return_inverse=True)
        return ids, len(values)
    # In NumPy, as discounted_returns: a scatter, a scan and a gather with no thread hand-off (CPU tensors).
    number = np.cumsum(_presence(key.numpy(), size)) - 1
    return torch.from_numpy(number.take(key.numpy())), int(number[-1]) + 1 if size else 0


def _presence(key: np.ndarray, size: int) -> np.ndarray:
    """(size,) bool: the keys in ``0..size-1`` that occur in ``key``."""
    present = np.zeros(size, dtype=bool)
    present[key] = True
    return present


def group_keys(key: torch.Tensor, size: int) -> torch.Tensor:
    """Group ids (K,) for integer keys in ``0..size-1``: the keys themselves where the possible keys are few (a
    group no key falls in costs an empty bin of :func:`group_normalized`), else :func:`dense_ids`'."""
    return key if _few_keys(size, len(key)) else dense_ids(key, size)[0]


def state_groups(group: torch.Tensor, state: torch.Tensor, n_groups: int) -> tuple[torch.Tensor, int]:
    """``(state_group, n)``: each call's step group (K,), the id of its (``group``, ``state``) pair, or -1 for a
    call without a state (``state`` -1); n the distinct pairs. ``group`` (K,) dense ids below ``n_groups``;
    ``state`` (K,) any integer ids (:func:`agl_core.data.state_key_ids`).

    The states are numbered by :func:`numbered`; a pair's key is ``group *
    n_states + state``. Where the possible keys are few the ids are the keys
    themselves, as in :func:`group_keys` (not dense: a pair no call makes
    costs an empty bin of :func:`group_normalized`), else :func:`dense_ids`.
    """
    keyed = keyed_calls(state)
    if keyed is None:
        return torch.full_like(state, -1), 0
    state_index, n_states = numbered(state[keyed].numpy())
    key, size = group[keyed].numpy() * n_states + state_index, n_groups * n_states
    if _few_keys(size, len(key)):
        pair, n = torch.from_numpy(key), int(np.count_nonzero(_presence(key, size)))
    else:
        pair, n = dense_ids(torch.from_numpy(key), size)
    if isinstance(keyed, slice):  # every call has a state
        return pair, n
    state_group = torch.full_like(state, -1)
    state_group[keyed] = pair
    return state_group, n


def numbered(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """``(ids, n)``: integer ``keys`` numbered ``0..n-1`` in increasing order, n the distinct keys (what
    ``np.unique(keys, return_inverse=True)`` gives).

    A batch holds few distinct state ids, 63-bit digests whose low bits are
    as good as random: where the low bits of the distinct keys tell them apart,
    a table indexed by them numbers every key in one pass. That and a sort of
    a copy cost a third of ``np.unique``'s argsort; otherwise it is ``np.unique``.
    """
    distinct = np.sort(keys)
    distinct = distinct[np.concatenate(([True], distinct[1:] != distinct[:-1]))] if len(keys) else distinct
    # Tables of about 2x and 8x the keys squared, where d keys share no slot with odds exp(-d^2 / table size / 2)
    # (0.8 and over); 64 Ki slots at most, so about 90 distinct keys.
    for bits in (b for b in (2 * len(distinct).bit_length() + 1, 2 * len(distinct).bit_length() + 3) if b <= 16):
        low = distinct & ((1 << bits) - 1)
        table = np.full(1 << bits, -1, dtype=np.int64)
        table[low] = np.arange(len(distinct))
        if (table >= 0).sum() == len(distinct):  # no two distinct keys share their low bits
            return table.take(keys & ((1 << bits) - 1)), len(distinct)
    ids = np.unique(keys, return_inverse=True)[1]
    return ids, len(distinct)


def per_call_rewards(call_reward: torch.Tensor, own: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor,
                     n_rollouts: int) -> torch.Tensor:
    """Each call's reward ``r_t`` (K,) float64.

    A rollout with at least one call that has its own reward (``own``) gets
    those, 0 on its other calls. A rollout where no call has its own reward
    falls back to an outcome reward: its reward (``call_reward`` of its calls,
    which all hold the rollout's) on its last call, 0 on the others.
    """
    call_reward = call_reward.to(torch.float64)
    if own.numpy().all():  # every call has its own reward (an agent that rewards each turn): nothing to mask
        return call_reward
    has_own = rollouts_with_own(own, rollout, n_rollouts)
    if has_own.numpy().all():  # the common case: no rollout falls back
        return torch.where(own, call_reward, 0.0)
    last = torch.full((n_rollouts,), -1, dtype=torch.long).scatter_reduce(0, rollout, rank, "amax")
    fallback = ~has_own[rollout] & (rank == last[rollout])
    return torch.where(own | fallback, call_reward, 0.0)


def rollouts_with_own(own: torch.Tensor, rollout: torch.Tensor, n_rollouts: int) -> torch.Tensor:
    """(n_rollouts,) bool: the rollouts with at least one call that has its own reward (``own`` (K,) bool)."""
    return torch.zeros(n_rollouts, dtype=torch.bool).scatter_reduce_(0, rollout, own, "amax")


def discounted_returns(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, n_rollouts: int,
                       length: int, gamma: float, rectangular: bool = False) -> torch.Tensor:
    """Returns-to-go ``G_t = r_t + gamma * G_{t+1}`` along each rollout's calls (by ``rank``), (K,).

    Laid out as a (length, rollouts) matrix and scanned backwards over its
    rows (contiguous): ``length`` vector steps, however many rollouts. In
    NumPy, on the flat index of each call's cell: a scatter and a gather with
    no thread hand-off, a third of torch's two-index ones (CPU tensors).
    ``rectangular``: the calls already form a (rollouts, length) matrix,
    rollout-major (see :func:`gigpo`): its columns are scanned in place, with
    no scatter or gather and the same arithmetic.
    """
    if rectangular:
        returns = reward.numpy().reshape(n_rollouts, length).copy()
        for t in reversed(range(length - 1)):
            returns[:, t] += gamma * returns[:, t + 1]
        return torch.from_numpy(returns.reshape(-1))
    cell = rank.numpy() * n_rollouts + rollout.numpy()
    returns = np.zeros((length + 1, n_rollouts))
    returns.reshape(-1)[cell] = reward.numpy()
    for t in reversed(range(length)):
        returns[t] += gamma * returns[t + 1]
    return torch.from_numpy(returns.reshape(-1).take(cell))


def group_normalized(values: torch.Tensor, gid: torch.Tensor, n_groups: int, norm_by_std: bool,
                     epsilon: float = 1e-6, singleton: str = "grpo") -> torch.Tensor:
    """``(v - mean_g) / (std_g + epsilon)`` (or ``v - mean_g`` without ``norm_by_std``) within each group.

    A group of one: ``singleton="grpo"`` takes mean 0 and std 1 (verl's GRPO, GiGPO's episode groups: the value
    itself); ``"zero"`` takes its own value as the mean (GiGPO's step groups: advantage 0). The ids in ``gid``
    (below ``n_groups``) need not be dense: an id no value has costs a bin, nothing else.
    """
    count, mean, std = (None if t is None else t.numpy() for t in
                        _group_mean_std(values, gid, n_groups, with_std=norm_by_std))
    alone = count == 1
    g = gid.numpy()
    if singleton == "grpo":
        np.putmask(mean, alone, 0.0)
    centered = values.numpy() - mean.take(g)
    if norm_by_std:
        np.putmask(std, alone, 1.0)
        centered /= std.take(g) + epsilon
    return torch.from_numpy(centered)


def gigpo(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, episode_group: torch.Tensor,
          state_group: torch.Tensor, n_rollouts: int, length: int, gamma: float, step_weight: float = 1.0,
          norm_by_std: bool = False, epsilon: float = 1e-6, rectangular: bool = False) -> torch.Tensor:
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
    ``rectangular``: the calls are a (n_rollouts, length) matrix, rollout-major
    (call k is rollout ``k // length``'s call of rank ``k % length``, as
    :class:`agl_core.builtin.batch_calls.BatchCalls` says when it is so):
    sums and scans run along its rows and columns instead of scattering by
    ``rollout`` and ``rank``, with the same results to the bit.
    """
    episode_return = _row_sums(reward, n_rollouts, length) if rectangular \
        else torch.from_numpy(np.bincount(rollout.numpy(), reward.numpy(), n_rollouts))
    n_groups = int(episode_group.numpy().max()) + 1 if n_rollouts else 0
    episode = group_normalized(episode_return, episode_group, n_groups, norm_by_std, epsilon, singleton="grpo")
    advantage = torch.from_numpy(np.repeat(episode.numpy(), length) if rectangular
                                 else episode.numpy().take(rollout.numpy()))
    keyed = keyed_calls(state_group)
    if keyed is not None:
        returns = discounted_returns(reward, rollout, rank, n_rollouts, length, gamma, rectangular)
        states = state_group[keyed]
        step = group_normalized(returns[keyed], states, int(states.numpy().max()) + 1, norm_by_std, epsilon,
                                singleton="zero")
        advantage[keyed] += step if step_weight == 1 else step_weight * step
    return advantage


def _row_sums(reward: torch.Tensor, n_rollouts: int, length: int) -> torch.Tensor:
    """Each rollout's summed reward (n_rollouts,) float64 from a rollout-major (n_rollouts, length) matrix: added
    column by column from 0, the order ``np.bincount`` adds them in (so the two give the same bits)."""
    calls = reward.numpy().reshape(n_rollouts, length)
    total = np.zeros(n_rollouts)
    for t in range(length):
        total += calls[:, t]
    return torch.from_numpy(total)


def keyed_calls(state: torch.Tensor) -> torch.Tensor | slice | None:
    """The calls with a state (``state >= 0``) as an index: ``slice(None)`` when that is all of them (a view,
    where a boolean mask would copy), None when none."""
    keyed = state.numpy() >= 0  # NumPy's any/all over bools: a tenth of torch's (CPU tensors)
    if not keyed.any():
        return None
    return slice(None) if keyed.all() else torch.from_numpy(keyed)


def turn_grpo(reward: torch.Tensor, rollout: torch.Tensor, rank: torch.Tensor, turn_group: torch.Tensor,
              n_rollouts: int, length: int, gamma: float, norm_by_std: bool = True,
              epsilon: float = 1e-6, rectangular: bool = False) -> torch.Tensor:
    """GRPO at turn level, (K,) float64: each call's discounted return-to-go ``G_t`` (``gamma``), normalized
    among the calls of its ``turn_group`` (the same task at the same rank: the t-th call of each sample),
    with GRPO's conventions (a group of one keeps its value). With one call per rollout it is GRPO.
    ``rectangular``: the calls are a rollout-major matrix, as in :func:`gigpo`."""
    returns = discounted_returns(reward, rollout, rank, n_rollouts, length, gamma, rectangular)
    n_groups = int(turn_group.numpy().max()) + 1 if turn_group.numel() else 0
    return group_normalized(returns, turn_group, n_groups, norm_by_std, epsilon, singleton="grpo")


def to_tokens(call_advantage: torch.Tensor, call_slot: torch.Tensor, token_slot: torch.Tensor, n_slots: int,
              response_mask: torch.Tensor) -> torch.Tensor:
    """Per-token advantages (B, T) float32: each token gets its call's advantage, times ``response_mask``.

    Calls and tokens meet in a table of ``n_slots`` slots: ``call_slot`` (K,)
    is each call's slot, ``token_slot`` (B, T) each token's (its call's); a
    token on a slot no call holds (one no call generated) gets 0. One gather
    and one product over the tokens.
    """
    table = np.zeros(n_slots, dtype=np.float32)
    # NumPy's scatter (half torch's index_put), of values already float32: a cast inside the scatter costs more.
    table[call_slot.numpy()] = call_advantage.numpy().astype(np.float32)
    # index_select takes int32 indices on a slower path than widening them to int64 first and gathering with those.
    advantages = torch.from_numpy(table).index_select(0, token_slot.view(-1).long()).view(token_slot.shape)
    return advantages.mul_(response_mask)
