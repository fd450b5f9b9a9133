"""Packed spans: what the aggregators rely on in agl_core's TokenIds / LogProbs, and the paths around them.

The aggregators compare and copy the spans' packed buffers; these tests pin
the behaviour of the packed types the traces code depends on (list
equality, JSON as lists, pickling), spans that hold plain lists (built with
``model_construct``) and the one- and two-thread layouts giving the same batch.
"""

import copy
import json
import pickle
import random

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from agl_core.data import LogProbs, Rollout, Span, TokenIds
from agl_plugin_traces.calls import TraceCounts, rollout_calls
from agl_plugin_traces.trajectory import trajectory_batch
from agl_plugin_traces.transition import transition_batch
from traces_testkit import conversation, rollout


def test_span_token_ids_are_packed_and_behave_like_the_lists_they_came_from():
    span = Span(rollout_id="r", sequence_id=0, kind="llm_call", prompt_token_ids=[5, 6, 7],
                response_token_ids=(8, 9), response_logprobs=[-1, -0.5])
    assert type(span.prompt_token_ids) is TokenIds and type(span.response_logprobs) is LogProbs
    assert span.prompt_token_ids == [5, 6, 7] and [5, 6, 7] == span.prompt_token_ids and span.prompt_token_ids != [5]
    assert span.response_logprobs == [-1.0, -0.5]
    assert len(span.prompt_token_ids) == 3 and span.prompt_token_ids[-1] == 7
    assert list(span.prompt_token_ids) == [5, 6, 7]
    assert span.prompt_token_ids[1:] == [6, 7] and span.prompt_token_ids[::2] == [5, 7]
    assert span.prompt_token_ids + [1] == [5, 6, 7, 1] and [1] + span.prompt_token_ids == [1, 5, 6, 7]
    assert span.prompt_token_ids + span.response_token_ids == TokenIds([5, 6, 7, 8, 9])
    assert span.prompt_token_ids.packed == np.array([5, 6, 7], dtype=np.int64).tobytes()
    assert np.array_equal(np.asarray(span.prompt_token_ids), [5, 6, 7])
    assert not Span(rollout_id="r", sequence_id=1, kind="reward").prompt_token_ids


def test_packed_spans_round_trip_through_json_pickle_and_copies():
    span = Span(rollout_id="r", sequence_id=0, kind="llm_call", prompt_token_ids=[1, 2**40],
                response_token_ids=[3], response_logprobs=[-0.1])
    dumped = json.loads(span.model_dump_json())
    assert dumped["prompt_token_ids"] == [1, 2**40] and dumped["response_logprobs"] == [-0.1]
    assert span.model_dump()["prompt_token_ids"] == [1, 2**40]
    assert Span.model_validate_json(span.model_dump_json()) == span
    assert Span.model_validate(span.model_dump()) == span
    assert pickle.loads(pickle.dumps(span)) == span
    assert copy.deepcopy(span) == span and span.model_copy(deep=True) == span
    schema = Span.model_json_schema()["properties"]["prompt_token_ids"]
    assert schema["type"] == "array" and schema["items"] == {"type": "integer"}


def test_packed_fields_validate_like_lists():
    def span(**tokens):
        return Span(rollout_id="r", sequence_id=0, kind="llm_call", **tokens)

    assert span(prompt_token_ids=np.array([1, 2], dtype=np.int32)).prompt_token_ids == [1, 2]
    for bad in (["a"], [1.5], [2**70], np.array([1.5])):
        with pytest.raises(ValidationError):
            span(prompt_token_ids=bad)
    with pytest.raises(ValidationError, match="2 entries for 1 response tokens"):
        span(response_token_ids=[1], response_logprobs=[0.0, 0.0])


def test_spans_holding_plain_lists_are_aggregated_the_same():
    spans = conversation([1, 2, 3], [([], [10, 11]), ([20], [12]), ([21, 22], [13, 14])])
    lists = [Span.model_construct(**{**s.__dict__, "prompt_token_ids": s.prompt_token_ids.tolist(),
                                     "response_token_ids": s.response_token_ids.tolist(),
                                     "response_logprobs": s.response_logprobs.tolist()}) for s in spans]
    assert type(lists[0].prompt_token_ids) is list
    packed, from_lists = rollout(spans), Rollout.model_construct(**{**rollout(spans).__dict__, "spans": lists})
    assert [c.prompt_ids for c in rollout_calls(from_lists, TraceCounts())] == [s.prompt_token_ids for s in spans]
    for aggregate in (lambda r: trajectory_batch([r], 4, 16)[0], lambda r: transition_batch([r], 8, 4)[0]):
        a, b = aggregate(packed), aggregate(from_lists)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a.tensors.keys())


@pytest.mark.parametrize("max_response", [3, 40, 400])
def test_one_and_two_threads_lay_out_the_same_batch(max_response):
    rng = random.Random(max_response)
    rollouts = []
    for r in range(12):
        turns = [([rng.randrange(1, 99) for _ in range(rng.randrange(4))], [rng.randrange(1, 99) for _ in range(5)])
                 for _ in range(rng.randrange(1, 6))]
        rollouts.append(rollout(conversation([7] * rng.randrange(1, 9), turns, rollout_id=f"r{r}"),
                                rollout_id=f"r{r}", task_id=f"t{r // 4}", final_reward=r / 12))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_metrics, _ = trajectory_batch(rollouts, 6, max_response)
        torch.set_num_threads(2)
        two, two_metrics, _ = trajectory_batch(rollouts, 6, max_response)
    finally:
        torch.set_num_threads(threads)
    assert list(one.tensors.keys()) == list(two.tensors.keys()) and one_metrics == two_metrics
    assert all(torch.equal(one[k], two[k]) for k in one.tensors.keys())
    assert "rollout_log_probs" in one and one["rollout_log_probs"].abs().sum() > 0
