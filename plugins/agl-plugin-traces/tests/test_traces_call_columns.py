"""The per-call columns of both aggregators (turn_ids, call_turns, call_rewards, call_reward_sources, call_state_keys,
call_state_ids)."""

import numpy as np
import pytest

from agl_core.data import Rollout, Span, state_key_ids
from agl_plugin_traces.calls import TraceCounts, rollout_calls, to_triplets
from agl_plugin_traces.trajectory import trajectory_batch
from agl_plugin_traces.transition import transition_batch


def span(seq, kind, **fields):
    return Span(rollout_id="r", sequence_id=seq, kind=kind, **fields)


def rollout(spans, final_reward=1.0):
    return Rollout(rollout_id="r", task_id="t", status="succeeded", final_reward=final_reward, spans=spans)


# Three calls extending one context. Call 1's prompt is exactly call 0's prompt + response: no token between them.
# Call 0 is rewarded 0.5 and made in state "1-7"; call 2 in state "5-7"; call 1 has neither.
SPANS = [span(0, "annotation", attributes={"state_key": "1-7"}),
         span(1, "llm_call", prompt_token_ids=[1, 2], response_token_ids=[3]),
         span(2, "reward", reward=0.5),
         span(3, "llm_call", prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5]),
         span(4, "annotation", attributes={"state_key": "5-7"}),
         span(5, "llm_call", prompt_token_ids=[1, 2, 3, 4, 5, 9], response_token_ids=[6])]


@pytest.mark.parametrize("per_call_rewards", [False, True])
def test_a_merged_row_keeps_its_calls_apart(per_call_rewards):
    batch, _, _ = trajectory_batch([rollout(SPANS)], 2, 8, per_call_rewards=per_call_rewards)
    assert len(batch) == 1
    # Calls 0 and 1 touch (no token between them), yet their tokens carry different turn ids.
    assert batch["turn_ids"].tolist() == [[0, 1, 1, -1, 2, -1, -1, -1]]
    assert batch["response_mask"].tolist() == [[1, 1, 1, 0, 1, 0, 0, 0]]
    assert batch["call_turns"].tolist() == [[0, 1, 2]]
    # The call's own reward where it has one, else the rollout's, whatever per_call_rewards says (it only
    # decides what token_level_scores holds).
    assert batch["call_rewards"].tolist() == [[0.5, 1.0, 1.0]]
    assert batch["call_reward_sources"].tolist() == [["call", "rollout", "rollout"]]
    assert batch["call_state_keys"].tolist() == [["1-7", None, "5-7"]]
    assert batch["call_state_ids"].tolist() == [state_key_ids(["1-7", None, "5-7"]).tolist()]


def test_transition_rows_carry_one_call_each():
    batch, _ = transition_batch([rollout(SPANS)], 8, 4)
    assert batch["turn_ids"].tolist() == [[0, -1, -1, -1], [1, 1, -1, -1], [2, -1, -1, -1]]
    assert batch["call_turns"].tolist() == [[0], [1], [2]]
    assert batch["call_rewards"].tolist() == [[0.5], [1.0], [1.0]]
    assert batch["call_reward_sources"].tolist() == [["call"], ["rollout"], ["rollout"]]
    assert batch["call_state_keys"].tolist() == [["1-7"], [None], ["5-7"]]
    assert batch["call_state_ids"].ravel().tolist() == state_key_ids(["1-7", None, "5-7"]).tolist()
    assert batch["turn_ids"].dtype.is_floating_point is False and batch["call_turns"].dtype == np.int64


def test_a_broken_prefix_makes_rows_of_different_call_counts_padded():
    spans = SPANS + [span(6, "llm_call", prompt_token_ids=[7, 7], response_token_ids=[8, 8]),
                     span(7, "reward", reward=-1.0)]
    batch, _, _ = trajectory_batch([rollout(spans)], 2, 8)
    assert batch["call_turns"].tolist() == [[0, 1, 2], [3, -1, -1]]
    assert batch["turn_ids"][1].tolist() == [3, 3, -1, -1, -1, -1, -1, -1]
    rewards = batch["call_rewards"]
    assert rewards[1, 0] == -1.0 and np.isnan(rewards[1, 1:]).all()
    assert batch["call_reward_sources"][1].tolist() == ["call", "", ""]
    assert batch["call_state_keys"][1].tolist() == [None, None, None]
    assert batch["call_state_ids"][1].tolist() == [-1, -1, -1] and batch["call_state_ids"].dtype == np.int64


def test_a_call_cut_at_the_response_limit_stays_in_the_call_columns():
    batch, _, _ = trajectory_batch([rollout(SPANS)], 2, 3)  # only calls 0 and 1 fit
    assert batch["turn_ids"].tolist() == [[0, 1, 1]]
    assert batch["call_turns"].tolist() == [[0, 1, 2]]  # call 2's reward and state still count for returns


def test_state_keys_name_the_next_call_and_survive_retries_and_failures():
    spans = [span(0, "annotation", attributes={"state_key": "a"}),
             span(1, "annotation", attributes={"state_key": "b"}),  # the last key before a call wins
             span(2, "llm_call", prompt_token_ids=[1], response_token_ids=[2]),
             span(3, "annotation", attributes={"state_key": "c"}),
             span(4, "llm_call", prompt_token_ids=[1, 2, 3], response_token_ids=[4], attributes={"error": "boom"}),
             span(5, "llm_call", prompt_token_ids=[1, 2, 3], response_token_ids=[5]),  # after a failure: "c"
             span(6, "llm_call", prompt_token_ids=[1, 2, 3], response_token_ids=[6]),  # a retry of the one before
             span(7, "llm_call", prompt_token_ids=[1, 2, 3, 6, 9], response_token_ids=[7]),  # given none
             span(8, "annotation", attributes={"state_key": {"low": 5, "high": 7}})]  # JSON, and after the last
    calls = rollout_calls(rollout(spans), TraceCounts())
    assert [(c.turn, c.state_key) for c in calls] == [(0, "b"), (3, "c"), (4, None)]
    triplet_rollout = Rollout(rollout_id="r", task_id="t", status="succeeded", final_reward=1.0,
                              triplets=to_triplets(rollout(spans)))
    assert [c.state_key for c in rollout_calls(triplet_rollout, TraceCounts())] == ["b", "c", None]
    structured = rollout_calls(rollout([span(0, "annotation", attributes={"state_key": {"b": 1, "a": [2]}}),
                                        span(1, "llm_call", prompt_token_ids=[1], response_token_ids=[2])]),
                               TraceCounts())
    assert structured[0].state_key == '{"a":[2],"b":1}'  # canonical JSON text


def test_a_judges_reward_span_marks_its_calls_reward_as_the_judges():
    """A reward span with ``attributes["reward_source"] == "judge"`` (agl-plugin-teachers' per-turn judge): the call's
    own reward, with source "judge" in the columns and in the triplets; beside an agent's span, the sum, still
    marked the judge's."""
    spans = SPANS[:3] + [span(3, "llm_call", prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5]),
                         span(3, "reward", reward=0.25, attributes={"reward_source": "judge"}),
                         span(5, "llm_call", prompt_token_ids=[1, 2, 3, 4, 5, 9], response_token_ids=[6]),
                         span(6, "reward", reward=0.5, attributes={"reward_source": "judge"}),
                         span(7, "reward", reward=0.25)]
    for batch in (trajectory_batch([rollout(spans)], 2, 8)[0], transition_batch([rollout(spans)], 8, 4)[0]):
        sources = batch["call_reward_sources"][batch["call_turns"] >= 0].tolist()
        rewards = batch["call_rewards"][batch["call_turns"] >= 0].tolist()
        assert sources == ["call", "judge", "judge"] and rewards == [0.5, 0.25, 0.75]
    assert [t.metadata["reward_source"] for t in to_triplets(rollout(spans))] == ["call", "judge", "judge"]
