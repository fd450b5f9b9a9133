"""The transition aggregator: one row per call, padding, limits, rewards, log-probs."""

import pytest
import torch

from agl_core.data import Rollout, Triplet
from agl_plugin_traces.transition import transition_batch
from traces_testkit import conversation, llm, logprobs_of, reward, rollout, rows, score_at


def test_one_row_per_call_with_the_rollout_reward_on_its_last_token():
    spans = conversation([1, 2], [([], [10, 11]), ([5], [12]), ([6, 7], [13, 14, 15])])
    batch, metrics = transition_batch([rollout(spans, final_reward=0.5)], 8, 4)
    got = rows(batch)
    assert [r.prompt for r in got] == [s.prompt_token_ids for s in spans]
    assert [r.response for r in got] == [[10, 11], [12], [13, 14, 15]]
    assert all(r.mask == [1] * len(r.response) for r in got)
    assert [score_at(r) for r in got] == [{1: 0.5}, {0: 0.5}, {2: 0.5}]
    assert [r.logprobs for r in got] == [pytest.approx(logprobs_of(r.response)) for r in got]
    assert [r.turn_index for r in got] == [0, 1, 2] and {r.rollout_id for r in got} == {"r0"}
    assert batch["prompts"].shape == (3, 8) and batch["responses"].shape == (3, 4)
    assert batch["input_ids"].dtype == torch.int64 and batch["token_level_scores"].dtype == torch.float32
    assert metrics["training/n_triplets"] == 3 and metrics["training/n_calls"] == 3


def test_turn_index_is_the_calls_position_in_the_trace():
    spans = [llm(0, [1], [10]), llm(1, [2], []), llm(2, [3], [30], error="boom"), llm(3, [4], [40])]
    assert [r.turn_index for r in rows(transition_batch([rollout(spans)], 4, 4)[0])] == [0, 3]


def test_a_prompt_over_the_limit_keeps_its_last_tokens_and_is_marked_for_dropping():
    batch, metrics = transition_batch([rollout([llm(0, [1, 2, 3, 4, 5], [10]), llm(1, [1, 2], [11])])], 3, 2)
    got = rows(batch)
    assert [(r.prompt, r.drop) for r in got] == [([3, 4, 5], True), ([1, 2], False)]
    assert metrics["training/n_triplets_prompt_too_long"] == 1


def test_a_response_over_the_limit_is_cut_counted_and_scored_on_its_last_kept_token():
    batch, metrics = transition_batch([rollout([llm(0, [1], [10, 11, 12, 13, 14])], final_reward=2.0)], 2, 3)
    (row,) = rows(batch)
    assert row.response == [10, 11, 12] and row.mask == [1, 1, 1]
    assert score_at(row) == {2: 2.0}
    assert row.logprobs == pytest.approx(logprobs_of([10, 11, 12]))
    assert metrics["training/n_triplets_response_truncated"] == 1


def test_per_call_rewards_score_their_call_and_the_others_get_the_rollout_reward():
    spans = [llm(0, [1], [10]), reward(1, 0.25), llm(2, [2], [20]), llm(3, [3], [30]), reward(4, -1.0)]
    r = rollout(spans, final_reward=1.0)
    default, _ = transition_batch([r], 2, 2)
    assert [score_at(row) for row in rows(default)] == [{0: 1.0}] * 3
    per_call, _ = transition_batch([r], 2, 2, per_call_rewards=True)
    assert [score_at(row) for row in rows(per_call)] == [{0: 0.25}, {0: 1.0}, {0: -1.0}]


def test_rollout_log_probs_only_when_every_call_has_them():
    batch, _ = transition_batch([rollout([llm(0, [1], [10]), llm(1, [2], [20], logprobs=False)])], 2, 2)
    assert "rollout_log_probs" not in batch
    assert len(batch) == 2


def test_groups_are_task_ids_over_several_rollouts_of_a_task():
    rollouts = [rollout([llm(0, [1], [10])], rollout_id=f"r{i}", task_id=f"t{i // 2}") for i in range(4)]
    batch, _ = transition_batch(rollouts, 2, 2)
    assert list(batch["uid"]) == ["t0", "t0", "t1", "t1"] and list(batch["data_id"]) == list(batch["uid"])
    assert list(batch["rollout_id"]) == ["r0", "r1", "r2", "r3"]


def test_skipped_and_empty_rollouts_give_an_empty_batch_with_every_column():
    batch, metrics = transition_batch([rollout([llm(0, [1], [2])], status="failed"), rollout([])], 4, 3)
    assert len(batch) == 0
    assert batch["input_ids"].shape == (0, 7) and batch["rollout_log_probs"].shape == (0, 3)
    assert {"uid", "rollout_id", "turn_index", "is_drop_mask"} <= set(batch.keys())
    assert metrics["training/n_rollouts_skipped"] == 1


def test_triplets_with_an_empty_response_leave_no_row():
    r = Rollout(rollout_id="r0", task_id="t0", status="succeeded", final_reward=1.0,
                triplets=[Triplet(prompt_ids=[1], response_ids=[], rollout_id="r0", turn_index=0),
                          Triplet(prompt_ids=[1], response_ids=[5], rollout_id="r0", turn_index=1)])
    batch, metrics = transition_batch([r], 2, 2)
    assert [row.response for row in rows(batch)] == [[5]]
    assert metrics["training/n_triplets_no_trainable_token"] == 1


def test_same_tensors_as_the_instant_backends_minimal_aggregator():
    from agl_plugin_instant import transition_rows

    rollouts = [Rollout(rollout_id=f"r{i}", task_id=f"t{i % 2}", status="failed" if i == 3 else "succeeded",
                        final_reward=i / 4,
                        triplets=[Triplet(prompt_ids=list(range(turn + i)) + [7], response_ids=[1, 2, 3][: turn + 1],
                                          response_logprobs=[-0.5] * (turn + 1), rollout_id=f"r{i}",
                                          turn_index=turn) for turn in range(3)])
                for i in range(5)]
    ours, _ = transition_batch(rollouts, 4, 2)
    theirs = transition_rows(rollouts, 4, 2)
    for name, tensor in theirs.tensors.items():
        assert torch.equal(ours[name], tensor), name
    for name, column in theirs.non_tensors.items():
        assert list(ours[name]) == list(column), name
