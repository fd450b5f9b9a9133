"""The calls of a batch's rows as the step-level estimators read them, from the per-call columns.

The glue between :class:`agl_core.data.Batch` and the pure tensor math of
:mod:`agl_core.algorithms.turn_advantages`: it reads the columns the
aggregators write (:data:`agl_core.data.CALL_COLUMNS`, ``turn_ids``) into one
entry per call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agl_core.algorithms.advantages import group_ids
from agl_core.data import OWN_REWARD_SOURCES, Batch



@dataclass
class BatchCalls:
    """The calls of a batch's rows, one entry each (K calls), as the step-level estimators read them."""

    reward: torch.Tensor  # (K,) float64: ``call_rewards`` (the call's own, else its rollout's)
    own: torch.Tensor  # (K,) bool: the reward is the call's own (the agent's or a judge's)
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
        own = torch.from_numpy(np.isin(batch["call_reward_sources"][valid], OWN_REWARD_SOURCES))
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
