"""Plugin discovery, activation, isolation and validation, with real distributions.

Each third-party plugin here is a real distribution: a module and a
``.dist-info`` with entry points on ``sys.path`` (the ``plugin_distribution``
fixture of agl_core.testing), found through importlib-metadata.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from agl_core import HOOK_API_VERSION
from agl_core.components import Components
from agl_core.plugins import PluginError, PluginSet, parse_plugin_flags
from agl_core.testing import check_plugin

GOOD = f"""
from agl_core import hookimpl
AGL_HOOK_API = "{HOOK_API_VERSION}"

@hookimpl
def log_metrics(ctx, metrics, step):
    pass

@hookimpl
def register_estimators(register):
    register("my_estimator", lambda batch, config: (None, None))
"""

BUILTINS = {"estimators", "console", "jsonl", "validation"}


def test_builtins_are_discovered_through_entry_points_and_active():
    pset = PluginSet.load()
    for name in BUILTINS:
        plugin = pset.plugins[name]
        assert plugin.distribution == "agl-core" and plugin.builtin
        assert plugin.status == "active"
    assert "advantage" in pset.plugins["estimators"].hooks


def test_third_party_plugin_is_available_until_enabled(plugin_distribution):
    plugin_distribution("agl-plugin-good", {"good_plugin": GOOD}, {"good": "good_plugin"}, version="2.3.4")
    pset = PluginSet.load()
    good = pset.plugins["good"]
    assert (good.distribution, good.version, good.status) == ("agl-plugin-good", "2.3.4", "available")
    assert good.hooks == ["log_metrics", "register_estimators"]
    assert "good" not in [n for n, _ in pset.implementations("log_metrics")]

    pset = PluginSet.load(enable=["good"])
    assert pset.plugins["good"].status == "active"
    assert "good" in [n for n, _ in pset.implementations("log_metrics")]
    assert "my_estimator" in Components.collect(pset).names("estimator")


def test_builtin_can_be_disabled():
    pset = PluginSet.load(disable=["console"])
    assert pset.plugins["console"].status == "disabled"
    assert "console" not in [n for n, _ in pset.implementations("log_metrics")]


def test_enabling_a_missing_plugin_names_the_installed_ones():
    with pytest.raises(PluginError, match=r"'nope' is enabled but not installed.*estimators"):
        PluginSet.load(enable=["nope"])


def test_import_failure_is_recorded_and_fatal_only_when_enabled(plugin_distribution):
    plugin_distribution("agl-plugin-broken", {"broken_plugin": "import does_not_exist_anywhere\n"},
                        {"broken": "broken_plugin"}, version="0.0.1")
    pset = PluginSet.load()  # not enabled: recorded, not fatal
    broken = pset.plugins["broken"]
    assert broken.status == "failed"
    assert "ModuleNotFoundError" in broken.reason and "does_not_exist_anywhere" in broken.reason
    with pytest.raises(PluginError, match=r"broken \(agl-plugin-broken 0.0.1\) is enabled but failed"):
        PluginSet.load(enable=["broken"])


@pytest.mark.parametrize("source, message", [
    ("@hookimpl\ndef not_a_hook(ctx):\n    pass\n", r"unknown hook 'not_a_hook'"),
    ("@hookimpl\ndef log_metrics(ctx, metrics, stepp):\n    pass\n",
     r"hook 'log_metrics' has unknown argument\(s\) stepp; the hook takes ctx, metrics, step"),
    ("@hookimpl\nasync def log_metrics(ctx, metrics, step):\n    pass\n",
     r"hook 'log_metrics' is async but the hook is synchronous"),
])
def test_invalid_hook_implementations_are_refused_naming_the_distribution(plugin_distribution, source, message):
    module = f"from agl_core import hookimpl\nAGL_HOOK_API = '{HOOK_API_VERSION}'\n" + source
    plugin_distribution("agl-plugin-bad", {"bad_plugin": module}, {"bad": "bad_plugin"}, version="9.9")
    bad = PluginSet.load().plugins["bad"]
    assert bad.status == "failed"
    assert "bad (agl-plugin-bad 9.9)" in bad.reason
    assert re.search(message, bad.reason), bad.reason


def test_hook_api_mismatch_is_refused_with_both_versions(plugin_distribution):
    plugin_distribution("agl-plugin-future", {"future_plugin": "AGL_HOOK_API = '2.0'\n"},
                        {"future": "future_plugin"}, version="1.0")
    with pytest.raises(PluginError) as err:
        PluginSet.load(enable=["future"])
    assert "written for agl_core hook API 2.0" in str(err.value)
    assert f"provides hook API {HOOK_API_VERSION}" in str(err.value)


def test_newer_minor_api_is_refused_and_missing_declaration_explained():
    class Newer:
        AGL_HOOK_API = HOOK_API_VERSION.split(".")[0] + ".99"

    with pytest.raises(PluginError, match=r"hook API 1\.99.*provides hook API"):
        check_plugin(Newer())
    with pytest.raises(PluginError, match="declares no AGL_HOOK_API"):
        check_plugin(object())


def test_autoload_disabled_does_not_import_unrequested_plugins(plugin_distribution, tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    source = f"open({str(marker)!r}, 'w').close()\nAGL_HOOK_API = '{HOOK_API_VERSION}'\n"
    plugin_distribution("agl-plugin-side", {"side_plugin": source}, {"side": "side_plugin"})
    monkeypatch.setenv("AGL_DISABLE_PLUGIN_AUTOLOAD", "1")
    pset = PluginSet.load()
    assert not marker.exists()
    assert pset.plugins["side"].status == "available"
    assert "AGL_DISABLE_PLUGIN_AUTOLOAD" in pset.plugins["side"].reason
    assert pset.plugins["estimators"].status == "active"  # built-ins still load
    pset = PluginSet.load(enable=["side"])  # -p side still loads it
    assert marker.exists() and pset.plugins["side"].status == "active"


def test_plugin_flags_parse_like_pytest():
    assert parse_plugin_flags(["a", "no:b", "c"]) == (["a", "c"], ["b"])


def _impl(hook, result=None):
    """A plugin object implementing one hook."""
    from agl_core import hookimpl

    def fn(ctx=None, batch=None):
        return result if result is not None else batch

    fn.__name__ = hook
    ns = type("P", (), {"AGL_HOOK_API": HOOK_API_VERSION, hook: staticmethod(hookimpl(fn))})
    return ns()


def test_slot_resolution_prefers_the_single_third_party_candidate():
    pset = PluginSet.load(extra=[("mine", _impl("advantage"))])
    assert pset.resolve_slot("advantage")[0] == "mine"
    assert PluginSet.load().resolve_slot("advantage")[0] == "estimators"


def test_ambiguous_slot_lists_candidates_and_recipe_choice_settles_it():
    pset = PluginSet.load(extra=[("a", _impl("update_actor")), ("b", _impl("update_actor"))])
    with pytest.raises(PluginError, match=r"slot 'update_actor' is filled by several plugins: a, b; "
                                          r"choose one with plugins.slots.update_actor=<name>"):
        pset.resolve_slot("update_actor")
    assert pset.resolve_slot("update_actor", choice="b")[0] == "b"
    with pytest.raises(PluginError, match=r"names 'c', which does not implement it; candidates: a, b"):
        pset.resolve_slot("update_actor", choice="c")


def test_empty_slot_is_an_error_naming_installed_providers():
    with pytest.raises(PluginError, match=r"no active plugin fills the slot 'compute_values'"):
        PluginSet.load(disable=["instant"]).resolve_slot("compute_values")
    assert PluginSet.load(disable=["instant"]).resolve_slot("compute_values", required=False) is None


def test_pipeline_order_declared_then_explicit():
    first, second = _impl("post_process_batch"), _impl("post_process_batch")
    first.AGL_ORDER, second.AGL_ORDER = 50, 10
    pset = PluginSet.load(extra=[("first", first), ("second", second)], disable=["instant"])
    assert [n for n, _ in pset.pipeline("post_process_batch")] == ["second", "first"]
    assert [n for n, _ in pset.pipeline("post_process_batch", ["first", "second"])] == ["first", "second"]
    with pytest.raises(PluginError, match="list each exactly once"):
        pset.pipeline("post_process_batch", ["first"])


def test_duplicate_component_names_are_refused_naming_both_plugins():
    from agl_core import hookimpl

    class Dup:
        AGL_HOOK_API = HOOK_API_VERSION

        @hookimpl
        def register_estimators(self, register):
            register("grpo", lambda batch, config: None)

    pset = PluginSet.load(extra=[("dup", Dup())])
    with pytest.raises(PluginError, match=r"estimator 'grpo' is registered by both plugin 'estimators' and plugin 'dup'"):
        Components.collect(pset)


def test_cli_lists_plugins_even_with_a_broken_one(plugin_distribution):
    root = plugin_distribution("agl-plugin-broken", {"broken_plugin": "raise RuntimeError('boom')\n"},
                               {"broken": "broken_plugin"}, version="0.1")
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-m", "agl_core.cli", "plugins", "--json"], env=env,
                         capture_output=True, text=True, check=True)
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["broken"]["status"] == "failed" and "RuntimeError: boom" in rows["broken"]["reason"]
    assert rows["estimators"]["status"] == "active"
    out = subprocess.run([sys.executable, "-m", "agl_core.cli", "plugins", "--json", "--hook", "advantage"],
                         env=env, capture_output=True, text=True, check=True)
    assert [row["name"] for row in json.loads(out.stdout)] == ["estimators"]
    table = subprocess.run([sys.executable, "-m", "agl_core.cli", "plugins"], env=env,
                           capture_output=True, text=True, check=True).stdout
    assert "broken" in table and "failed" in table


OWN_DISTRIBUTIONS = {"agl-core", "agl-plugin-instant", "agl-plugin-lora", "agl-plugin-ray", "agl-plugin-sqlite",
                     "agl-plugin-torch", "agl-plugin-traces", "agl-plugin-verl"}


def test_importing_the_plugins_of_this_repository_imports_no_heavy_module():
    """`agl plugins` imports every plugin: torch, transformers, verl, ray, … wait until a hook needs them.

    One fresh interpreter imports each plugin of agl-core and plugins/ in turn
    and notes the heavy modules each one pulled in first (other installed
    distributions are left out: they are not this repository's to keep light).
    """
    probe = f"""
import json, sys
from agl_core.plugins import discover, distribution_of
heavy = ("torch", "tensordict", "transformers", "verl", "ray", "peft")
pulled = {{}}
for ep in discover():
    if distribution_of(ep)[0] not in {sorted(OWN_DISTRIBUTIONS)!r}:
        continue
    before = {{m for m in heavy if m in sys.modules}}
    ep.load()
    pulled.update({{m: ep.name for m in heavy if m in sys.modules and m not in before}})
print(json.dumps(pulled))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {}
