"""The plugin on the verl backend: it finds the run's backend itself and needs no agl-plugin-torch there.

The translation of the keys, the refusals, the reference slot and a real
run on verl's CPU workers are tested with agl-plugin-verl
(``plugins/agl-plugin-verl/tests/test_verl_lora_*.py``).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from agl_core.plugins import PluginError

from agl_plugin_lora.plugin import backend_name, plugin


def ctx_with(update_actor=None, active=()):
    slots = {} if update_actor is None else {"update_actor": (update_actor, None)}
    return SimpleNamespace(slots=slots, plugins=SimpleNamespace(
        active=lambda: [SimpleNamespace(name=name) for name in active]))


def test_the_backend_is_the_plugin_that_updates_the_actor():
    assert backend_name(ctx_with("verl", active=["verl", "torch"])) == "verl"
    assert backend_name(ctx_with("torch", active=["verl", "torch"])) == "torch"
    assert backend_name(ctx_with(None, active=["verl", "lora"])) == "verl"  # before the slots are resolved


def test_without_a_backend_the_plugin_says_which_it_supports():
    with pytest.raises(PluginError, match=r"one of torch, verl; the actor is updated by 'mine'.*"
                                          r"plugins: \[torch, lora\] or \[verl, lora\]"):
        backend_name(ctx_with("mine", active=["mine", "lora"]))


def test_a_verl_checkpoint_is_neither_refused_nor_exported_as_an_embedded_one(tmp_path):
    actor = tmp_path / "verl" / "actor"  # verl's checkpoint managers write the adapted actor's state dict here
    actor.mkdir(parents=True)
    (actor / "model_world_size_2_rank_0.pt").write_bytes(b"")
    plugin.load_checkpoint(ctx=None, path=str(tmp_path))
    assert plugin.export_model(path=str(tmp_path), out=str(tmp_path / "out"), merged=True, policy=None) is None


def test_on_verl_the_plugin_runs_without_agl_plugin_torch():
    pytest.importorskip("agl_plugin_verl")
    # A fresh interpreter in which agl_plugin_torch cannot be imported: load a verl + lora recipe, resolve
    # its slots and run the lora plugin's start-up check.
    script = textwrap.dedent("""
        import sys
        sys.modules["agl_plugin_torch"] = None  # any import of it fails
        from pathlib import Path
        from agl_core.components import Components
        from agl_core.config import load
        from agl_core.context import TrainContext
        from agl_core.wiring import plan
        overrides = ["algorithm.policy_loss.use_kl_loss=true", "plugins.slots.compute_ref_logprob=lora",
                     "plugins.verl.trainer.device=cpu", "plugins.lora.rank=4"]
        recipe, plugins = load(None, overrides, plugin_flags=["verl"])
        assert plugins.plugins["lora"].status == "active", plugins.plugins["lora"].reason
        components = Components.collect(plugins)
        slots = plan(recipe, plugins, components, validates=False).slots
        ctx = TrainContext(recipe, plugins, components, Path("unused"), slots=slots)
        from agl_plugin_lora.plugin import backend_name, plugin
        assert backend_name(ctx) == "verl"
        plugin.on_train_start(ctx)
        print("ok", slots["compute_ref_logprob"][0])
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["ok", "lora"]
