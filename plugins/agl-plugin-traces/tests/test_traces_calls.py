"""Spans → calls: order, skipped calls, retries, reward attachment, triplets as given."""

import pytest

from agl_core.data import Triplet
from agl_plugin_traces.calls import TraceCounts, rollout_calls, to_triplets, trainable_rollouts
from traces_testkit import llm, reward, rollout


def calls_of(spans, **kwargs):
    counts = TraceCounts()
    return rollout_calls(rollout(spans, **kwargs), counts), counts


def test_calls_follow_sequence_ids_not_list_order():
    calls, _ = calls_of([llm(5, [3], [30]), llm(1, [1], [10]), llm(3, [2], [20])])
    assert [c.response_ids for c in calls] == [[10], [20], [30]]


def test_empty_and_error_calls_are_skipped_and_counted():
    calls, counts = calls_of([llm(0, [1], [10]), llm(1, [2], []), llm(2, [], [5]),
                              llm(3, [3], [30], error="upstream 500"), llm(4, [4], [40], error="")])
    assert [c.response_ids for c in calls] == [[10], [40]]
    assert (counts.empty, counts.error, counts.kept) == (2, 1, 2)


def test_an_incomplete_call_a_stream_the_agent_left_is_counted_and_never_trained_on():
    calls, counts = calls_of([llm(0, [1], [10]), llm(1, [1, 10, 2], [20, 21], incomplete=True), reward(2, 1.0)])
    assert [c.response_ids for c in calls] == [[10]]
    assert (counts.incomplete, counts.error, counts.kept, counts.rewards_unattached) == (1, 0, 1, 1)
    assert counts.metrics()["training/n_calls_incomplete"] == 1.0


def test_a_retry_replaces_every_earlier_call_with_the_same_prompt():
    calls, counts = calls_of([llm(0, [1, 2], [10]), llm(1, [1, 2], [11]), llm(2, [7], [70]), llm(3, [1, 2], [12])])
    assert [c.response_ids for c in calls] == [[70], [12]]
    assert counts.retried == 2


def test_prompts_that_share_the_cheap_key_but_differ_are_not_retries():
    # Same length, first, middle and last token: only the full comparison tells them apart.
    calls, counts = calls_of([llm(0, [1, 5, 7, 2], [10]), llm(1, [1, 3, 7, 2], [11]), llm(2, [1, 5, 7, 2], [12])])
    assert [c.response_ids for c in calls] == [[11], [12]]
    assert counts.retried == 1


def test_further_choices_of_one_request_are_samples_not_retries():
    calls, counts = calls_of([llm(0, [1], [10], choice_index=0), llm(1, [1], [11], choice_index=1),
                              llm(2, [1], [12], choice_index=0), llm(3, [1], [13], choice_index=1)])
    assert [c.response_ids for c in calls] == [[12], [13]]  # the second request retried the first one
    assert counts.retried == 2


def test_a_reward_goes_to_the_closest_preceding_call_and_rewards_add_up():
    calls, counts = calls_of([llm(0, [1], [10]), reward(1, 0.5), llm(2, [2], [20]), reward(3, 0.25),
                              reward(4, 0.5), llm(5, [3], [30])])
    assert [c.reward for c in calls] == [0.5, 0.75, None]
    assert counts.rewards == 3


def test_rewards_of_skipped_calls_or_before_any_call_are_unattached():
    calls, counts = calls_of([reward(0, 1.0), llm(1, [1], [10], error="boom"), reward(2, 0.5),
                              llm(3, [2], [20]), reward(4, 0.25), llm(5, [2], [21])])
    # The reward at 4 rewarded the call at 3, which the retry at 5 replaced.
    assert [(c.response_ids, c.reward) for c in calls] == [([21], None)]
    assert (counts.rewards, counts.rewards_unattached) == (0, 3)


def test_triplets_without_spans_are_used_as_given():
    triplets = [Triplet(prompt_ids=[2], response_ids=[20], reward=0.5, rollout_id="r0", turn_index=0,
                        metadata={"agent_name": "b"}),
                Triplet(prompt_ids=[1], response_ids=[], rollout_id="r0", turn_index=1)]
    r = rollout([])
    r.triplets = triplets
    calls = rollout_calls(r, TraceCounts())
    assert [(c.prompt_ids, c.response_ids, c.reward, c.agent_name) for c in calls] == [
        ([2], [20], 0.5, "b"), ([1], [], None, None)]


def test_to_triplets_keeps_per_call_rewards_and_falls_back_to_the_rollout_reward():
    r = rollout([llm(0, [1], [10], agent_name="solver"), reward(1, 0.25), llm(2, [2], [20])], final_reward=1.0)
    triplets = to_triplets(r)
    assert [(t.turn_index, t.reward, t.metadata["reward_source"]) for t in triplets] == [
        (0, 0.25, "call"), (1, 1.0, "rollout")]
    assert triplets[0].metadata["agent_name"] == "solver"
    assert triplets[0].response_logprobs == r.spans[0].response_logprobs


def test_to_triplets_number_turns_by_their_position_in_the_trace():
    r = rollout([llm(0, [1], [10]), llm(1, [2], []), llm(2, [1], [11]), llm(3, [3], [30])])
    # The empty call at 1 is skipped and the retry at 2 replaces the call at 0.
    assert [(t.turn_index, t.response_ids) for t in to_triplets(r)] == [(2, [11]), (3, [30])]


@pytest.mark.parametrize(("missing", "expected"), [(0.0, [("ok", 1.0), ("none", 0.0)]), (None, [("ok", 1.0)])])
def test_failed_rollouts_are_skipped_and_missing_rewards_filled_or_skipped(missing, expected):
    rollouts = [rollout([llm(0, [1], [2])], rollout_id="ok"),
                rollout([llm(0, [1], [2])], rollout_id="none", final_reward=None),
                rollout([llm(0, [1], [2])], rollout_id="bad", status="failed"),
                rollout([llm(0, [1], [2])], rollout_id="late", status="timed_out")]
    counts = TraceCounts()
    got = [(r.rollout_id, value) for r, value, _ in trainable_rollouts(rollouts, missing, counts)]
    assert got == expected
    assert (counts.rollouts_skipped, counts.rollouts_without_reward) == (2, 1)
