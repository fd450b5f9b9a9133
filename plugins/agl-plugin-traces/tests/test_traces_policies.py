"""Rows of several policies: each policy's calls aggregated apart, a ``policy`` column, groups by (policy, task)."""

from __future__ import annotations

import numpy as np
import torch

from agl_core.algorithms.advantages import grpo
from agl_core.policy_rows import aggregate_by_policy, policy_view

from agl_plugin_traces.trajectory import trajectory_batch
from traces_testkit import llm, reward, rollout


def game(rollout_id: str, task_id: str, final: float):
    # The solver's second call extends the planner's context: the aggregator must still not merge them.
    return rollout([llm(0, [1, 2], [3], policy="planner", rollout_id=rollout_id),
                    llm(1, [1, 2, 3, 4], [5, 6], policy="solver", rollout_id=rollout_id),
                    llm(2, [9], [8], policy="critic", rollout_id=rollout_id),
                    reward(3, final, rollout_id=rollout_id)], rollout_id=rollout_id, task_id=task_id,
                   final_reward=final)


def aggregate(rollouts):
    return trajectory_batch(rollouts, 8, 8)[0]


def test_each_trained_policy_gets_its_own_rows_grouped_by_policy_and_task():
    rollouts = [game("r0", "t0", 1.0), game("r1", "t0", 0.0), game("r2", "t1", 1.0)]
    batch = aggregate_by_policy(aggregate, rollouts, trained=["planner", "solver"])
    assert list(batch["policy"]) == ["planner"] * 3 + ["solver"] * 3  # the critic (not trained) makes none
    assert list(batch["uid"]) == ["planner/t0", "planner/t0", "planner/t1", "solver/t0", "solver/t0", "solver/t1"]
    # Never merged across policies: the solver's row holds only its own response.
    solver = batch["responses"][3]
    assert solver[:2].tolist() == [5, 6] and batch["response_mask"][3].sum() == 2
    assert batch["token_level_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]  # each gets the reward
    # Advantages by uid are within (policy, task): each policy's t0 pair is baselined on its own.
    scores = batch["token_level_scores"]
    adv, _ = grpo(scores, batch["response_mask"].float(), batch["uid"])
    per_row = adv.sum(-1) / batch["response_mask"].sum(-1)
    assert torch.allclose(per_row[[0, 1]], per_row[[3, 4]]) and per_row[0] > 0 > per_row[1]


def test_views_keep_rewards_and_only_their_policys_calls():
    view = policy_view(game("r0", "t0", 1.0), "solver")
    assert [(s.kind, s.attributes.get("policy")) for s in view.spans] == [("llm_call", "solver"), ("reward", None)]
    assert policy_view(game("r0", "t0", 1.0), "judge") is None


def test_no_trained_policy_called_gives_an_empty_batch():
    assert len(aggregate_by_policy(aggregate, [game("r0", "t0", 1.0)], trained=["judge"])) == 0
