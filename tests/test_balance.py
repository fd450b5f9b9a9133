"""agl_core.balance against verl 0.9.1's seqlen balancing and RayPPOTrainer._balance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from agl_core.balance import balanced_order, balanced_partitions
from agl_core.data import Batch


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("equal_size", [True, False])
def test_partitions_match_verl(seed, equal_size):
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 9))
    n = k * int(rng.integers(1, 40))
    # Small value ranges force ties, which is where tie-breaking shows.
    high = [5, 50, 5000][seed % 3]
    seqlens = rng.integers(0, high, n).tolist()
    ours = balanced_partitions(seqlens, k, equal_size=equal_size)
    theirs = get_seqlen_balanced_partitions(seqlens, k, equal_size=equal_size)
    assert ours == theirs
    assert sorted(sum(seqlens[i] for i in part) for part in ours) == sorted(
        sum(seqlens[i] for i in part) for part in theirs)


def test_partitions_of_floats_and_arrays_match_verl():
    rng = np.random.default_rng(0)
    values = rng.random(96) * 100
    assert balanced_partitions(values, 6) == get_seqlen_balanced_partitions(values.tolist(), 6, equal_size=True)


def test_partition_properties():
    seqlens = list(range(1, 17))
    parts = balanced_partitions(seqlens, 4)
    assert sorted(i for part in parts for i in part) == list(range(16))
    assert all(len(part) == 4 and part == sorted(part) for part in parts)
    sums = [sum(seqlens[i] for i in part) for part in parts]
    assert max(sums) - min(sums) <= 1
    assert balanced_partitions([5, 3], 1) == [[0, 1]]


def test_partition_errors():
    with pytest.raises(ValueError, match="k must be >= 1"):
        balanced_partitions([1, 2], 0)
    with pytest.raises(ValueError, match="cannot split 2 items into 3"):
        balanced_partitions([1, 2], 3, equal_size=False)
    with pytest.raises(ValueError, match="5 % 2 = 1"):
        balanced_partitions([1, 2, 3, 4, 5], 2)


def batch_with_lengths(lengths: list[int], width: int = 64) -> Batch:
    n = len(lengths)
    lengths_t = torch.tensor(lengths)
    mask = (torch.arange(width) < lengths_t[:, None]).long()
    return Batch({"attention_mask": mask, "row": torch.arange(n), "data": torch.randn(n, 3)},
                 {"uid": np.array([f"r{i}" for i in range(n)], dtype=object)}, {"keep": 1})


def balance(batch: Batch, world_size: int):
    """The batch in ``balanced_order`` of its rows' valid tokens, as the loop applies it."""
    seqlens = batch["attention_mask"].sum(-1).numpy() if "attention_mask" in batch else []
    order, metrics = balanced_order(seqlens, world_size)
    return batch.select(order), metrics


def verl_balance(batch: Batch, world_size: int):
    """Run verl's RayPPOTrainer._balance on a DataProto copy of ``batch`` (a trainer stub supplies dp size)."""

    class Trainer:
        use_prefix_grouper = False
        actor_rollout_wg = None

        def _get_dp_size(self, worker_group, role):
            return world_size

    data = batch.to_dataproto()
    metrics: dict = {}
    RayPPOTrainer._balance_batch(Trainer(), data, metrics)
    return data, metrics


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_balance_matches_verl(seed, world_size):
    rng = np.random.default_rng(seed)
    n = world_size * int(rng.integers(1, 20))
    batch = batch_with_lengths(rng.integers(1, 65, n).tolist())
    ours, metrics = balance(batch, world_size)
    theirs, verl_metrics = verl_balance(batch, world_size)
    assert ours["row"].tolist() == theirs.batch["row"].tolist()
    assert list(ours["uid"]) == list(theirs.non_tensor_batch["uid"])
    assert torch.equal(ours["data"], theirs.batch["data"])
    assert metrics == verl_metrics
    assert ours.meta == {"keep": 1}


def test_balance_evens_out_tokens():
    lengths = [64] * 8 + [1] * 8  # all long rows first: the worst order for 2 ranks
    batch = batch_with_lengths(lengths)
    balanced, metrics = balance(batch, 2)
    halves = balanced["attention_mask"].sum(-1).reshape(2, -1).sum(-1).tolist()
    assert halves == [260, 260]
    assert metrics == {"global_seqlen/min": 8.0, "global_seqlen/max": 512.0, "global_seqlen/minmax_diff": 504.0,
                       "global_seqlen/balanced_min": 260.0, "global_seqlen/balanced_max": 260.0,
                       "global_seqlen/mean": 260.0}


def test_world_size_one_keeps_the_order():
    batch = batch_with_lengths([5, 60, 2, 33])
    balanced, metrics = balance(batch, 1)
    assert balanced["row"].tolist() == [0, 1, 2, 3]
    assert metrics["global_seqlen/min"] == metrics["global_seqlen/balanced_max"] == 100.0
    assert metrics["global_seqlen/mean"] == 100.0


def test_balance_edge_cases():
    balanced, metrics = balance(Batch.empty(), 4)
    assert len(balanced) == 0 and metrics == {}
    with pytest.raises(ValueError, match="cannot balance 6 rows over 4 ranks"):
        balance(batch_with_lengths([1] * 6), 4)
    with pytest.raises(ValueError, match="world_size"):
        balance(batch_with_lengths([1] * 4), 0)
