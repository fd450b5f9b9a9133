"""Row filters that run after aggregation: zero-variance groups and a cap on rows per rollout.

Both work on whole rollouts. A rollout's reward here is the mean, over its
rows, of the row's summed ``token_level_scores``: exactly the rollout's
reward when every row carries it (the default), and a fair summary when
calls carry rewards of their own. The rollout-level estimators
(:mod:`agl_plugin_traces.advantage`) use the same definition.
"""

from __future__ import annotations

import numpy as np
import torch

from agl_core.algorithms.advantages import group_ids
from agl_core.data import Batch


def rollout_rewards(batch: Batch, column: str = "token_level_scores") -> tuple[torch.Tensor, torch.Tensor]:
    """``(rollout of each row, reward of each rollout)``.

    Rollouts are numbered ``0..n-1`` in order of first appearance (a (rows,)
    LongTensor); each reward is the mean of its rows' summed ``column`` (a
    float64 (n,) tensor, so that the mean of equal rewards is that reward).
    """
    rollout, n = group_ids(batch["rollout_id"])
    row_reward = batch[column].sum(-1, dtype=torch.float64)
    rows_per_rollout = torch.bincount(rollout, minlength=n)
    return rollout, torch.zeros(n, dtype=torch.float64).index_add_(0, rollout, row_reward) / rows_per_rollout


def drop_zero_variance_groups(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """Remove the rows of every group (``uid``) whose rollouts all have the same reward.

    Such a group teaches a group-relative estimator nothing (every advantage
    is 0) but still costs a forward and backward pass. A group of a single
    rollout has zero variance too (DAPO's dynamic sampling drops it as well).
    """
    rollout, reward = rollout_rewards(batch)
    group, n_groups = group_ids(batch["uid"])
    group_of_rollout = torch.zeros(len(reward), dtype=torch.long).index_copy_(0, rollout, group)
    spread = (torch.full((n_groups,), -torch.inf, dtype=torch.float64)
              .scatter_reduce(0, group_of_rollout, reward, "amax")
              - torch.full((n_groups,), torch.inf, dtype=torch.float64)
              .scatter_reduce(0, group_of_rollout, reward, "amin"))
    flat = spread == 0
    keep = ~flat[group]
    metrics = {"training/n_groups_zero_variance": float(flat.sum()),
               "training/n_triplets_zero_variance": float((~keep).sum())}
    return (batch if bool(keep.all()) else batch[keep.nonzero(as_tuple=True)[0]]), metrics


def cap_rows_per_rollout(batch: Batch, max_rows: int, rng: np.random.Generator) -> tuple[Batch, dict[str, float]]:
    """Keep at most ``max_rows`` rows of each rollout, chosen at random, rows kept in their order.

    Rows already marked in ``is_drop_mask`` are chosen last, since the loop
    drops them anyway.
    """
    rollout, _ = group_ids(batch["rollout_id"])
    rollout = rollout.numpy()
    # Sort rows by rollout, then by a random key that puts rows marked for dropping last.
    key = rng.random(len(batch)) + batch["is_drop_mask"].numpy()
    order = np.lexsort((key, rollout))
    sorted_rollout = rollout[order]
    first_of_rollout = np.flatnonzero(np.r_[True, sorted_rollout[1:] != sorted_rollout[:-1]])
    rank = np.arange(len(order)) - np.repeat(first_of_rollout, np.diff(np.r_[first_of_rollout, len(order)]))
    keep = np.sort(order[rank < max_rows])
    metrics = {"training/n_triplets_over_rollout_cap": float(len(batch) - len(keep))}
    return (batch if len(keep) == len(batch) else batch[keep]), metrics
