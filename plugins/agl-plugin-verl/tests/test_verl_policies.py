"""Several policies on verl: refused at start-up, before Ray or any worker starts, naming verl's one-adapter limit."""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_core.components import Components
from agl_core.config import load
from agl_core.context import TrainContext
from agl_core.plugins import PluginError
from agl_core.wiring import plan

from agl_plugin_verl import plugin as verl_plugin

pytest.importorskip("agl_plugin_lora")

from agl_plugin_lora.plugin import plugin as lora_hooks  # noqa: E402

CPU = ["plugins.verl.trainer.device=cpu", "plugins.verl.trainer.n_gpus_per_node=1"]


def context(*overrides):
    recipe, plugins = load(None, [*CPU, *overrides], plugin_flags=["verl", "lora"])
    components = Components.collect(plugins)
    return TrainContext(recipe, plugins, components, Path("unused"),
                        slots=plan(recipe, plugins, components, validates=False).slots)


@pytest.mark.parametrize("overrides, says", [
    (["policies.hinter.adapter.rank=4", "policies.guesser.adapter.rank=4"],
     r"2 trainable adapters \(hinter, guesser\), but verl trains and serves one LoRA adapter .*max_loras=1"),
    (["policies.hinter.adapter.rank=4", "policies.judge.base=true"],
     r"2 policies \(hinter, judge\), but verl serves one LoRA adapter to every call \(max_loras=1\)"),
])
def test_several_policies_are_refused_on_verl_before_ray_starts(overrides, says, monkeypatch):
    ctx = context(*overrides)
    monkeypatch.setattr(verl_plugin, "_start_ray", lambda cfg: pytest.fail("Ray started before the refusal"))
    with pytest.raises(PluginError, match=says):
        verl_plugin.on_train_start(ctx)
    with pytest.raises(PluginError, match=says):  # the lora plugin's start-up check on verl says the same
        lora_hooks.on_train_start(ctx)


def test_one_policy_is_refused_naming_plugins_lora_and_no_section_passes():
    with pytest.raises(PluginError, match=r"1 policy \(solver\).*drop the policies section for one LoRA policy"):
        verl_plugin.check_policies(context("policies.solver.adapter.rank=4"))
    verl_plugin.check_policies(context())
