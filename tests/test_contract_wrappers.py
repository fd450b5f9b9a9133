"""The contract suite runs a plugin's hook wrappers, and a bad result is blamed on whoever made it."""

import pytest

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import ConfigError
from agl_core.data import Batch
from agl_core.plugins import HOOK_KINDS, PluginError, PluginSet
from agl_core.testing import contracts
from agl_core.testing.contracts import (STAND_IN, WRAPPED_CALLS, PluginContract, WrapperContract, check_wrapper,
                                        contract_env, example_batch)


class Plugin:
    AGL_HOOK_API = HOOK_API_VERSION


class Timing(Plugin):
    """Wrappers as a timing plugin writes them: each returns what it was given (one old-style)."""

    def __init__(self):
        self.seen = []

    @hookimpl(wrapper=True)
    def post_process_batch(self, batch):
        result = yield
        self.seen.append("post_process_batch")
        return result

    @hookimpl(wrapper=True)
    def update_actor(self):
        metrics = yield
        self.seen.append("update_actor")
        return {**metrics, "timing/wrapped": 1.0}

    @hookimpl(hookwrapper=True)
    def log_metrics(self, step):
        yield
        self.seen.append("log_metrics")


class Forgetful(Plugin):
    """A wrapper that forgets to return the result: the step would get None."""

    @hookimpl(wrapper=True)
    def advantage(self, batch):
        yield


class Stage(Plugin):
    @hookimpl
    def post_process_batch(self, batch):
        return batch


class ReplacesWithNone(Plugin):
    @hookimpl(wrapper=True)
    def post_process_batch(self):
        yield
        return None


class Passes(Plugin):
    @hookimpl(wrapper=True)
    def post_process_batch(self):
        return (yield)


class Dropping(Plugin):
    @hookimpl
    def post_process_batch(self, batch):
        return None


class TestTimingWrappers(PluginContract):
    """A plugin of wrappers only passes the aggregate contract: its wrappers run around stand-ins."""

    @pytest.fixture
    def plugin_name(self):
        return "timing"

    @pytest.fixture
    def plugin_object(self):
        return Timing()


class TestTimingWrapperContract(WrapperContract):
    @pytest.fixture
    def plugin_name(self):
        return "timing"

    @pytest.fixture
    def plugin_object(self):
        return Timing()


def env_factory(tmp_path, name, obj):
    counter = iter(range(100))
    return lambda standin: contract_env(tmp_path / f"run-{next(counter)}", name, obj,
                                        others=[(STAND_IN, standin)])


def test_every_hook_has_a_contract_call_for_its_wrappers():
    assert set(WRAPPED_CALLS) == set(HOOK_KINDS)


def test_each_wrapper_wraps_one_call_of_its_hook(tmp_path):
    timing = Timing()
    for hook in ("post_process_batch", "update_actor", "log_metrics"):
        check_wrapper(env_factory(tmp_path, "timing", timing), hook)
    assert timing.seen == ["post_process_batch", "update_actor", "log_metrics"]


def test_a_wrapper_returning_none_fails_the_contract_naming_the_wrapper(tmp_path):
    with pytest.raises(PluginError, match=r"the wrapper of hook 'advantage' \(forgetful \(unregistered \?\)\) "
                                          r"replaced the result of plugin contract_stand_in .*returned None"):
        check_wrapper(env_factory(tmp_path, "forgetful", Forgetful()), "advantage")


def test_a_wrapper_of_a_hook_without_a_contract_call_is_left_out_loudly(tmp_path, monkeypatch):
    env = contract_env(tmp_path / "run", "timing", Timing())
    monkeypatch.delitem(contracts.WRAPPED_CALLS, "update_actor")
    with pytest.raises(AssertionError, match=r"implements \['wrapper:update_actor'\], which no contract checks"):
        PluginContract().test_nothing_left_out(env)

    class Declared(PluginContract):
        not_covered = {"wrapper:update_actor": "tested elsewhere"}

    Declared().test_nothing_left_out(env)


def test_a_bad_result_is_blamed_on_the_wrapper_that_made_it():
    pset = PluginSet.load(extra=[("stage", Stage()), ("passes", Passes()), ("nulls", ReplacesWithNone())],
                          disable=["instant"])
    assert pset.wrappers_of("post_process_batch") == ["nulls", "passes"]  # the later registered: outermost
    with pytest.raises(PluginError) as raised:
        pset.call("post_process_batch", "stage", ctx=None, batch=example_batch())
    message = str(raised.value)
    assert "a wrapper of hook 'post_process_batch' (nulls (unregistered ?), passes (unregistered ?))" in message
    assert "replaced the result of plugin stage" in message and "returned None" in message


def test_a_bad_implementation_is_still_blamed_on_its_plugin_under_a_wrapper():
    pset = PluginSet.load(extra=[("dropping", Dropping()), ("passes", Passes())], disable=["instant"])
    with pytest.raises(PluginError, match=r"^plugin dropping \(unregistered \?\): hook 'post_process_batch' "
                                          r"returned None"):
        pset.call("post_process_batch", "dropping", ctx=None, batch=Batch(meta={"rollouts": []}))


def test_the_core_probe_is_no_plugin_nor_a_wrapper_anyone_sees():
    pset = PluginSet.load(extra=[("stage", Stage()), ("passes", Passes())], disable=["instant"])
    assert [name for name, _ in pset.pipeline("post_process_batch")] == ["stage"]
    assert pset.wrappers_of("post_process_batch") == ["passes"]
    assert "agl_core.inner_results" not in pset.plugins


def test_make_recipe_refuses_a_plugin_object_with_the_reason(make_recipe):
    class NoApi:
        @hookimpl
        def log_metrics(self, metrics, step):
            pass

    with pytest.raises(ConfigError, match=r"plugin 'noapi' \(NoApi object\) was refused: .*declares no "
                                          r"AGL_HOOK_API; set AGL_HOOK_API = '1\.\d+'"):
        make_recipe(plugins=[("noapi", NoApi())])
