"""The row filters the loop applies after advantages, as the reference trainer does."""

from __future__ import annotations

import numpy as np

from agl_core.data import Batch


def drop_marked_rows(batch: Batch) -> tuple[Batch, dict[str, float]]:
    """Remove rows whose ``is_drop_mask`` is set (prompt over the length limit)."""
    keep = (~batch["is_drop_mask"].bool()).nonzero(as_tuple=True)[0]
    metrics = {"training/n_triplets_prompt_too_long": float(len(batch) - len(keep))}
    if len(keep) == len(batch):
        return batch, metrics
    return batch[keep], metrics


def shuffle_and_floor(batch: Batch, multiple: int, rng: np.random.Generator) -> tuple[Batch, dict[str, float]]:
    """Shuffle the rows and keep the largest multiple of ``multiple`` (the PPO mini-batch).

    Shuffling first makes the dropped remainder a random subset, not always
    the last rollouts.
    """
    kept = len(batch) // multiple * multiple
    order = rng.permutation(len(batch))[:kept]
    return batch[order], {"training/n_triplets_dropped_remainder": float(len(batch) - kept)}
