"""Rollout-level estimators: one vote per rollout in its group, broadcast to the rollout's rows."""

import pytest
import torch

from agl_core.algorithms import advantages as A
from agl_core.config import AlgorithmConfig
from agl_plugin_traces.advantage import ROLLOUT_ESTIMATORS
from agl_plugin_traces.transition import transition_batch
from traces_testkit import llm, rollout

# (task, reward, turns) per rollout: the long rollouts of group "a" must not weigh more than the short ones.
ROLLOUTS = [("a", 1.0, 8), ("a", 0.0, 1), ("a", 0.0, 1), ("b", 0.5, 3), ("b", 1.0, 2), ("c", 1.0, 4)]


def batch_of(spec, max_response=4):
    rollouts = []
    for i, (task, value, turns) in enumerate(spec):
        rid = f"r{i}"
        spans = [llm(t, [t + 1], [10 + t] * (1 + t % 3), rollout_id=rid) for t in range(turns)]
        rollouts.append(rollout(spans, rollout_id=rid, task_id=task, final_reward=value))
    batch = transition_batch(rollouts, 4, max_response)[0]
    batch["token_level_rewards"] = batch["token_level_scores"].clone()
    return batch


@pytest.mark.parametrize(("name", "estimator"), [
    ("grpo_rollout", lambda r, m, i: A.grpo(r, m, i)),
    ("rloo_rollout", lambda r, m, i: A.rloo(r, m, i)),
    ("reinforce_plus_plus_baseline_rollout", lambda r, m, i: A.reinforce_plus_plus_baseline(r, m, i)),
])
def test_a_multi_turn_rollout_weighs_as_much_as_a_single_turn_one(name, estimator):
    config = AlgorithmConfig()
    multi = batch_of(ROLLOUTS)
    single = batch_of([(task, value, 1) for task, value, _ in ROLLOUTS])  # one row (of one token) per rollout
    expected, _ = estimator(single["token_level_rewards"], single["response_mask"], single["uid"])
    advantages, returns = ROLLOUT_ESTIMATORS[name](multi, config)
    assert torch.equal(advantages, returns)
    rollout_index = {rid: i for i, rid in enumerate(single["rollout_id"])}
    for row in range(len(multi)):
        mask = multi["response_mask"][row].bool()
        value = expected[rollout_index[multi["rollout_id"][row]], 0]
        assert torch.allclose(advantages[row][mask], value.expand(int(mask.sum())), atol=1e-6)
        assert not advantages[row][~mask].any()


def test_grpo_per_row_is_biased_by_turn_count_and_the_rollout_level_one_is_not():
    multi = batch_of(ROLLOUTS)
    per_row, _ = A.grpo(multi["token_level_rewards"], multi["response_mask"], multi["uid"])
    per_rollout, _ = ROLLOUT_ESTIMATORS["grpo_rollout"](multi, AlgorithmConfig())
    first_row = {rid: row for row, rid in reversed(list(enumerate(multi["rollout_id"])))}
    winner = first_row["r0"]  # 8 rows with reward 1 against two 1-row rollouts with 0 in group a
    # Per row, the 8 copies pull the group mean up to 0.8: the winner's advantage shrinks to ~0.5.
    assert per_row[winner, 0] < 0.6
    # Per rollout, the group is {1, 0, 0}: mean 1/3, std 0.577, advantage (1 - 1/3) / 0.577 = 1.155.
    assert per_rollout[winner, 0] == pytest.approx(2 / 3 / (1 / 3) ** 0.5, rel=1e-5)


def test_the_rollout_reward_includes_what_the_loop_put_in_token_level_rewards():
    batch = batch_of([("a", 1.0, 2), ("a", 0.0, 2)])
    batch["token_level_rewards"][0, 0] -= 0.5  # a KL penalty on one token of the first rollout's first row
    advantages, _ = ROLLOUT_ESTIMATORS["rloo_rollout"](batch, AlgorithmConfig())
    # rollout rewards: (0.5 + 1) / 2 = 0.75 and 0; rloo with n = 2: A = 0.75 - 0 and 0 - 0.75
    assert advantages[0, 0] == pytest.approx(0.75) and advantages[2, 0] == pytest.approx(-0.75)


def test_grpo_passk_rollout_credits_the_best_rollout_of_each_group():
    batch = batch_of([("a", 1.0, 3), ("a", 0.0, 1), ("b", 0.5, 2), ("b", 0.25, 2)])
    advantages, _ = ROLLOUT_ESTIMATORS["grpo_passk_rollout"](batch, AlgorithmConfig(norm_adv_by_std_in_grpo=False))
    per_row = advantages.sum(-1) / batch["response_mask"].sum(-1)
    assert per_row.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0, 0.25, 0.25, 0.0, 0.0])
