"""The plugin on a real two-node Ray cluster, with the store and gateway services as real processes.

The agents (``ray_agents.py``) call the test policy endpoint with the real
``openai`` client from inside the runner actors, through the gateway service.
One cluster serves the module (starting Ray takes seconds); each run joins it
through ``plugins.ray.address`` and leaves it at its end.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

import agl_plugin_ray.plugin as ray_plugin
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.plugins import PluginSet
from agl_core.testing import BatchRecorder, PolicyEndpoints, check_plugin
from agl_core.testing.endpoint import TestEndpoint

HERE = Path(__file__).resolve().parent
WORDS = ["apple", "pear", "fig", "plum"]



@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one logical CPU each on this machine (actors take fractions of it)."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    yield c
    c.shutdown()


@pytest.fixture
def endpoint_url():
    server = TestEndpoint().serve()
    yield server.url + "/v1"
    server.stop()


def trainer(make_recipe, cluster, endpoint_url, sleep_s, overrides=()):
    """A run of one step: 4 tasks × 2 samples, one actor per node with 2 workers, the instant backend."""
    recorder = BatchRecorder(order=1)
    recipe, plugins = make_recipe(
        ["rollout.agent=ray_agents:echo", "rollout.n=2", "data.train_batch_size=4", "data.max_response_length=16",
         "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0",
         "plugins.slots.collect_rollouts=ray", "plugins.slots.policy_endpoints=endpoints",
         f"plugins.ray.address={cluster.address}", "plugins.ray.actors_per_node=1", "plugins.ray.num_cpus=0.25",
         "plugins.ray.workers=2", f"plugins.ray.runtime_env.env_vars.PYTHONPATH={HERE}", *overrides],
        plugins=[("endpoints", PolicyEndpoints([endpoint_url])), ("recorder", recorder)], flags=["instant", "ray"])
    tasks = [Task(id=f"t{i}", input={"word": w, "sleep_s": sleep_s}) for i, w in enumerate(WORDS)]
    return Trainer(recipe, plugins, train_tasks=tasks, val_tasks=[]), recorder


def annotations(rollout):
    return [s.attributes for s in rollout.spans if s.kind == "annotation"]


def test_the_installed_entry_point_loads_and_passes_the_contract_checks():
    plugin = PluginSet.load(enable=["ray"]).plugins["ray"]
    assert (plugin.distribution, plugin.status) == ("agl-plugin-ray", "active")
    assert plugin.hooks == ["collect_rollouts", "on_train_end", "on_train_start", "plugin_config_schema"]
    check_plugin(ray_plugin, "ray")


def test_a_step_runs_every_rollout_on_actors_of_both_nodes(make_recipe, cluster, endpoint_url):
    t, recorder = trainer(make_recipe, cluster, endpoint_url, sleep_s=0.3)
    metrics = t.fit()

    assert metrics["rollout/n_rollouts"] == 8 and metrics["rollout/n_succeeded"] == 8
    assert metrics["rollout/n_retried"] == 0
    assert (metrics["ray/actors"], metrics["ray/actors_alive"], metrics["ray/actor_restarts"]) == (2, 2, 0)
    rollouts = recorder.batches[0].meta["rollouts"]
    assert sorted((r.task_id, r.sample_index) for r in rollouts) == [(f"t{i}", s) for i in range(4) for s in (0, 1)]
    assert all(r.final_reward == 1.0 for r in rollouts)
    calls = [s for r in rollouts for s in r.spans if s.kind == "llm_call"]
    assert len(calls) == 8  # each call recorded once, by the gateway service into the store service
    nodes = {a["node_id"] for r in rollouts for a in annotations(r)}
    assert len(nodes) == 2  # both nodes ran agents
    assert "ray" not in t.ctx.state and not ray.is_initialized()  # actors, services and connection closed
    assert (t.ctx.run_dir / "rollouts.sqlite").exists()  # the store service the plugin started


def test_a_killed_actor_is_restarted_and_the_step_completes(make_recipe, cluster, endpoint_url):
    # Short leases: the killed actor's attempts are requeued within seconds. Step 2 sees the restarted actor.
    t, recorder = trainer(make_recipe, cluster, endpoint_url, sleep_s=1.0,
                          overrides=["rollout.lease_s=2", "trainer.total_steps=2"])
    killed = []

    def kill_one_actor_mid_step():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rt = t.ctx.state.get("ray")
            if rt is not None and len(rt.store.query(["running"])) >= 4:  # every worker of both actors is busy
                killed.append(rt.actors.pids[0])
                ray.kill(rt.actors.handles[0], no_restart=False)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_one_actor_mid_step)
    killer.start()
    t.fit()
    killer.join()

    assert killed, "no moment with every worker busy was seen"
    steps = {r["step"]: r for r in map(json.loads, (t.ctx.run_dir / "metrics.jsonl").read_text().splitlines())}
    for step, rollouts in zip((1, 2), (b.meta["rollouts"] for b in recorder.batches)):
        assert steps[step]["rollout/n_rollouts"] == 8 and steps[step]["rollout/n_succeeded"] == 8
        assert len({r.rollout_id for r in rollouts}) == 8 and all(r.final_reward == 1.0 for r in rollouts)
        # every rollout keeps the spans of its last attempt only: one call, one annotation
        assert all([s.kind for s in r.spans].count("llm_call") == 1 and len(annotations(r)) == 1 for r in rollouts)
    first, second = (b.meta["rollouts"] for b in recorder.batches)
    assert steps[1]["rollout/n_retried"] >= 1  # the killed actor's attempts ran again
    assert all(annotations(r)[0]["pid"] != killed[0] for r in first if r.attempts > 1)
    assert (steps[2]["ray/actors_alive"], steps[2]["ray/actor_restarts"]) == (2, 1)
    pids = {annotations(r)[0]["pid"] for r in second}
    assert len(pids) == 2 and killed[0] not in pids  # the restarted actor (a new process) took its share


def test_an_agent_the_actors_cannot_load_stops_the_run_at_start_up(make_recipe, cluster, endpoint_url):
    t, _ = trainer(make_recipe, cluster, endpoint_url, sleep_s=0, overrides=["rollout.agent=ray_agents:missing"])
    with pytest.raises(RuntimeError, match="could not start(.|\n)*rollout.agent='ray_agents:missing'"):
        t.fit()
    assert "ray" not in t.ctx.state and not ray.is_initialized()
