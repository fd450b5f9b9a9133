"""Filters after aggregation: zero-variance groups and the cap on rows per rollout."""

import numpy as np

from agl_plugin_traces.filters import cap_rows_per_rollout, drop_zero_variance_groups, rollout_rewards
from agl_plugin_traces.transition import transition_batch
from traces_testkit import llm, reward, rollout


def batch_of(rewards_by_task, turns=1, per_call=None):
    """One rollout per reward, ``turns`` calls each; tasks named by the dict keys."""
    rollouts = []
    for task, rewards in rewards_by_task.items():
        for i, value in enumerate(rewards):
            rid = f"{task}-{i}"
            spans = [llm(t, [t + 1], [10 + t], rollout_id=rid) for t in range(turns)]
            if per_call is not None:
                spans.append(reward(turns, per_call[rid], rollout_id=rid))
            rollouts.append(rollout(spans, rollout_id=rid, task_id=task, final_reward=value))
    return transition_batch(rollouts, 4, 4, per_call_rewards=per_call is not None)[0]


def test_rollout_reward_is_the_mean_of_its_rows():
    batch = batch_of({"t": [0.7, 0.2]}, turns=3, per_call={"t-0": 1.0, "t-1": 0.2})
    rollout, value = rollout_rewards(batch)
    assert rollout.tolist() == [0, 0, 0, 1, 1, 1]
    # t-0: rows 0.7, 0.7, 1.0 (its last call emitted 1.0); t-1: 0.2 everywhere
    assert np.allclose(value.numpy(), [(0.7 + 0.7 + 1.0) / 3, 0.2])


def test_groups_whose_rollouts_all_score_the_same_are_dropped():
    batch = batch_of({"same": [0.7, 0.7, 0.7], "mixed": [0.0, 1.0], "alone": [1.0], "zeros": [0.0, 0.0]}, turns=2)
    kept, metrics = drop_zero_variance_groups(batch)
    assert set(kept["uid"]) == {"mixed"} and len(kept) == 4
    assert metrics == {"training/n_groups_zero_variance": 3.0, "training/n_triplets_zero_variance": 12.0}


def test_nothing_to_drop_returns_the_batch_itself():
    batch = batch_of({"a": [0.0, 1.0]})
    kept, metrics = drop_zero_variance_groups(batch)
    assert kept is batch and metrics["training/n_groups_zero_variance"] == 0


def test_rows_per_rollout_are_capped_at_random_keeping_their_order():
    batch = batch_of({"a": [0.0, 1.0], "b": [1.0]}, turns=5)
    kept, metrics = cap_rows_per_rollout(batch, 2, np.random.default_rng(0))
    assert metrics == {"training/n_triplets_over_rollout_cap": 9.0}
    per_rollout = {}
    for rid, turn in zip(kept["rollout_id"], kept["turn_index"]):
        per_rollout.setdefault(rid, []).append(int(turn))
    assert set(per_rollout) == {"a-0", "a-1", "b-0"}
    assert all(len(turns) == 2 and turns == sorted(turns) for turns in per_rollout.values())
    choices = {tuple(cap_rows_per_rollout(batch, 2, np.random.default_rng(seed))[0]["turn_index"].tolist())
               for seed in range(10)}
    assert len(choices) > 1  # a random subset, not always the same turns


def test_the_cap_keeps_rows_marked_for_dropping_last():
    batch = batch_of({"a": [1.0]}, turns=4)
    batch["is_drop_mask"][[0, 1]] = True
    for seed in range(5):
        kept, _ = cap_rows_per_rollout(batch, 2, np.random.default_rng(seed))
        assert kept["turn_index"].tolist() == [2, 3]


def test_a_cap_above_every_rollout_keeps_the_batch():
    batch = batch_of({"a": [1.0, 0.0]}, turns=2)
    kept, metrics = cap_rows_per_rollout(batch, 2, np.random.default_rng(0))
    assert kept is batch and metrics["training/n_triplets_over_rollout_cap"] == 0
