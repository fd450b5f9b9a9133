"""The row filters the loop applies after advantages, as the reference trainer does.

They work on row numbers, not on the batch: the loop composes drop, floor and
balance into one index and selects the rows once.
"""

from __future__ import annotations

import numpy as np
import torch


def rows_to_keep(is_drop_mask: torch.Tensor) -> tuple[np.ndarray, dict[str, float]]:
    """Row numbers whose ``is_drop_mask`` is not set (it marks prompts over the length limit)."""
    keep = np.flatnonzero(~is_drop_mask.bool().numpy())
    return keep, {"training/n_triplets_prompt_too_long": float(len(is_drop_mask) - len(keep))}


def shuffle_and_floor(rows: np.ndarray, multiple: int, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, float]]:
    """``rows`` shuffled, then cut to the largest multiple of ``multiple`` (the PPO mini-batch).

    Shuffling first makes the dropped remainder a random subset, not always
    the last rollouts.
    """
    kept = len(rows) // multiple * multiple
    return rng.permutation(rows)[:kept], {"training/n_triplets_dropped_remainder": float(len(rows) - kept)}
