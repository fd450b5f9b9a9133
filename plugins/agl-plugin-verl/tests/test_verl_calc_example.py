"""examples/calc_verl without a GPU: the agent's tool and parsing, and that both recipes load, plan and translate."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from agl_core.components import Components
from agl_core.config import load
from agl_core.wiring import plan

from agl_plugin_verl.config import build_verl_config

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "calc_verl"


@pytest.fixture(scope="module")
def calc():
    spec = importlib.util.spec_from_file_location("calc_verl_agent", EXAMPLE / "agent.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_calculator_evaluates_arithmetic_only(calc):
    assert calc.calculate("(876 - 12) * 26 / 4 + 2 ** 3") == (876 - 12) * 26 / 4 + 8
    assert calc.calculate("-3^2") == -9.0
    for bad in ("__import__('os')", "open('x')", "2 ** 1000", "1 / 0", "x + 1"):
        with pytest.raises(ValueError):
            calc.calculate(bad)


def test_model_messages_become_answers_or_calculator_feedback(calc):
    assert calc.reply("so <answer>22,803</answer>") == ("22,803", None)
    assert calc.reply("<calc>876*26+27</calc>") == (None, "<result>22803</result>")
    assert calc.reply("<calc>1/0</calc>")[1].startswith("<result>error:")
    assert calc.reply("I think it is 5")[1].startswith("Use <calc>")
    assert calc.correct("22,803", 22803.0) and calc.correct("0.1", 0.1000000001) and not calc.correct("12", 13.0)


@pytest.mark.parametrize("recipe", ["recipe.yaml", "recipe_lora.yaml"])
def test_recipe_loads_plans_and_translates(recipe, tmp_path):
    config, plugins = load(str(EXAMPLE / recipe), [f"trainer.run_dir={tmp_path}"])
    slots = plan(config, plugins, Components.collect(plugins), validates=True).slots
    assert {hook: owner for hook, (owner, _) in slots.items() if owner == "verl"}.keys() >= {
        "policy_endpoints", "compute_old_logprob", "update_actor"}
    verl = build_verl_config(config, config.plugin_config["verl"])
    assert config.rollout.model == verl.actor_rollout_ref.model.path  # the name vLLM serves the model under
    assert verl.algorithm.adv_estimator == "grpo" and verl.actor_rollout_ref.rollout.n == config.rollout.n
    lora = recipe == "recipe_lora.yaml"
    assert (verl.actor_rollout_ref.model.lora_rank > 0) == lora
    assert ("compute_ref_logprob" in slots) == lora
    if lora:  # the lora section, translated; the reference is the actor without its adapter
        assert verl.actor_rollout_ref.model.lora_alpha == 32 and slots["compute_ref_logprob"][0] == "lora"
