"""The trajectory aggregator: prefix merges, breaks and their classes, limits, Agent Lightning v0.3.0's two defects."""

import json

import pytest
import torch

from agl_core.rollout.context_record import EDITED, NEW_CONVERSATION
from agl_plugin_traces.mismatch import classify_break
from agl_plugin_traces.trajectory import trajectory_batch
from traces_testkit import conversation, llm, logprobs_of, reward, rollout, rows, score_at


def merged(first_prompt, turns):
    """The row one merged conversation must give: (prompt, response, mask)."""
    response, mask = [], []
    for i, (observation, said) in enumerate(turns):
        if i:
            response += observation
            mask += [0] * len(observation)
        response += said
        mask += [1] * len(said)
    return list(first_prompt), response, mask


@pytest.mark.parametrize("n_turns", [1, 2, 3, 8, 20])
def test_calls_that_extend_the_context_merge_into_one_row(n_turns):
    turns = [([100 + 2 * i] * (i % 3), [200 + i, 300 + i]) for i in range(n_turns)]  # observations of 0..2 tokens
    spans = conversation([1, 2, 3], turns)
    batch, metrics, _ = trajectory_batch([rollout(spans, final_reward=0.5)], 4, 128)
    (row,) = rows(batch)
    prompt, response, mask = merged([1, 2, 3], turns)
    assert (row.prompt, row.response, row.mask) == (prompt, response, mask)
    assert row.logprobs == pytest.approx([lp if m else 0.0 for lp, m in zip(logprobs_of(response), mask)])
    assert score_at(row) == {len(response) - 1: 0.5}
    # Token exact: the row is the last call's prompt + response.
    assert row.prompt + row.response == spans[-1].prompt_token_ids + spans[-1].response_token_ids
    assert metrics["training/n_unmerged_rollouts"] == 0 and metrics["training/n_triplets"] == 1


def test_a_zero_length_observation_appends_nothing():
    # The second prompt is exactly the first prompt + response: Agent Lightning v0.3.0 appended prompt[-0:],
    # the whole prompt.
    spans = [llm(0, [1, 2], [10]), llm(1, [1, 2, 10], [11]), llm(2, [1, 2, 10, 11, 5], [12])]
    batch, _, _ = trajectory_batch([rollout(spans)], 4, 16)
    (row,) = rows(batch)
    assert (row.response, row.mask) == ([10, 11, 5, 12], [1, 1, 0, 1])


def test_a_call_that_breaks_the_prefix_starts_a_new_row():
    spans = [llm(0, [1, 2], [10]), llm(1, [1, 2, 10, 5], [11]), llm(2, [9, 9], [12]), llm(3, [9, 9, 12, 6], [13])]
    batch, metrics, breaks = trajectory_batch([rollout(spans)], 4, 16)
    got = rows(batch)
    assert [(r.prompt, r.response, r.mask, r.turn_index) for r in got] == [
        ([1, 2], [10, 5, 11], [1, 0, 1], 0), ([9, 9], [12, 6, 13], [1, 0, 1], 2)]
    assert [score_at(r) for r in got] == [{2: 1.0}, {2: 1.0}]
    assert metrics["training/n_unmerged_rollouts"] == 1
    assert metrics["training/mismatch/unclassified"] == 1  # no tokenizer configured
    assert breaks.records is None


def test_turn_index_is_the_calls_position_in_the_trace_whatever_was_skipped_before_it():
    spans = [llm(0, [1, 2], [10]), llm(1, [1, 2, 10, 5], []),  # an empty response in the middle
             llm(2, [9, 9], [12]), reward(3, 0.5), llm(4, [9, 9, 12, 6], [13], error="timeout"), llm(5, [8], [14])]
    batch, _, breaks = trajectory_batch([rollout(spans)], 4, 16, keep_break_records=True)
    # Positions among the llm_call spans: the reward span is not a call.
    assert [(r.prompt, r.turn_index) for r in rows(batch)] == [([1, 2], 0), ([9, 9], 2), ([8], 4)]
    assert [record["turn_index"] for record in breaks.records] == [2, 4]


def test_a_long_prompt_after_skipped_calls_still_opens_the_rollouts_first_row():
    spans = [llm(0, [1], []), llm(1, [1, 2, 3, 4, 5, 6], [10])]
    (row,) = rows(trajectory_batch([rollout(spans)], 4, 16)[0])
    assert (row.prompt, row.drop, row.turn_index) == ([3, 4, 5, 6], True, 1)


def test_a_prompt_shorter_than_the_context_breaks_even_when_prompt_plus_response_would_match():
    # Agent Lightning v0.3.0 tested (prompt + response) against the context, so a call that re-sent a cut context and
    # regenerated the cut part merged, with a negative observation length.
    spans = [llm(0, [1, 2], [10, 11]), llm(1, [1, 2, 10], [11, 12])]
    batch, metrics, _ = trajectory_batch([rollout(spans)], 4, 16)
    assert [(r.prompt, r.response) for r in rows(batch)] == [([1, 2], [10, 11]), ([1, 2, 10], [11, 12])]
    assert metrics["training/n_unmerged_rollouts"] == 1


class FakeTokenizer:
    """Token t decodes to chr(t); ids >= 1000 are special tokens; 50 and 51 decode to 'ab' together."""

    all_special_ids = [1000, 1001]
    text = {50: "a", 51: "b", 52: "ab"}

    def decode(self, token_ids, skip_special_tokens=False):
        return "".join(self.text.get(t, chr(t)) for t in token_ids if not (skip_special_tokens and t >= 1000))


@pytest.mark.parametrize(("context", "prompt", "kind"), [
    ([1000, 70, 71, 1001], [1000, 70, 71, 1000, 72], "template"),  # only a special token differs
    ([1000, 70, 50, 51], [1000, 70, 52, 73], "retokenization"),  # 'a' 'b' came back as 'ab'
    ([1000, 70, 71], [1000, 70, 99, 71], "other"),  # the text changed
    ([1000, 70, 71], [1000, 70], "other"),  # the history was cut
])
def test_breaks_are_classified(context, prompt, kind):
    assert classify_break(context, prompt, FakeTokenizer()) == kind
    assert classify_break(context, prompt, None) == "unclassified"


def test_every_mismatch_class_is_counted_and_logged(tmp_path):
    spans = [llm(0, [1000, 70], [71, 1001]),
             llm(1, [1000, 70, 71, 1000, 5], [50, 51]),  # template: 1001 re-rendered as 1000
             llm(2, [1000, 70, 71, 1000, 5, 52, 6], [80]),  # retokenization of 50 51
             llm(3, [1000, 99], [81])]  # other
    batch, metrics, breaks = trajectory_batch([rollout(spans)], 8, 16, tokenizer=FakeTokenizer(),
                                              keep_break_records=True)
    assert len(batch) == 4
    assert {k: metrics[f"training/mismatch/{k}"] for k in ("template", "retokenization", "other", "unclassified")} \
        == {"template": 1, "retokenization": 1, "other": 1, "unclassified": 0}
    assert metrics["training/n_unmerged_rollouts"] == 1
    first = breaks.records[0]
    assert (first["turn_index"], first["class"], first["first_difference"]) == (1, "template", 3)
    assert first["context_ids"] == [1000, 70, 71, 1001] and first["prompt_ids"] == spans[1].prompt_token_ids
    json.dumps(breaks.records)  # written as JSON lines by the plugin


def test_an_overlong_first_prompt_marks_the_row_for_dropping():
    spans = conversation([1, 2, 3, 4, 5], [([], [10]), ([6], [11])])
    batch, metrics, _ = trajectory_batch([rollout(spans)], 3, 16)
    (row,) = rows(batch)
    assert (row.prompt, row.drop) == ([3, 4, 5], True)
    assert (row.response, row.mask) == ([10, 6, 11], [1, 0, 1])
    assert metrics["training/n_triplets_prompt_too_long"] == 1


def test_the_overflow_of_a_later_rows_prompt_is_context_never_trained_on():
    # Agent Lightning v0.3.0 put the overflow of a later segment's prompt into the response with mask 1.
    spans = [llm(0, [1, 2], [10]), llm(1, [7, 7, 7, 7, 7, 8], [11]), llm(2, [7, 7, 7, 7, 7, 8, 11, 6], [12])]
    batch, metrics, _ = trajectory_batch([rollout(spans)], 4, 16)
    first, later = rows(batch)
    assert (later.prompt, later.drop) == ([7, 7, 7, 7], False)
    assert (later.response, later.mask) == ([7, 8, 11, 6, 12], [0, 0, 1, 0, 1])
    assert later.trained == [11, 12]
    assert later.prompt + later.response == spans[2].prompt_token_ids + spans[2].response_token_ids
    assert metrics["training/n_triplets_prompt_overflow_masked"] == 1

    dropped, metrics, _ = trajectory_batch([rollout(spans)], 4, 16, later_prompt_overflow="drop")
    later = rows(dropped)[1]
    assert (later.prompt, later.drop, later.trained) == ([7, 7, 7, 8], True, [11, 12])
    assert metrics["training/n_triplets_prompt_too_long"] == 1


def test_a_row_whose_overflow_fills_the_response_has_nothing_to_train_and_is_dropped():
    spans = [llm(0, [1], [10]), llm(1, [5] * 9, [11])]
    batch, metrics, _ = trajectory_batch([rollout(spans)], 4, 5)
    assert [r.response for r in rows(batch)] == [[10]]
    assert metrics["training/n_triplets_no_trainable_token"] == 1
    assert metrics["training/n_triplets"] == 1


@pytest.mark.parametrize(("limit", "response", "mask", "score_position"), [
    (6, [10, 11, 5, 6, 12, 13], [1, 1, 0, 0, 1, 1], 5),  # cut inside the last response
    (4, [10, 11, 5, 6], [1, 1, 0, 0], 1),  # cut inside an observation: the score stays on a trainable token
    (3, [10, 11, 5], [1, 1, 0], 1),
])
def test_a_merged_response_over_the_limit_is_cut(limit, response, mask, score_position):
    spans = conversation([1], [([], [10, 11]), ([5, 6], [12, 13, 14])])
    batch, metrics, _ = trajectory_batch([rollout(spans, final_reward=3.0)], 2, limit)
    (row,) = rows(batch)
    assert (row.response, row.mask) == (response, mask)
    assert score_at(row) == {score_position: 3.0}
    assert metrics["training/n_triplets_response_truncated"] == 1


def test_per_call_rewards_sit_on_their_calls_last_tokens():
    spans = [llm(0, [1], [10, 11]), reward(1, 0.25), llm(2, [1, 10, 11, 5], [12]),
             llm(3, [1, 10, 11, 5, 12, 6], [13, 14]), reward(4, 1.0)]
    r = rollout(spans, final_reward=1.0)
    (row,) = rows(trajectory_batch([r], 2, 16, per_call_rewards=True)[0])
    assert score_at(row) == {1: 0.25, 6: 1.0}
    (row,) = rows(trajectory_batch([r], 2, 16)[0])
    assert score_at(row) == {6: 1.0}


def test_a_row_without_per_call_rewards_gets_the_rollout_reward():
    spans = [llm(0, [1], [10]), reward(1, 0.5), llm(2, [9], [20])]
    got = rows(trajectory_batch([rollout(spans, final_reward=2.0)], 2, 4, per_call_rewards=True)[0])
    assert [score_at(r) for r in got] == [{0: 0.5}, {0: 2.0}]


def test_retries_errors_and_empty_calls_do_not_break_the_merge():
    spans = [llm(0, [1], [10]), llm(1, [1, 10, 5], [99]), llm(2, [1, 10, 5], [11]),  # a retry
             llm(3, [1, 10, 5, 11, 6], []), llm(4, [1, 10, 5, 11, 6], [50], error="timeout"),  # empty, error
             llm(5, [1, 10, 5, 11, 6], [12])]
    (row,) = rows(trajectory_batch([rollout(spans)], 2, 16)[0])
    assert (row.response, row.mask) == ([10, 5, 11, 6, 12], [1, 0, 1, 0, 1])


def test_several_rollouts_per_task_keep_their_group_and_ids():
    rollouts = [rollout(conversation([1], [([], [10 + i]), ([5], [20 + i])], rollout_id=f"r{i}"),
                        rollout_id=f"r{i}", task_id=f"t{i // 3}", final_reward=float(i)) for i in range(6)]
    batch, metrics, _ = trajectory_batch(rollouts, 2, 8)
    got = rows(batch)
    assert [(r.uid, r.rollout_id) for r in got] == [(f"t{i // 3}", f"r{i}") for i in range(6)]
    assert [r.trained for r in got] == [[10 + i, 20 + i] for i in range(6)]
    assert [sum(r.scores) for r in got] == [float(i) for i in range(6)]
    assert metrics["training/n_rollouts"] == 6


def agent_rollouts(n: int, break_every: int) -> list:
    """``n`` rollouts of 4 calls; in every ``break_every``-th rollout the third call re-renders its history."""
    out = []
    for r in range(n):
        spans, prompt = [], [10 + r, 2, 3]
        for turn in range(4):
            if turn == 2 and r % break_every == 0:
                prompt = [9] + prompt[1:]
            response = [100 + r, 200 + turn]
            spans.append(llm(turn, prompt, response, rollout_id=f"r{r}"))
            prompt = prompt + response + [7, turn]
        out.append(rollout(spans, rollout_id=f"r{r}", task_id=f"t{r // 2}", final_reward=float(r % 3)))
    return out


@pytest.mark.parametrize(("break_every", "n_rows"), [(1000, 41), (10, 44), (1, 80)])  # fit, fit the headroom, not
@pytest.mark.parametrize("pad", [0, 5])
def test_reserved_output_tensors_give_the_same_batch_as_fresh_ones(break_every, n_rows, pad):
    """A list of rollouts (its length known: room for 40 + 5 rows is paged in ahead) and an iterator (fresh)."""
    rollouts = agent_rollouts(40, break_every)
    reserved, _, _ = trajectory_batch(rollouts, 12, 24, pad_token_id=pad)
    fresh, _, _ = trajectory_batch(iter(rollouts), 12, 24, pad_token_id=pad)
    assert len(reserved) == len(fresh) == n_rows
    assert list(reserved.tensors.keys()) == list(fresh.tensors.keys())
    for name in fresh.tensors.keys():
        assert torch.equal(reserved[name], fresh[name]), name


def test_a_batch_of_few_rows_does_not_keep_the_reservation_for_many():
    """Most rollouts failed: the rows get fresh tensors, not views of storage reserved for every rollout."""
    rollouts = agent_rollouts(40, 1000)
    for r in rollouts[4:]:
        r.status = "failed"
    batch, _, _ = trajectory_batch(rollouts, 12, 24)
    assert len(batch) == 5  # the first rollout breaks once
    assert batch["input_ids"].untyped_storage().nbytes() == batch["input_ids"].numel() * 8


@pytest.mark.parametrize("attributes, kind", [
    ({"context": "rebuilt", "context_reason": EDITED}, "agent_edit"),
    ({"context": "rebuilt", "context_reason": NEW_CONVERSATION}, "agent_edit"),
    ({"context": "exact"}, "agent_edit"),  # an exact continuation of an older call: the agent went back
    ({"context": "rebuilt", "context_reason": "the policy server names no local model directory"}, "re_rendered"),
    ({}, "unclassified"),  # no word from the gateway and no tokenizer: as before
])
def test_the_gateways_record_tells_an_agents_edit_from_a_re_rendering(attributes, kind):
    second = llm(1, [9, 9], [12], **attributes)
    _, metrics, breaks = trajectory_batch([rollout([llm(0, [1, 2], [10]), second])], 4, 16, keep_break_records=True)
    assert metrics[f"training/mismatch/{kind}"] == 1 and metrics["training/n_unmerged_rollouts"] == 1
    assert breaks.records[0]["class"] == kind
    assert breaks.records[0]["context_reason"] == attributes.get("context_reason")
