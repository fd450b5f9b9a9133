"""The per-call columns of real aggregator rows through verl's DataProto and the estimator bridge."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from agl_plugin_traces.trajectory import trajectory_batch

from agl_core.builtin import estimators
from agl_core.config import AlgorithmConfig
from agl_core.data import CALL_COLUMNS, Batch, Rollout
from agl_core.testing.rollouts import multi_turn_rollout

from agl_plugin_verl.bridge import agl_estimator_for_verl

from verl import DataProto


def game(rollout_id: str, task_id: str, rewards: list[float | None], keys: list[str | None]) -> Rollout:
    return multi_turn_rollout(rollout_id, task_id, rewards, keys, response_length=2)


def rows() -> Batch:
    rollouts = [game(f"r{i}", f"t{i % 2}", [float(i % 3), None, float(i % 4)][: 2 + i % 2], ["a", f"s{i % 2}", None])
                for i in range(8)]
    batch = trajectory_batch(rollouts, 2, 16)[0]
    batch["token_level_rewards"] = batch["token_level_scores"]
    return batch


def same_columns(a, b) -> None:
    for name in ("turn_ids", *CALL_COLUMNS):
        x, y = a[name], b[name]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), name
        else:
            assert x.shape == y.shape and [str(v) for v in x.ravel()] == [str(v) for v in y.ravel()], name


def test_the_columns_survive_dataproto_and_its_row_operations():
    batch = rows()
    data = batch.to_dataproto()
    assert data.batch["turn_ids"].data_ptr() == batch["turn_ids"].data_ptr()
    same_columns(Batch.from_dataproto(data), batch)
    # verl's own row operations (chunk, concat, select by index, union) keep them row for row.
    joined = DataProto.concat(data.chunk(2))
    same_columns(Batch.from_dataproto(joined), batch)
    picked = data.select_idxs(np.array([5, 0, 3]))
    same_columns(Batch.from_dataproto(picked), batch.select([5, 0, 3]))
    same_columns(Batch.from_dataproto(data.union(data)), batch)


def test_a_step_level_estimator_in_verls_signature_reads_the_columns():
    """Handed the whole batch (as verl's compute_advantage hands GDPO), the bridged gigpo computes what the
    advantage slot computes."""
    batch = rows()
    config = AlgorithmConfig(estimator="gigpo", gamma=0.9)
    gigpo = estimators.functools.partial(estimators._gigpo, settings=estimators.GiGPOConfig())
    expected, _ = gigpo(batch, config)
    data = batch.to_dataproto()
    bridged = agl_estimator_for_verl("gigpo", gigpo)
    got, _ = bridged(data.batch["token_level_rewards"], data.batch["response_mask"], index=data.non_tensor_batch["uid"],
                     config=SimpleNamespace(gamma=0.9), batch=data.batch, non_tensor_batch=data.non_tensor_batch)
    torch.testing.assert_close(got, expected)
    assert expected.abs().sum() > 0
