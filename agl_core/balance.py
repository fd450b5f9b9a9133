"""Token balancing across data-parallel ranks (verl's ``RayPPOTrainer._balance_batch``).

The loop hands rank ``r`` the ``r``-th of ``world_size`` equal contiguous
chunks of the batch; reordering the rows so those chunks hold similar work
keeps ranks from waiting on the slowest one.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from agl_core.data import Batch

__all__ = ["balance_batch", "balanced_partitions"]


class _Part:
    """One growing partition: the sum of its values and its ``(index, value)`` items in insertion order."""

    __slots__ = ("items", "total")

    def __init__(self, items: list[tuple[int, float]]) -> None:
        self.items = items
        self.total = 0
        for _, value in items:
            self.total += value

    def key(self) -> tuple:
        # Total order on partitions (sum, then size, then items); verl breaks ties
        # the same way, which is what makes our partitions identical to its.
        return self.total, len(self.items), self.items


class _State:
    """A candidate k-way partition of some items; parts kept in decreasing order of ``_Part.key``."""

    __slots__ = ("parts",)

    def __init__(self, parts: list[_Part]) -> None:
        self.parts = sorted(parts, key=_Part.key, reverse=True)

    def spread(self) -> float:
        return self.parts[0].total - self.parts[-1].total

    def __lt__(self, other: _State) -> bool:
        # heapq pops the smallest state: make it the one with the largest spread,
        # then the one with the largest biggest part.
        return (self.spread(), self.parts[0].key()) > (other.spread(), other.parts[0].key())

    def merge(self, other: _State) -> _State:
        """Pair this state's largest part with ``other``'s smallest, and so on (the differencing step)."""
        for mine, theirs in zip(self.parts, reversed(other.parts)):
            for item in theirs.items:
                # Item by item, as verl adds them, so float sums round the same way.
                mine.items.append(item)
                mine.total += item[1]
        return _State(self.parts)


def balanced_partitions(seqlens: Sequence[float] | np.ndarray, k: int, equal_size: bool = True) -> list[list[int]]:
    """Split ``range(len(seqlens))`` into ``k`` lists whose ``seqlens`` sums are close (largest differencing).

    The Karmarkar-Karp largest differencing method with verl's tie-breaking:
    the same partitions, in the same order, as verl's
    ``get_seqlen_balanced_partitions``. Each list is sorted. With
    ``equal_size`` every list has ``len(seqlens) // k`` items, which
    requires ``len(seqlens) % k == 0``.
    """
    values = seqlens.tolist() if isinstance(seqlens, np.ndarray) else list(seqlens)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if len(values) < k:
        raise ValueError(f"cannot split {len(values)} items into {k} non-empty partitions")
    if equal_size and len(values) % k:
        raise ValueError(f"equal_size needs len(seqlens) divisible by k: {len(values)} % {k} = {len(values) % k}")
    ordered = sorted((value, index) for index, value in enumerate(values))
    # Start states: with equal_size, each run of k consecutive values (by size)
    # is spread one per part, so every merge keeps the part sizes equal.
    group = k if equal_size else 1
    heap = [
        _State([_Part([(index, value)]) for value, index in ordered[start:start + group]]
               + [_Part([]) for _ in range(k - group)])
        for start in range(0, len(ordered), group)
    ]
    heapq.heapify(heap)
    while len(heap) > 1:
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        heapq.heappush(heap, first.merge(second))
    return [sorted(index for index, _ in part.items) for part in heap[0].parts]


def _workload(seqlens: np.ndarray) -> np.ndarray:
    # verl's calculate_workload: dense-transformer FLOPs of a 7B model, up to a constant.
    return 24576 * seqlens + seqlens**2


def balanced_order(seqlens: Sequence[float] | np.ndarray, world_size: int) -> tuple[np.ndarray, dict[str, float]]:
    """A row order in which each of ``world_size`` equal contiguous chunks carries a near-equal workload.

    ``seqlens`` are the rows' valid tokens (``attention_mask.sum(-1)``);
    select the batch's rows in the returned order. Same order and metrics
    as verl 0.9.1's ``RayPPOTrainer._balance_batch`` (without prefix
    grouping or mini-batch-preserving balancing): rows are partitioned by
    ``balanced_partitions`` on verl's workload estimate ``24576 * s + s**2``,
    and within a chunk the rows are arranged small-large-small to shorten
    pipeline bubbles. With ``world_size`` 1 the order is kept as is.
    Metrics, over per-chunk sums of valid tokens:
    ``global_seqlen/{min,max,minmax_diff}`` of the chunks before balancing,
    ``global_seqlen/{balanced_min,balanced_max}`` after, and
    ``global_seqlen/mean``. No rows give an empty order and no metrics.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    seqlens = np.asarray(seqlens)
    n = len(seqlens)
    if n == 0:
        return np.empty(0, dtype=np.int64), {}
    if n % world_size:
        raise ValueError(f"cannot balance {n} rows over {world_size} ranks: pad or floor the batch "
                         f"to a multiple of {world_size} first")
    if world_size == 1:
        partitions = [np.arange(n)]
    else:
        workload = _workload(seqlens)
        partitions = balanced_partitions(workload, world_size, equal_size=True)
        for i, part in enumerate(partitions):
            part.sort(key=lambda row: (workload[row], row))
            partitions[i] = part[::2] + part[1::2][::-1]
    before = seqlens.reshape(world_size, -1).sum(-1)
    after = np.array([seqlens[part].sum() for part in partitions])
    metrics = {
        "global_seqlen/min": before.min(),
        "global_seqlen/max": before.max(),
        "global_seqlen/minmax_diff": before.max() - before.min(),
        "global_seqlen/balanced_min": after.min(),
        "global_seqlen/balanced_max": after.max(),
        "global_seqlen/mean": before.sum() / world_size,
    }
    return np.concatenate(partitions).astype(np.int64), {key: float(value) for key, value in metrics.items()}
