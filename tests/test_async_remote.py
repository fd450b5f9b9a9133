"""Asynchronous training with runners elsewhere: ``agl runner`` processes, the store and gateway services.

Every service is a real process on 127.0.0.1 (see ``test_runner_service``);
the trainer runs the embedded torch backend (a tiny model) with the
``remote_runners`` plugin and ``trainer.async.max_staleness=1``. The gateway
service is not paused around a sync: each span records the version the
policy server reported for the weights that made its answer.
"""

from __future__ import annotations

import collections

import pytest

from agl_core.builtin.remote_runners import NAME as REMOTE_RUNNERS
from agl_core.loop import Trainer
from agl_core.rollout.staleness import served_version, staleness
from agl_core.testing import BatchRecorder

from test_runner_service import TASKS, plane  # noqa: F401 (a fixture)

torch_testing = pytest.importorskip("agl_plugin_torch.testing")


def test_async_training_through_remote_runners_trains_whole_groups_within_the_bound(plane, make_recipe,  # noqa: F811
                                                                                     monkeypatch):
    monkeypatch.syspath_prepend(str(plane.tmp_path))  # rollout.agent names the runners' agent; never imported here
    plane.runner("runner", "--workers", "4")
    recorder = BatchRecorder(order=1)
    section = torch_testing.tiny_section()
    recipe, plugins = make_recipe(
        ["rollout.agent=remote_agents:echo", "rollout.n=2", "data.train_batch_size=3", "data.max_response_length=5",
         "data.max_prompt_length=64", "rollout.store=http", f"plugins.http_store.url={plane.store}",
         f"plugins.remote_runners.gateway_url={plane.gateway}", f"plugins.slots.collect_rollouts={REMOTE_RUNNERS}",
         "plugins.traces.aggregator=transition", "algorithm.ppo_mini_batch_size=4",
         "trainer.val_before_train=false", "trainer.total_steps=3", "trainer.async.max_staleness=1",
         *[f"plugins.torch.{key}={value}" for key, value in flat(section)]],
        plugins=[("recorder", recorder)], flags=["torch", "traces", "remote_runners"])
    trainer = Trainer(recipe, plugins, train_tasks=TASKS, val_tasks=TASKS)
    metrics = trainer.fit()
    assert metrics["async/n_stale_dropped"] == 0 and "async/weight_sync_s" in metrics
    seen = set()
    for step, batch in enumerate(recorder.batches, start=1):
        rollouts = batch.meta["rollouts"]
        assert set(collections.Counter(r.task_id for r in rollouts).values()) == {2}  # whole groups
        assert {r.metadata["step"] for r in rollouts} == {step}
        for rollout in rollouts:
            assert rollout.rollout_id not in seen
            seen.add(rollout.rollout_id)
            assert 0 <= staleness(step, served_version(rollout)) <= 1
    assert len(recorder.batches) == 3 and len(seen) == 3 * len(TASKS) * 2


def flat(section: dict, prefix: str = ""):
    """``(dotted key, value)`` pairs of a nested section, as recipe overrides."""
    for key, value in section.items():
        if isinstance(value, dict):
            yield from flat(value, f"{prefix}{key}.")
        elif isinstance(value, list):
            yield f"{prefix}{key}", "[" + ",".join(f"'{v}'" for v in value) + "]"
        else:
            yield f"{prefix}{key}", value
