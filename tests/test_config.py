"""Recipes: YAML + dotlist overrides, validation messages, plugin sections, `agl config show`."""

import subprocess
import sys

import pytest
import yaml
from pydantic import BaseModel, ConfigDict

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import ConfigError, load, read_recipe, resolved, validate_recipe

RECIPE = """
algorithm:
  estimator: grpo
trainer:
  total_steps: 10
plugins:
  instant: {lr: 0.5}
"""


@pytest.fixture
def recipe_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text(RECIPE)
    return path


def test_overrides_apply_on_top_of_the_file(recipe_file):
    data = read_recipe(recipe_file, ["algorithm.estimator=rloo", "trainer.total_steps=50"])
    recipe = validate_recipe(data)
    assert recipe.algorithm.estimator == "rloo" and recipe.trainer.total_steps == 50
    assert recipe.plugins.enable == ["instant"]
    assert recipe.algorithm.policy_loss.clip_ratio == 0.2  # default filled in


def test_unknown_key_prints_full_path_and_allowed_keys():
    with pytest.raises(ConfigError) as err:
        validate_recipe({"algorithm": {"policy_loss": {"clip_ration": 0.1}}})
    message = str(err.value)
    assert "algorithm.policy_loss.clip_ration: unknown key" in message
    assert "allowed keys: name, clip_ratio, clip_ratio_low" in message


def test_unknown_section_lists_the_sections():
    with pytest.raises(ConfigError, match=r"trainerr: unknown key \(allowed keys: data, algorithm, trainer, rollout, plugins, policies\)"):
        validate_recipe({"trainerr": {}})


def test_wrong_type_and_bad_choice_name_key_and_allowed_values():
    with pytest.raises(ConfigError) as err:
        validate_recipe({"trainer": {"total_steps": "many"},
                         "algorithm": {"policy_loss": {"loss_agg_mode": "mean"}}})
    message = str(err.value)
    assert "trainer.total_steps: Input should be a valid integer" in message and "'many'" in message
    assert "algorithm.policy_loss.loss_agg_mode: Input should be 'token-mean', 'seq-mean-token-sum'" in message


def test_a_temperature_that_would_overflow_the_logits_is_refused_and_greedy_is_not():
    with pytest.raises(ConfigError, match=r"rollout.sampling.temperature: must be 0 \(greedy\) or from 0.01 to 100 "
                                          r"\(got 0.005\)"):
        validate_recipe({"rollout": {"sampling": {"temperature": 0.005}}})
    # The recipe's bounds are the request's: a larger one would fail every call the gateway adds it to.
    with pytest.raises(ConfigError, match=r"rollout.sampling.temperature: must be 0 \(greedy\) or from 0.01 to 100"):
        validate_recipe({"rollout": {"sampling": {"temperature": 150}}})
    assert validate_recipe({"rollout": {"sampling": {"temperature": 0}}}).rollout.sampling.temperature == 0


def test_bad_override_and_bad_yaml_name_the_culprit(tmp_path):
    with pytest.raises(ConfigError, match="override 'trainer.total_steps' is not of the form key=value"):
        read_recipe(None, ["trainer.total_steps"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match=f"recipe file {bad} is not valid YAML"):
        read_recipe(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        read_recipe(tmp_path / "missing.yaml")


def test_slots_and_order_must_name_hooks_of_the_right_kind():
    with pytest.raises(ConfigError, match="plugins.slots.log_metrics: not a slot hook"):
        validate_recipe({"plugins": {"slots": {"log_metrics": "console"}}})
    with pytest.raises(ConfigError, match="plugins.order.advantage: not a pipeline hook"):
        validate_recipe({"plugins": {"order": {"advantage": ["a"]}}})


def test_plugins_list_shorthand():
    recipe = validate_recipe({"plugins": ["instant"]})
    assert recipe.plugins.enable == ["instant"] and recipe.plugins.sections == {}


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rank: int = 8
    alpha: float = 16.0


class WithSettings:
    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def plugin_config_schema(self):
        return Settings


def test_plugin_section_is_validated_by_the_plugin_schema():
    recipe, _ = load(None, ["plugins.lora.rank=4"], extra_plugins=[("lora", WithSettings())])
    assert recipe.plugin_config["lora"] == Settings(rank=4)
    with pytest.raises(ConfigError, match=r"plugins.lora.rnak: unknown key \(allowed keys: rank, alpha\)"):
        load(None, ["plugins.lora.rnak=4"], extra_plugins=[("lora", WithSettings())])
    with pytest.raises(ConfigError, match=r"plugins.lora.rank: Input should be a valid integer"):
        load(None, ["plugins.lora.rank=big"], extra_plugins=[("lora", WithSettings())])


def test_section_for_a_plugin_without_settings_is_refused():
    with pytest.raises(ConfigError, match="plugins.console: plugin 'console' takes no settings"):
        load(None, ["plugins.console.color=true"])


def test_section_for_an_uninstalled_plugin_is_refused():
    with pytest.raises(ConfigError, match="plugin 'nosuch' is enabled but not installed"):
        load(None, ["plugins.nosuch.x=1"])


def test_plugin_flags_enable_and_disable():
    recipe, plugins = load(None, [], ["instant", "no:console"])
    assert plugins.plugins["instant"].status == "active"
    assert plugins.plugins["console"].status == "disabled"
    assert recipe.plugins.disable == ["console"]


def test_resolved_config_has_every_default(recipe_file):
    recipe, _ = load(recipe_file, ["trainer.total_steps=3"])
    out = resolved(recipe)
    assert out["trainer"]["total_steps"] == 3
    assert out["plugins"]["instant"]["lr"] == 0.5
    assert out["plugins"]["instant"]["vocab_size"] == 8  # the plugin's default
    assert out["algorithm"]["kl_ctrl"]["type"] == "fixed"
    assert validate_recipe(out).trainer.total_steps == 3  # the dump is itself a valid recipe


def test_cli_config_show(recipe_file):
    out = subprocess.run([sys.executable, "-m", "agl_core.cli", "config", "show", str(recipe_file),
                          "algorithm.estimator=rloo"], capture_output=True, text=True, check=True).stdout
    shown = yaml.safe_load(out)
    assert shown["algorithm"]["estimator"] == "rloo"
    assert shown["data"]["max_prompt_length"] == 512
    bad = subprocess.run([sys.executable, "-m", "agl_core.cli", "config", "show", str(recipe_file),
                          "algorithm.estimatr=rloo"], capture_output=True, text=True)
    assert bad.returncode == 2
    assert "algorithm.estimatr: unknown key" in bad.stderr
