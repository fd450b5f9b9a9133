"""The plugin's contract and its small pieces: loading, worker layouts, batch-size check, rollout-server cycle."""

from __future__ import annotations

import importlib.metadata

import pytest

from agl_core.config import ConfigError, read_recipe, validate_recipe
from agl_core.plugins import PluginError
from agl_core.testing import check_plugin

from agl_plugin_verl import plugin
from agl_plugin_verl.config import build_verl_config
from agl_plugin_verl.rollout import RolloutServers
from agl_plugin_verl.workers import Layout, layout


def test_entry_point_and_contract():
    (entry,) = [ep for ep in importlib.metadata.entry_points(group="agl_core.plugins") if ep.name == "verl"]
    assert entry.dist.name == "agl-plugin-verl"
    loaded = check_plugin(entry.load(), "verl")
    assert {"compute_old_logprob", "compute_ref_logprob", "compute_values", "update_actor", "update_critic",
            "policy_endpoints", "save_checkpoint", "load_checkpoint", "register_estimators",
            "register_policy_losses", "plugin_config_schema"} <= set(loaded.hooks)


def verl_config(*overrides, **section):
    return build_verl_config(validate_recipe(read_recipe(None, list(overrides))), section)


@pytest.mark.parametrize("device, lora, needs_ref, expected", [
    ("cuda", 0, False, Layout("actor_rollout", None, False, False)),
    ("cuda", 0, True, Layout("actor_rollout_ref", None, False, False)),
    ("cuda", 8, True, Layout("actor_rollout", None, True, False)),      # reference = actor without its adapter
    ("cpu", 0, True, Layout("actor", "ref", False, False)),             # CPU workers have no rollout engine
    ("cpu", 8, True, Layout("actor", None, True, False)),
])
def test_worker_layout_follows_verls_trainer(device, lora, needs_ref, expected):
    cfg = verl_config(**{"trainer.device": device, "actor_rollout_ref.model.lora_rank": lora})
    assert layout(cfg, needs_ref=needs_ref, needs_critic=False) == expected


def test_mini_batch_must_split_over_the_workers():
    recipe = validate_recipe(read_recipe(None, ["algorithm.ppo_mini_batch_size=6"]))
    cfg = build_verl_config(recipe, {"trainer.n_gpus_per_node": 4})
    with pytest.raises(ConfigError, match=r"ppo_mini_batch_size=6 rows do not split over the 4 verl worker"):
        plugin._check_batch_sizes(recipe, cfg)
    assert plugin._check_batch_sizes(recipe, build_verl_config(recipe, {"trainer.n_gpus_per_node": 2})) == 2


class FakeServers:
    """Records the transitions verl's replicas would make (vLLM cannot run on a CPU)."""

    def __init__(self):
        self.calls = []

    def servers(self, keeps_weights=False) -> RolloutServers:
        return RolloutServers(["10.0.0.1:8000", "[::1]:8001"], lambda v: self.calls.append(f"wake {v}"),
                              lambda: self.calls.append("sleep"), _wake=lambda: self.calls.append("wake, no sync"),
                              keeps_weights=keeps_weights, _abort=lambda: self.calls.append("abort"),
                              _resume=lambda: self.calls.append("resume"))


def test_rollout_servers_wake_with_current_weights_and_sleep_for_training():
    fake = FakeServers()
    servers = fake.servers()
    assert servers.endpoints(0) == ["http://10.0.0.1:8000/v1", "http://[::1]:8001/v1"]
    servers.endpoints(0)          # already awake with these weights: nothing to do
    servers.sleep()
    servers.sleep()               # already asleep
    servers.endpoints(1)          # the actor changed: wake with its new weights
    servers.endpoints(2)          # awake but stale: verl loads weights into sleeping servers only
    assert fake.calls == ["wake 0", "resume", "abort", "sleep", "wake 1", "resume", "abort", "sleep", "wake 2",
                          "resume"]
    assert servers.syncs == 3


def test_a_wake_syncs_weights_only_when_they_changed_or_the_sleep_discarded_them():
    """A step that did not update the actor (critic warm-up) sleeps and wakes the servers with the same weights."""
    kept = FakeServers()
    servers = kept.servers(keeps_weights=True)   # vLLM sleep level 1: a LoRA adapter's weights are kept asleep
    servers.endpoints(0)
    servers.sleep()
    servers.endpoints(0)                         # unchanged: woken without a sync
    servers.sleep()
    servers.endpoints(1)                         # changed: synced
    assert [c for c in kept.calls if c.startswith("wake")] == ["wake 0", "wake, no sync", "wake 1"]
    assert servers.syncs == 2
    discarded = FakeServers()
    servers = discarded.servers(keeps_weights=False)  # level 2: a full model's weights are discarded asleep
    servers.endpoints(0)
    servers.sleep()
    servers.endpoints(0)
    assert [c for c in discarded.calls if c.startswith("wake")] == ["wake 0", "wake 0"]


def test_residual_requests_are_aborted_before_the_servers_sleep():
    fake = FakeServers()
    servers = fake.servers()
    servers.endpoints(0)
    servers.sleep()
    assert fake.calls[-2:] == ["abort", "sleep"]
    servers.endpoints(0)
    assert fake.calls[-1] == "resume"  # requests are let in again once the weights are loaded


@pytest.mark.parametrize("overrides, keeps", [
    ({}, False),
    ({"actor_rollout_ref.model.lora_rank": 8}, True),
    ({"actor_rollout_ref.model.lora_rank": 8, "+actor_rollout_ref.model.lora.merge": True}, False),
])
def test_which_servers_keep_their_weights_asleep_follows_verl(overrides, keeps):
    from agl_plugin_verl.rollout import sleep_keeps_weights

    assert sleep_keeps_weights(verl_config(**overrides)) is keeps


def test_a_wrong_model_name_is_a_start_up_error_on_gpu_workers():
    recipe = validate_recipe(read_recipe(None, ["rollout.model=policy"]))
    cfg = build_verl_config(recipe, {"actor_rollout_ref.model.path": "/models/tiny"})
    with pytest.raises(ConfigError, match=r"rollout.model is 'policy', but verl's rollout servers \(vLLM\) serve "
                                          r"the model as '/models/tiny'.*set rollout.model: /models/tiny"):
        plugin.check_served_model_name(recipe, cfg)
    right = validate_recipe(read_recipe(None, ["rollout.model=/models/tiny"]))
    plugin.check_served_model_name(right, cfg)
    cpu = build_verl_config(recipe, {"actor_rollout_ref.model.path": "/models/tiny", "trainer.device": "cpu"})
    plugin.check_served_model_name(recipe, cpu)  # CPU workers serve nothing


def test_on_train_start_refuses_a_wrong_model_name_before_starting_anything(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "init", lambda **kwargs: pytest.fail("Ray was started"))

    class StartCtx(Ctx):
        config = validate_recipe(read_recipe(None, ["rollout.model=policy"]))

        def plugin_config(self, name):
            return {"actor_rollout_ref.model.path": "/models/tiny"}
    ctx = StartCtx()
    with pytest.raises(ConfigError, match="rollout.model is 'policy'"):
        plugin.on_train_start(ctx)
    assert plugin.state_of(ctx).run is None


def test_shutdown_stops_the_rollout_server_actors_even_when_ray_is_someone_elses(monkeypatch):
    """Ray was running before the run (``started_ray`` is False): the server actors are killed all the same."""
    import ray

    killed, stopped = [], []
    monkeypatch.setattr(ray, "kill", killed.append)
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))

    class Groups:
        def shutdown(self):
            killed.append("worker groups")
    fake = FakeServers()
    servers = fake.servers()
    servers.actors = ["vllm server 0", "vllm server 1", "load balancer"]
    ctx = Ctx()
    plugin.state_of(ctx).run = plugin.VerlRun(config=None, version=None, groups=Groups(), servers=servers)
    plugin.on_train_end(ctx)
    assert killed == ["vllm server 0", "vllm server 1", "load balancer", "worker groups"]
    assert stopped == [] and servers.actors == []


class Ctx:
    def __init__(self):
        self.state = {}


def test_cpu_workers_serve_no_policy_endpoint():
    ctx = Ctx()
    plugin.state_of(ctx).run = plugin.VerlRun(config=None, version=None, groups=None)
    with pytest.raises(PluginError, match="trainer.device=cpu runs verl's workers without a rollout engine"):
        plugin.policy_endpoints(ctx)


def test_slots_before_start_say_so():
    with pytest.raises(PluginError, match="on_train_start of plugin 'verl' did not run"):
        plugin.compute_values(Ctx(), batch=None)


def test_checkpoint_loaded_before_start_is_kept_for_it(tmp_path):
    ctx = Ctx()
    plugin.load_checkpoint(ctx, str(tmp_path))
    assert plugin.state_of(ctx).resume_from == tmp_path


def test_ray_is_started_as_verl_starts_it_unless_running(monkeypatch):
    import ray

    calls = []
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)  # verl leaves out variables the shell sets
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    assert plugin._start_ray(verl_config(**{"ray_kwargs.ray_init.num_cpus": 3}))
    (kwargs,) = calls
    assert kwargs["num_cpus"] == 3
    assert kwargs["runtime_env"]["env_vars"]["TOKENIZERS_PARALLELISM"] == "true"  # verl's worker environment
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    assert not plugin._start_ray(verl_config())


def test_ray_this_plugin_started_is_stopped_even_after_a_failed_start(monkeypatch):
    import ray

    stopped = []
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append(True))
    ctx = Ctx()
    plugin.state_of(ctx).started_ray = True  # the worker groups never came up
    plugin.on_train_end(ctx)
    plugin.on_train_end(ctx)
    assert stopped == [True]


def test_asynchronous_training_is_refused_at_start_naming_what_verl_lacks_here():
    from types import SimpleNamespace

    ctx = SimpleNamespace(config=validate_recipe({"trainer": {"async": {"max_staleness": 1}}}))
    with pytest.raises(PluginError, match=r"max_staleness=1: the verl plugin cannot train asynchronously.*"
                                          r"one_step_off_policy.*separate rollout and trainer resource pools"):
        plugin.on_train_start(ctx)
    plugin.refuse_async(SimpleNamespace(config=validate_recipe({})))  # k=0: nothing to refuse


def test_old_log_probs_send_the_token_counts_verls_workers_compute_mfu_from():
    """verl's ``infer_batch`` reports ``mfu`` (logged as ``perf/mfu/actor_infer``) only when the batch carries
    ``global_token_num``, as verl's trainer sets it: the tokens of each row. The worker group is a stand-in that
    captures what it is sent (verl's CPU workers have no FLOPs counter, a CPU has no peak figure)."""
    import torch

    from agl_core.data import Batch
    from agl_plugin_verl import calls
    from verl.utils import tensordict_utils as tu

    class Sent(Exception):
        pass

    class Actor:
        def compute_log_prob(self, td):
            raise Sent(tu.get(td, "global_token_num"))

    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    batch = Batch({"input_ids": torch.ones(3, 5, dtype=torch.long), "attention_mask": mask,
                   "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": torch.ones(3, 2, dtype=torch.long),
                   "response_mask": mask[:, 3:]})
    with pytest.raises(Sent) as sent:
        calls.compute_log_prob(Actor(), batch, temperature=1.0)
    assert list(sent.value.args[0]) == [3, 5, 2]
