"""The calls of a batch's rows as the step-level estimators read them, from the per-call columns.

The glue between :class:`agl_core.data.Batch` and the pure tensor math of
:mod:`agl_core.algorithms.turn_advantages`: it reads the columns the
aggregators write (:data:`agl_core.data.CALL_COLUMNS`, ``turn_ids``) into one
entry per call. Only integers and floats: state keys are read as their ids
(``call_state_ids``), so no Python object is touched per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agl_core.algorithms.advantages import group_ids
from agl_core.algorithms.turn_advantages import call_ranks
from agl_core.data import REWARD_FROM_ROLLOUT, Batch, state_key_ids


@dataclass
class BatchCalls:
    """The calls of a batch's rows, one entry each (K calls), as the step-level estimators read them."""

    reward: torch.Tensor  # (K,) float64: ``call_rewards`` (the call's own, else its rollout's)
    own: torch.Tensor  # (K,) bool: the reward is the call's own (the agent's or a judge's)
    kl: torch.Tensor | None  # (K,) float64: the KL penalty in the reward on the call's tokens; None: no penalty
    turn: torch.Tensor  # (K,) long: position in the trace
    rank: torch.Tensor  # (K,) long: the call's rank among its rollout's calls by turn (0: the first in the batch)
    length: int  # the most calls of one rollout
    rectangular: bool  # every rollout has ``length`` calls, listed rollout-major in turn order: call k is rollout
    # k // length's call of rank k % length (turn_advantages.gigpo: its sums and scans need no scatter)
    rollout: torch.Tensor  # (K,) long: dense rollout id
    n_rollouts: int
    group: torch.Tensor  # (K,) long: dense id of the call's group (its row's ``uid``)
    rollout_group: torch.Tensor  # (n_rollouts,) long: dense group id of each rollout
    state: torch.Tensor  # (K,) long: the call's ``call_state_ids`` (its state key's id), -1 for a call without one
    call_slot: torch.Tensor  # (K,) long: each call's slot (see turn_advantages.to_tokens)
    token_slot: torch.Tensor  # (B, T) int32 (int64 past 2^31 slots): each token's slot, its call's; a token no call
    # generated has its row's first slot, which no call holds
    n_slots: int


def batch_calls(batch: Batch) -> BatchCalls:
    """The calls of ``batch`` from its per-call columns (:data:`agl_core.data.CALL_COLUMNS`, ``turn_ids``).

    Rows without those columns (an aggregator that does not write them)
    are taken as one call each: its turn the row's ``turn_index`` (0 when
    absent), its reward the row's summed scores, the rollout's. Rows with
    ``call_state_keys`` but no ``call_state_ids`` get the ids here. The rows
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
        valid = call_turns >= 0
        # Rows that all hold as many calls as the columns are wide (a row per call, merged rows of equal length):
        # the calls are the columns' entries in order, read as views. Else they are read at the flat positions of
        # the entries that hold a call (row by row, each row's in call order): one search for them, then a
        # gather per column, cheaper than a boolean index per column.
        every = bool(valid.all())
        at = None if every else np.flatnonzero(valid)
        calls_of = np.ravel if every else (lambda column: column.reshape(-1).take(at))
        calls_per_row = call_turns.shape[1] if every else np.bincount(at // call_turns.shape[1], minlength=n)
        turn = torch.from_numpy(calls_of(call_turns))
        reward = torch.from_numpy(calls_of(batch["call_rewards"]).astype(np.float64, copy=False))
        # The sources are the three of data.py; all but the rollout's are the call's own (OWN_REWARD_SOURCES):
        # one comparison of fixed-width strings where naming the two would take two (before the gather, which
        # moves strings slowly).
        own = torch.from_numpy(calls_of(batch["call_reward_sources"] != REWARD_FROM_ROLLOUT))
        state = torch.from_numpy(calls_of(batch["call_state_ids"]) if "call_state_ids" in batch
                                 else state_key_ids(calls_of(batch["call_state_keys"])))
        turn_ids = batch["turn_ids"]
    else:
        calls_per_row, at = 1, None
        turn = torch.from_numpy(np.asarray(batch["turn_index"], dtype=np.int64)) if "turn_index" in batch \
            else torch.zeros(n, dtype=torch.long)
        call_turns = turn.numpy()[:, None]
        valid = call_turns >= 0
        reward = scores.sum(-1, dtype=torch.float64)
        own = torch.zeros(n, dtype=torch.bool)
        state = torch.full((n,), -1, dtype=torch.long)
        turn_ids = torch.where(mask.bool(), turn[:, None], -1).to(torch.int32)
    call_slot, token_slot, n_slots = _slots(call_turns, valid, calls_per_row, at, turn_ids)
    kl = None
    if rewards.data_ptr() != scores.data_ptr():  # the KL penalty is in the reward
        penalty = np.bincount(token_slot.numpy().ravel(), (rewards - scores).to(torch.float64).numpy().ravel(),
                              n_slots)
        kl = torch.from_numpy(penalty[call_slot])
    rollout_of_row, n_rollouts = group_ids(batch["rollout_id"])
    if n_rollouts == n:  # a row per rollout, numbered in row order: rollout r is row r
        rollout_group, _ = group_ids(batch["uid"])
    else:  # a rollout's rows share its uid: the groups are read off each rollout's first row
        first_row = _first_rows(rollout_of_row.numpy(), n_rollouts)
        rollout_group, _ = group_ids(np.asarray(batch["uid"])[first_row])
    # Each row's rollout and group, repeated for its calls: NumPy's repeat, cheaper than a gather per call.
    rollout = torch.from_numpy(np.repeat(rollout_of_row.numpy(), calls_per_row))
    group = torch.from_numpy(np.repeat(rollout_group.numpy().take(rollout_of_row.numpy()), calls_per_row))
    # A row per rollout, each with as many calls (merged trajectories), or each rollout's calls in one run of
    # rows in turn order, as many each (a row per call): the calls are a (rollouts, length) matrix.
    rectangular = (n_rollouts == n and np.ndim(calls_per_row) == 0) or _in_runs(rollout.numpy(), turn.numpy(),
                                                                                  n_rollouts)
    if rectangular:
        length = len(turn) // n_rollouts if n_rollouts else 0
        rank = torch.from_numpy(np.tile(np.arange(length), n_rollouts))
    elif n_rollouts == n:  # a row per rollout (merged trajectories): a call's rank is its place in its row
        rank = torch.from_numpy(np.arange(len(turn)) - np.repeat(np.cumsum(calls_per_row) - calls_per_row,
                                                                  calls_per_row))
        length = int(calls_per_row.max(initial=0))
    else:
        rank, length = call_ranks(rollout, turn)
    return BatchCalls(reward=reward, own=own, kl=kl, turn=turn, rank=rank, length=length, rectangular=rectangular,
                      rollout=rollout, n_rollouts=n_rollouts,
                      group=group, rollout_group=rollout_group, state=state,
                      call_slot=torch.from_numpy(call_slot), token_slot=token_slot, n_slots=n_slots)


def _in_runs(rollout: np.ndarray, turn: np.ndarray, n_rollouts: int) -> bool:
    """Whether the calls (``rollout`` (K,) dense ids in order of first appearance, ``turn`` (K,)) are each
    rollout's in one run, the runs equally long and each in turn order. Two passes over the calls where
    :func:`~agl_core.algorithms.turn_advantages.call_ranks` makes a dozen."""
    if not n_rollouts or len(rollout) % n_rollouts:
        return False
    by_rollout = rollout.reshape(n_rollouts, -1)
    turns = turn.reshape(n_rollouts, -1)
    return bool((by_rollout == np.arange(n_rollouts)[:, None]).all() and (turns[:, 1:] > turns[:, :-1]).all())


def _first_rows(rollout: np.ndarray, n_rollouts: int) -> np.ndarray:
    """Each rollout's first row (n_rollouts,), rollouts numbered in order of first appearance (``group_ids``)."""
    starts = np.flatnonzero(np.diff(rollout, prepend=-1))
    if len(starts) == n_rollouts:  # each rollout's rows together (what the aggregators write): its run's start
        return starts
    # A rollout's first row raises the running maximum.
    return np.flatnonzero(np.diff(np.maximum.accumulate(rollout), prepend=-1))


def _slots(call_turns: np.ndarray, valid: np.ndarray, calls_per_row: int | np.ndarray, at: np.ndarray | None,
           turn_ids: torch.Tensor) -> tuple[np.ndarray, torch.Tensor, int]:
    """``(call_slot, token_slot, n_slots)``: a slot per call (K,) and each token's (B, T), its call's. ``valid``
    marks the entries of ``call_turns`` that hold a call (each row's first ``calls_per_row``), ``at`` their flat
    positions (None: all of them).

    Row r owns slots ``r * W .. r * W + W - 1`` (W: one more than the widest
    span of turns in a row). Its first slot is its tokens' that no call
    generated (turn id -1); its calls take ``r * W + 1 + turn - first``
    (``first`` the row's first turn), so a token finds its call by arithmetic
    on its turn id, with no search. The calls in NumPy; the tokens, many
    more, in as few torch passes as the checks allow (torch's elementwise
    ops and row extrema are the faster on the CPU).
    """
    n, width_of_row = call_turns.shape
    every = at is None
    first = np.maximum(call_turns[:, 0], 0)  # a row's calls are in turn order; a row without calls has none
    starts_late = bool(first.any())  # some row's calls start after turn 0 (a row per call)
    offset = call_turns - first[:, None] if starts_late else call_turns
    width = int(offset.max(initial=0)) + 2
    row_start = np.arange(n) * width
    call_slot = offset + (row_start + 1)[:, None]
    call_slot = call_slot.reshape(-1) if every else call_slot.reshape(-1).take(at)
    # Slots as narrow as the turn ids where they fit: the passes over the tokens move half the bytes of int64.
    index = torch.int32 if n * width <= torch.iinfo(torch.int32).max else torch.int64
    token_slot = turn_ids.to(index) + torch.from_numpy(row_start + 1 - first).to(index)[:, None]
    # Every token's turn must be -1 or one of its row's calls: within [first, last], not on a turn its row's calls
    # skip, and the calls in turn order.
    if not turn_ids.shape[1]:
        return call_slot, token_slot, n * width
    # Each row's last call: its calls are in turn order (a row whose calls are not is refused below: its turns skip).
    last = call_turns[:, -1] if every else _last_calls(call_turns, calls_per_row)
    if starts_late:
        # A row whose calls start after turn 0 (a row per call): its tokens of turn -1 land below its first slot
        # and are raised to it. Masking the sign bit turns -1 into the largest int32, out of the minimum's way.
        torch.maximum(token_slot, torch.from_numpy(row_start).to(index)[:, None], out=token_slot)
        outside = ((turn_ids.amin(1).numpy() < -1) | (turn_ids.amax(1).numpy() > last)
                   | ((turn_ids & torch.iinfo(torch.int32).max).amin(1).numpy() < first)).any()
    # Else every row's calls start at turn 0, and a token of turn -1 lands on its row's first slot as it is.
    elif len(last) and (last == last[0]).all():
        # Every row's calls also end at the same turn (merged rows of equal length): the batch's extrema, in one
        # pass, check every row's tokens.
        lowest, highest = torch.aminmax(turn_ids)
        outside = int(lowest) < -1 or int(highest) > last[0]
    else:
        outside = ((turn_ids.amin(1).numpy() < -1) | (turn_ids.amax(1).numpy() > last)).any()
    skips = offset != np.arange(width_of_row)
    if outside or (skips.any() if every else (skips & valid).any()):
        _check_listed(call_turns, turn_ids.numpy(), call_slot, first, row_start, n * width)
    return call_slot, token_slot, n * width


def _last_calls(call_turns: np.ndarray, calls_per_row: np.ndarray) -> np.ndarray:
    """Each row's last call's turn (-1 for a row without calls), its calls filling its first columns: a gather,
    where NumPy's maximum over each row's few entries costs three times as much."""
    n, width = call_turns.shape
    last_column = np.maximum(calls_per_row - 1, 0)
    return np.where(calls_per_row > 0, call_turns.reshape(-1).take(np.arange(n) * width + last_column), -1)


def _check_listed(call_turns, turn_ids, call_slot, first, row_start, n_slots) -> None:
    """Raise a ValueError naming the first row whose calls are out of turn order, or with a token whose turn id
    is neither -1 nor one of its row's calls."""
    order = np.diff(call_turns, axis=1) <= 0
    unordered = np.flatnonzero((order & (call_turns[:, 1:] >= 0)).any(1))
    if len(unordered):
        raise ValueError(f"row {int(unordered[0])}: call_turns lists its calls out of turn order "
                         f"({call_turns[unordered[0]].tolist()})")
    negative = np.flatnonzero((turn_ids < -1).any(1))
    if len(negative):
        raise ValueError(f"row {int(negative[0])}: turn_ids holds {int(turn_ids[negative[0]].min())}; a token no "
                         f"call generated holds -1")
    listed = np.zeros(n_slots + 1, dtype=bool)  # the last entry: a slot outside the table
    listed[call_slot] = True
    width = n_slots // len(call_turns)
    relative = turn_ids - first[:, None]
    slot = relative + (row_start + 1)[:, None]
    inside = (relative >= 0) & (relative < width - 1)  # on one of the row's own call slots
    missing = (turn_ids >= 0) & ~listed[np.where(inside, slot, n_slots)]
    if missing.any():
        bad_row = int(np.flatnonzero(missing.any(1))[0])
        raise ValueError(f"row {bad_row}: turn_ids names a call that call_turns does not list "
                         f"({sorted(set(turn_ids[bad_row][missing[bad_row]].tolist()))})")
