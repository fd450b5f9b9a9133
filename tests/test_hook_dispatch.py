"""Hook dispatch through pluggy: wrappers, tryfirst/trylast, monitoring and tracing, result checks.

Plugins here are real plugin objects registered through ``PluginSet.load``;
the end-to-end test trains one step on the instant backend (agl-plugin-instant).
"""

import logging

import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import Components
from agl_core.data import Batch, Task
from agl_core.loop import Trainer
from agl_core.plugins import PluginError, PluginSet

TASKS = [Task(id=f"t{i}", input={"prompt_ids": [i, i + 1]}) for i in range(4)]


class Plugin:
    AGL_HOOK_API = HOOK_API_VERSION


def stage(name, log, order=100, **marks):
    """A pipeline stage that appends ``name`` to ``log`` and passes the batch on."""

    class Stage(Plugin):
        AGL_ORDER = order

        @hookimpl(**marks)
        def post_process_batch(self, batch):
            log.append(name)
            return batch

    return Stage()


def small_trainer(make_recipe, plugins, overrides=()):
    base = ["plugins.instant.world_size=1", "data.train_batch_size=4", "data.max_prompt_length=8",
            "data.max_response_length=4", "rollout.n=2", "algorithm.ppo_mini_batch_size=4",
            "trainer.val_before_train=false", "trainer.total_steps=1"]
    recipe, pset = make_recipe(base + list(overrides), plugins=plugins, flags=["instant"])
    return Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])


def test_wrappers_wrap_slots_each_stage_and_each_broadcast_call_in_a_real_step(make_recipe):
    """New-style and old-style wrappers run around the calls of a training step and see their results."""
    seen = []

    class Timing(Plugin):
        @hookimpl(wrapper=True)
        def update_actor(self, ctx, batch):
            metrics = yield
            seen.append(("update_actor", len(batch), "actor/pg_loss" in metrics))
            return {**metrics, "timing/wrapped": 1.0}  # a wrapper may replace the result

        @hookimpl(hookwrapper=True)
        def post_process_batch(self, batch):
            outcome = yield
            seen.append(("post_process_batch", type(outcome.get_result()).__name__))

        @hookimpl(wrapper=True)
        def log_metrics(self, metrics, step):
            result = yield
            seen.append(("log_metrics", step, "timing/wrapped" in metrics))
            return result

    trainer = small_trainer(make_recipe, [("timing", Timing())])
    metrics = trainer.fit()
    assert metrics["timing/wrapped"] == 1.0
    assert [s for s in seen if s[0] == "update_actor"] == [("update_actor", 8, True)]  # 4 tasks x 2 samples
    # One stage (instant's aggregator) wrapped once, with the Batch it returned.
    assert [s for s in seen if s[0] == "post_process_batch"] == [("post_process_batch", "Batch")]
    # Each active logger's call is wrapped: console, jsonl, tensorboard at step 1.
    loggers = [name for name, _ in trainer.ctx.plugins.implementations("log_metrics")]
    assert [s for s in seen if s[0] == "log_metrics"] == [("log_metrics", 1, True)] * len(loggers)
    assert trainer.ctx.plugins.plugins["timing"].wrappers == ["log_metrics", "post_process_batch", "update_actor"]
    assert trainer.ctx.plugins.plugins["timing"].hooks == []


def test_a_wrapper_never_fills_a_slot_nor_counts_as_a_stage():
    class Wrap(Plugin):
        @hookimpl(wrapper=True)
        def advantage(self, batch):
            return (yield)

        @hookimpl(wrapper=True)
        def post_process_batch(self, batch):
            return (yield)

    pset = PluginSet.load(extra=[("wrap", Wrap())], disable=["instant"])
    assert pset.resolve_slot("advantage")[0] == "estimators"
    assert "wrap" not in [name for name, _ in pset.pipeline("post_process_batch")]


def test_tryfirst_and_trylast_order_pipeline_stages_before_agl_order():
    log = []
    plugins = [("late", stage("late", log, order=1, trylast=True)),
               ("plain", stage("plain", log, order=50)),
               ("early", stage("early", log, order=99, tryfirst=True))]
    pset = PluginSet.load(extra=plugins, disable=["instant"])
    stages = pset.pipeline("post_process_batch")
    assert [name for name, _ in stages] == ["early", "plain", "late"]
    batch = Batch(meta={"rollouts": []})
    for _, call in stages:
        batch = call(ctx=None, batch=batch)
    assert log == ["early", "plain", "late"]


def test_tryfirst_orders_a_broadcast():
    calls = []

    def logger(name, **marks):
        class Logger(Plugin):
            @hookimpl(**marks)
            def log_metrics(self, ctx, metrics, step):
                calls.append(name)

        return Logger()

    pset = PluginSet.load(extra=[("a_last", logger("a_last", trylast=True)), ("b", logger("b")),
                                 ("z_first", logger("z_first", tryfirst=True))],
                          disable=["console", "jsonl", "tensorboard"])
    pset.broadcast("log_metrics", ctx=None, metrics={}, step=1)
    assert calls == ["z_first", "b", "a_last"]


def test_tryfirst_on_a_slot_is_refused_at_load_with_a_message():
    class Eager(Plugin):
        @hookimpl(tryfirst=True)
        def update_actor(self, ctx, batch):
            return {}

    pset = PluginSet.load(extra=[("eager", Eager())])
    assert pset.plugins["eager"].status == "failed"
    assert "tryfirst has no meaning there" in pset.plugins["eager"].reason
    assert "plugins.slots.update_actor=<name>" in pset.plugins["eager"].reason


def test_a_wrapper_that_is_not_a_generator_is_refused():
    class Bad(Plugin):
        @hookimpl(wrapper=True)
        def log_metrics(self, metrics):
            return None

    pset = PluginSet.load(extra=[("bad", Bad())])
    assert pset.plugins["bad"].status == "failed"
    assert "is not a generator function" in pset.plugins["bad"].reason


def test_hookcall_monitoring_and_agl_trace_hooks_see_each_call(monkeypatch, caplog):
    log = []
    monkeypatch.setenv("AGL_TRACE_HOOKS", "1")
    pset = PluginSet.load(extra=[("s1", stage("s1", log)), ("s2", stage("s2", log))], disable=["instant"])
    monitored = []
    undo = pset.manager.add_hookcall_monitoring(
        lambda hook, impls, kwargs: monitored.append((hook, [i.plugin_name for i in impls])),
        lambda outcome, hook, impls, kwargs: None)
    with caplog.at_level(logging.INFO, logger="agl_core.hooks"):
        batch = Batch(meta={"rollouts": []})
        for _, call in pset.pipeline("post_process_batch"):
            batch = call(ctx=None, batch=batch)
    undo()
    assert monitored == [("post_process_batch", ["s1"]), ("post_process_batch", ["s2"])]
    traced = [r.getMessage() for r in caplog.records if r.name == "agl_core.hooks"]
    assert len(traced) == 2
    assert traced[0].startswith("hook post_process_batch [s1] ") and traced[0].endswith("ms -> Batch(0 rows)")


def test_a_stage_returning_none_names_the_plugin_the_hook_and_what_was_expected():
    class Forgetful(Plugin):
        @hookimpl
        def post_process_batch(self, batch):
            batch.meta["seen"] = True  # and forgets to return it

    pset = PluginSet.load(extra=[("forgetful", Forgetful())], disable=["instant"])
    (_, call), = pset.pipeline("post_process_batch")
    with pytest.raises(PluginError, match=r"plugin forgetful \(unregistered \?\): hook 'post_process_batch' "
                                          r"returned None, expected the Batch it was given"):
        call(ctx=None, batch=Batch(meta={"rollouts": []}))


def test_a_slot_with_the_wrong_columns_is_named():
    class NoReturns(Plugin):
        @hookimpl
        def advantage(self, batch):
            batch["advantages"] = torch.zeros_like(batch["responses"], dtype=torch.float32)
            return batch

    pset = PluginSet.load(extra=[("noreturns", NoReturns())])
    batch = Batch({"responses": torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(PluginError, match=r"hook 'advantage' returned a Batch without 'returns'"):
        pset.resolve_slot("advantage")[1](ctx=None, batch=batch)


def estimator_plugin(result):
    class Estimator(Plugin):
        @hookimpl
        def register_estimators(self, register):
            register("odd", lambda batch, config: result(batch))

    return Estimator()


@pytest.mark.parametrize("result, message", [
    (lambda batch: None, r"estimator 'odd' of plugin 'odd_plugin' returned None, expected \(advantages, returns\)"),
    (lambda batch: (torch.zeros(2), torch.zeros(2, 3)),
     r"estimator 'odd' of plugin 'odd_plugin' returned advantages of shape \(2,\), expected .* \(2, 3\)"),
])
def test_an_estimator_returning_the_wrong_thing_is_an_error_naming_it(make_recipe, result, message):
    recipe, pset = make_recipe(["algorithm.estimator=odd"], plugins=[("odd_plugin", estimator_plugin(result))])
    from agl_core.context import TrainContext

    ctx = TrainContext(recipe, pset, Components.collect(pset), recipe.trainer.run_dir)
    batch = Batch({"responses": torch.zeros(2, 3, dtype=torch.long),
                   "token_level_rewards": torch.zeros(2, 3), "response_mask": torch.ones(2, 3)},
                  {"uid": ["a", "a"]})
    with pytest.raises(PluginError, match=message):
        pset.call("advantage", "estimators", ctx=ctx, batch=batch)


def test_a_function_named_like_a_hook_without_hookimpl_is_a_warning(caplog):
    class Unmarked(Plugin):
        def log_metrics(self, ctx, metrics, step):
            pass

        @hookimpl
        def on_train_start(self, ctx):
            pass

    with caplog.at_level(logging.WARNING, logger="agl_core.plugins"):
        pset = PluginSet.load(extra=[("unmarked", Unmarked())])
    plugin = pset.plugins["unmarked"]
    assert plugin.status == "active" and plugin.hooks == ["on_train_start"]
    assert len(plugin.warnings) == 1 and "'log_metrics'" in plugin.warnings[0] and "@hookimpl" in plugin.warnings[0]
    assert any("is not marked @hookimpl" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("declared", ["abc", "1", 1.1, "v1.2"])
def test_a_malformed_hook_api_says_what_the_format_is(declared):
    class Odd:
        AGL_HOOK_API = declared

    pset = PluginSet.load(extra=[("odd", Odd())])
    reason = pset.plugins["odd"].reason
    assert "is not a hook API version" in reason and "'MAJOR.MINOR'" in reason and "invalid literal" not in reason


def test_misspelled_names_get_a_did_you_mean():
    class Typo(Plugin):
        @hookimpl
        def log_metric(self, ctx):
            pass

    pset = PluginSet.load(extra=[("typo", Typo())])
    assert "(did you mean 'log_metrics'?)" in pset.plugins["typo"].reason
    with pytest.raises(PluginError, match=r"'consol' is enabled but not installed \(did you mean 'console'\?\)"):
        PluginSet.load(enable=["consol"])
    components = Components.collect(PluginSet.load())
    with pytest.raises(PluginError, match=r"unknown estimator 'gpro' \(did you mean 'grpo'"):
        components.get("estimator", "gpro")
    with pytest.raises(PluginError, match=r"unknown store 'memroy' \(did you mean 'memory'\?\)"):
        components.get("store", "memroy")


def test_an_unknown_estimator_names_the_installed_plugin_that_provides_it():
    # agl-plugin-traces is installed but not active: it registers the *_rollout estimators.
    components = Components.collect(PluginSet.load())
    with pytest.raises(PluginError, match=r"installed but not active: plugin traces provides it .*-p traces"):
        components.get("estimator", "grpo_rollout")


def test_estimators_read_their_plugins_settings(make_recipe):
    from pydantic import BaseModel

    class Settings(BaseModel):
        scale: float = 1.0

    class Scaled(Plugin):
        @hookimpl
        def plugin_config_schema(self):
            return Settings

        @hookimpl
        def register_estimators(self, register, settings):
            register("scaled", lambda batch, config: (batch["token_level_rewards"] * settings.scale,) * 2)

    recipe, pset = make_recipe(["plugins.scaled.scale=3.0"], plugins=[("scaled", Scaled())])
    components = Components.collect(pset)
    rewards = torch.ones(1, 2)
    advantages, _ = components.get("estimator", "scaled").obj(Batch({"token_level_rewards": rewards}), None)
    assert advantages.tolist() == [[3.0, 3.0]]


def test_a_required_setting_missing_under_p_is_named_with_its_path(make_recipe, plugin_distribution):
    source = f"""
from pydantic import BaseModel
from agl_core import hookimpl
AGL_HOOK_API = "{HOOK_API_VERSION}"

class Settings(BaseModel):
    api_key: str

@hookimpl
def plugin_config_schema():
    return Settings
"""
    plugin_distribution("agl-plugin-needy", {"needy_plugin": source}, {"needy": "needy_plugin"})
    from agl_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"plugins\.needy\.api_key: required setting is missing") as err:
        make_recipe(flags=["needy"])
    assert "plugins.needy.KEY=VALUE" in str(err.value)
    recipe, _ = make_recipe(["plugins.needy.api_key=k"], flags=["needy"])
    assert recipe.plugin_config["needy"].api_key == "k"


def test_p_no_name_switches_off_a_plugin_the_recipe_enables(make_recipe):
    recipe, pset = make_recipe(["plugins.instant.world_size=2"], flags=["no:instant"])
    assert pset.plugins["instant"].status == "disabled"
    assert "instant" not in recipe.plugins.enable and "instant" not in recipe.plugin_config
    recipe, pset = make_recipe(["plugins.disable=[console]"], flags=["console"])
    assert pset.plugins["console"].status == "active"


def test_the_later_p_flag_wins():
    from agl_core.plugins import parse_plugin_flags

    assert parse_plugin_flags(["a", "no:a"]) == ([], ["a"])
    assert parse_plugin_flags(["no:a", "a", "b"]) == (["a", "b"], [])
