"""Properties of both aggregators on generated agent traces (hypothesis).

No example database is written (database=None): the tests leave no files behind.

Model tokens are numbered from 10,000 up, each used once; prompt and
observation tokens are below 10,000. So a token with mask 1 can be traced
back to the one call that produced it.
"""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agl_plugin_traces.calls import TraceCounts, rollout_calls
from agl_plugin_traces.trajectory import trajectory_batch
from agl_plugin_traces.transition import transition_batch
from traces_testkit import llm, logprobs_of, rollout, rows

MODEL = 10_000
context_tokens = st.lists(st.integers(0, MODEL - 1), min_size=0, max_size=4)


@st.composite
def agent_rollout(draw, rollout_id="r0"):
    """A rollout of 1-12 calls that extend the context (with 0-4 new tokens), break it, retry, fail or say nothing."""
    next_model = iter(range(MODEL, MODEL + 1000))
    spans, prompt, previous = [], draw(context_tokens.filter(bool)), None
    for seq in range(draw(st.integers(1, 12))):
        kind = draw(st.sampled_from(["extend", "extend", "extend", "break", "retry", "error"]))
        if previous is not None and kind == "extend":
            prompt = previous.prompt_token_ids + previous.response_token_ids + draw(context_tokens)
        elif kind == "break":
            prompt = draw(context_tokens.filter(bool))
        response = [next(next_model) for _ in range(draw(st.integers(0, 4)))]
        spans.append(llm(seq, prompt, response, rollout_id=rollout_id, **({"error": "x"} if kind == "error" else {})))
        previous = spans[-1]
    return rollout(spans, rollout_id=rollout_id)


limits = st.one_of(st.tuples(st.integers(1, 6), st.integers(1, 8)), st.just((1000, 1000)))


def aggregate(name, r, max_prompt, max_response):
    if name == "transition":
        return transition_batch([r], max_prompt, max_response)[0]
    return trajectory_batch([r], max_prompt, max_response)[0]


@pytest.mark.parametrize("aggregator", ["transition", "trajectory"])
@settings(max_examples=150, deadline=None, database=None)
@given(r=agent_rollout(), lengths=limits)
def test_every_trained_token_was_produced_by_the_model_and_is_trained_once(aggregator, r, lengths):
    max_prompt, max_response = lengths
    batch = aggregate(aggregator, r, max_prompt, max_response)
    got = rows(batch)
    # The length columns count the real tokens on either side, as the attention mask marks them.
    assert batch["prompt_length"].tolist() == batch["attention_mask"][:, :max_prompt].sum(-1).tolist()
    assert batch["response_length"].tolist() == batch["attention_mask"][:, max_prompt:].sum(-1).tolist()
    produced = [t for call in rollout_calls(r, TraceCounts()) for t in call.response_ids]
    trained = Counter(t for row in got for t in row.trained)
    assert all(t >= MODEL for t in trained), "a token the model did not produce has mask 1"
    assert set(trained) <= set(produced)
    assert max(trained.values(), default=1) == 1, "a model token is trained twice"
    if max_prompt >= 1000:  # nothing cut: every produced token is trained exactly once
        assert sorted(trained) == sorted(produced)
    for row in got:
        trained_logprobs = [lp for lp, m in zip(row.logprobs, row.mask) if m]
        assert trained_logprobs == pytest.approx(logprobs_of(row.trained))
        assert any(row.mask), "a row without a trainable token"


@pytest.mark.parametrize("aggregator", ["transition", "trajectory"])
@settings(max_examples=100, deadline=None, database=None)
@given(r=agent_rollout())
def test_without_limits_every_row_is_exactly_a_call_as_the_engine_saw_it(aggregator, r):
    calls = rollout_calls(r, TraceCounts())
    contexts = [call.prompt_ids + call.response_ids for call in calls]
    by_turn = {call.turn: call for call in calls}
    for row in rows(aggregate(aggregator, r, 1000, 1000)):
        assert row.prompt + row.response in contexts
        assert by_turn[row.turn_index].prompt_ids == row.prompt  # the row starts where its first call starts
        assert not row.drop


@settings(max_examples=100, deadline=None, database=None)
@given(r=agent_rollout(), lengths=limits)
def test_trajectory_rows_are_windows_of_the_engines_tokens(r, lengths):
    """Whatever is cut, each row's tokens are a contiguous window of one call's prompt + response."""
    contexts = [call.prompt_ids + call.response_ids for call in rollout_calls(r, TraceCounts())]
    for row in rows(aggregate("trajectory", r, *lengths)):
        window = row.prompt + row.response
        assert any(window == context[i:i + len(window)] for context in contexts for i in range(len(context)))
