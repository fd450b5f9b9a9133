"""Token balancing across data-parallel ranks (verl's ``RayPPOTrainer._balance_batch``).

The loop hands rank ``r`` the ``r``-th of ``world_size`` equal contiguous
chunks of the batch; reordering the rows so those chunks hold similar work
keeps ranks from waiting on the slowest one.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

__all__ = ["balanced_order", "balanced_partitions", "workload"]


class _Largest:
    """Heap tie-breaker: the state whose largest part is larger pops first (verl's order)."""

    __slots__ = ("part",)

    def __init__(self, part: tuple) -> None:
        self.part = part

    def __lt__(self, other: _Largest) -> bool:
        return _part_key(self.part) > _part_key(other.part)


def _part_key(part: tuple) -> tuple:
    # A part is (sum, indices); verl orders parts by sum, then size, then items.
    return part[0], len(part[1]), part[1]


def balanced_partitions(seqlens: Sequence[float] | np.ndarray, k: int, equal_size: bool = True) -> list[list[int]]:
    """Split ``range(len(seqlens))`` into ``k`` lists whose ``seqlens`` sums are close (largest differencing).

    The Karmarkar-Karp largest differencing method with verl's tie-breaking:
    the same partitions, in the same order, as verl's
    ``get_seqlen_balanced_partitions`` (for integer values; float sums may
    round differently on exact ties). Each list is sorted. With
    ``equal_size`` every list has ``len(seqlens) // k`` items, which
    requires ``len(seqlens) % k == 0``.
    """
    values = np.asarray(seqlens)
    n = len(values)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k:
        raise ValueError(f"cannot split {n} items into {k} non-empty partitions")
    if equal_size and n % k:
        raise ValueError(f"equal_size needs len(seqlens) divisible by k: {n} % {k} = {n % k}")
    # A state is its k parts, largest first, in a heap of
    #   (-spread, -largest part's sum, the largest part, parts)
    # so the largest spread pops first and, on a tie, the state with the larger largest part (verl's
    # order; states share no index, so no two tie on all of it). A part is (sum, indices): verl keeps
    # (index, value) pairs and breaks ties by comparing them; indices are unique, so comparing the indices
    # alone gives the same order. Python ints and floats, so sums add up as in verl.
    order = np.argsort(values, kind="stable")  # by value, ties by index: verl's sorted((value, index))
    if equal_size:
        # Each run of k consecutive values is spread one per part: reversed, it is in the parts' order.
        # Every merge keeps the parts of a state equally long, so parts compare as the plain tuples they are.
        by_part = None
        runs = order.reshape(-1, k)[:, ::-1]
        states = [list(zip(run_values, zip(run))) for run_values, run in zip(values[runs].tolist(), runs.tolist())]
    else:
        by_part = _part_key  # parts of one state differ in size: compare by (sum, size, indices)
        empty = [(0, ())] * (k - 1)
        states = [sorted([(value, (index,))] + empty, key=by_part, reverse=True)
                  for value, index in zip(values[order].tolist(), order.tolist())]
    heap = [(parts[-1][0] - parts[0][0], -parts[0][0], _Largest(parts[0]), parts) for parts in states]
    heapq.heapify(heap)
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[3], heapq.heappop(heap)[3]
        # The differencing step: pair the first state's largest part with the second's smallest, and so on.
        merged = [(a + b, mine + theirs) for (a, mine), (b, theirs) in zip(first, reversed(second))]
        merged.sort(key=by_part, reverse=True)
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], -merged[0][0], _Largest(merged[0]), merged))
    return [sorted(indices) for _, indices in heap[0][3]]


def workload(seqlens: np.ndarray) -> np.ndarray:
    """verl's ``calculate_workload``: the dense-transformer FLOPs of a 7B model per row, up to a constant."""
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
        order = np.arange(n).reshape(1, n)
    else:
        work = workload(seqlens)
        parts = np.array(balanced_partitions(work, world_size, equal_size=True))
        # Within a part: by workload (then row), arranged small-large-small.
        by_workload = np.take_along_axis(parts, np.lexsort((parts, work[parts]), axis=-1), axis=-1)
        order = np.concatenate([by_workload[:, ::2], by_workload[:, 1::2][:, ::-1]], axis=-1)
    before = seqlens.reshape(world_size, -1).sum(-1)
    after = seqlens[order].sum(-1)
    metrics = {
        "global_seqlen/min": before.min(),
        "global_seqlen/max": before.max(),
        "global_seqlen/minmax_diff": before.max() - before.min(),
        "global_seqlen/balanced_min": after.min(),
        "global_seqlen/balanced_max": after.max(),
        "global_seqlen/mean": before.sum() / world_size,
    }
    return order.reshape(-1).astype(np.int64), {key: float(value) for key, value in metrics.items()}
