"""Staleness of rollouts and the groups a step may train on (pure functions); the recipe switch."""

from __future__ import annotations

import pytest

from agl_core.config import ConfigError, validate_recipe
from agl_core.data import Rollout, Span
from agl_core.rollout.staleness import served_version, staleness, within_bound


def rollout(rollout_id: str, task_id: str, *versions: int | None) -> Rollout:
    """A rollout whose model calls were served by ``versions`` (None: a call that recorded none)."""
    spans = [Span(rollout_id=rollout_id, attempt_id="1", sequence_id=i, kind="llm_call",
                  attributes={"weight_version": v} if v is not None else {})
             for i, v in enumerate(versions)]
    spans.append(Span(rollout_id=rollout_id, attempt_id="1", sequence_id=len(versions), kind="reward",
                      attributes={"weight_version": -5}))  # not a model call: ignored
    return Rollout(rollout_id=rollout_id, task_id=task_id, status="succeeded", spans=spans)


def test_a_rollout_is_as_old_as_the_oldest_weights_that_served_it():
    assert served_version(rollout("a", "t", 4, 3, 5)) == 3  # it spanned a sync: its oldest call counts
    assert served_version(rollout("a", "t", None, 2)) == 2
    assert served_version(rollout("a", "t")) is None
    assert served_version(rollout("a", "t", None)) is None


def test_staleness_counts_updates_between_serving_and_training_weights():
    assert staleness(step=1, version=0) == 0  # synchronous: step t trains on version t - 1
    assert staleness(step=5, version=4) == 0
    assert staleness(step=5, version=3) == 1
    assert staleness(step=5, version=1) == 3


def test_groups_are_taken_or_dropped_whole_and_counted():
    fresh = [rollout("a0", "a", 4), rollout("a1", "a", 3)]  # staleness 0 and 1 at step 5
    one_stale = [rollout("b0", "b", 4), rollout("b1", "b", 4, 2)]  # b1's first call is 2 updates old
    no_calls = [rollout("c0", "c"), rollout("c1", "c", None)]
    taken = within_bound([fresh, one_stale, no_calls], step=5, max_staleness=1)
    assert [r.rollout_id for r in taken.rollouts] == ["a0", "a1", "c0", "c1"]
    assert taken.n_stale_dropped == 2 and taken.n_groups_dropped == 1
    assert taken.metrics() == {"async/n_stale_dropped": 2.0, "async/n_groups_dropped": 1.0,
                               "async/staleness_mean": 0.5, "async/staleness_max": 1.0}


def test_a_larger_bound_keeps_what_a_smaller_one_drops():
    groups = [[rollout("b0", "b", 4), rollout("b1", "b", 2)]]
    assert within_bound(groups, step=5, max_staleness=1).rollouts == []
    assert len(within_bound(groups, step=5, max_staleness=2).rollouts) == 2


def test_metrics_without_versions_report_only_the_counts():
    taken = within_bound([[rollout("c0", "c")]], step=3, max_staleness=1)
    assert taken.metrics() == {"async/n_stale_dropped": 0.0, "async/n_groups_dropped": 0.0}


def test_the_recipe_switch_is_trainer_async_max_staleness():
    assert validate_recipe({}).trainer.async_.max_staleness == 0  # synchronous by default
    assert validate_recipe({"trainer": {"async": {"max_staleness": 2}}}).trainer.async_.max_staleness == 2
    with pytest.raises(ConfigError, match=r"trainer\.async\.max_staleness"):
        validate_recipe({"trainer": {"async": {"max_staleness": -1}}})
    with pytest.raises(ConfigError, match=r"trainer\.async\.k: unknown key \(allowed keys: max_staleness"):
        validate_recipe({"trainer": {"async": {"k": 1}}})
    with pytest.raises(ConfigError, match=r"rollout_is"):
        validate_recipe({"algorithm": {"rollout_correction": {"rollout_is": "geometric"}}})
    sequence = {"algorithm": {"rollout_correction": {"rollout_is": "sequence"}}}
    assert validate_recipe(sequence).algorithm.rollout_correction.rollout_is == "sequence"
