"""LoRA on verl from agl-plugin-lora's recipe keys: each key translated or refused, the reference slot, the layout.

The recipe section ``plugins.lora`` is the one the embedded backend reads;
on verl it becomes verl's FSDP LoRA options. These tests load recipes the
way ``agl train`` does (the lora plugin active, its section validated), so
the plugin's defaults are what verl gets.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.components import Components
from agl_core.config import ConfigError, load
from agl_core.context import TrainContext
from agl_core.plugins import PluginError
from agl_core.wiring import plan

from agl_plugin_verl import plugin as verl_plugin
from agl_plugin_verl.config import LORA_REFUSED, TRANSLATION, build_verl_config, translate
from agl_plugin_verl.workers import Layout, layout

pytest.importorskip("agl_plugin_lora")

from agl_plugin_lora.plugin import backend_name, plugin as lora_hooks  # noqa: E402
from agl_plugin_lora.settings import LoraSettings  # noqa: E402

KL = "algorithm.policy_loss.use_kl_loss=true"
CPU = ["plugins.verl.trainer.device=cpu", "plugins.verl.trainer.n_gpus_per_node=1"]


def lora_recipe(*overrides, plugin_flags=("lora",)):
    """A recipe loaded with plugin ``lora`` active (and ``verl``), its section validated with defaults."""
    recipe, plugins = load(None, list(overrides), plugin_flags=["verl", *plugin_flags])
    return recipe, plugins


def verl_lora_config(*overrides, **section):
    recipe, _ = lora_recipe(*overrides)
    return build_verl_config(recipe, section)


LORA_ROWS = {row.agl_key.removeprefix("plugins.lora."): row for row in TRANSLATION
             if row.agl_key.startswith("plugins.lora.")}


def test_every_lora_setting_is_translated_or_refused_on_verl():
    # A new key of plugins.lora must be given a verl row or a refusal: none is silently ignored on verl.
    assert set(LoraSettings.model_fields) <= set(LORA_ROWS) | set(LORA_REFUSED)
    assert set(LORA_ROWS) == {"rank", "alpha", "target_modules"}


@pytest.mark.parametrize("overrides, verl_key, expected", [
    (["plugins.lora.rank=16"], "lora_rank", 16),
    (["plugins.lora.alpha=64"], "lora_alpha", 64),
    (["plugins.lora.alpha=32.0"], "lora_alpha", 32),
    (["plugins.lora.target_modules=[q_proj,v_proj]"], "target_modules", ["q_proj", "v_proj"]),
    (["plugins.lora.target_modules=all-linear"], "target_modules", "all-linear"),
])
def test_each_lora_key_reaches_verls_lora_option(overrides, verl_key, expected):
    cfg = verl_lora_config(*overrides)
    value = cfg.actor_rollout_ref.model[verl_key]
    assert (list(value) if verl_key == "target_modules" and not isinstance(value, str) else value) == expected
    if verl_key == "lora_alpha":
        assert type(value) is int  # verl's lora_alpha is an integer


def test_the_lora_plugins_defaults_reach_verl():
    # plugins: [verl, lora] with no lora keys is rank 8, not verl's rank 0 (which would train in full).
    recipe, _ = lora_recipe()
    defaults = LoraSettings()
    model = build_verl_config(recipe, {}).actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (defaults.rank, 16, "all-linear")
    assert {verl_key for verl_key, (_, agl_key) in translate(recipe).items() if agl_key.startswith("plugins.lora")} \
        == {"actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora_alpha",
            "actor_rollout_ref.model.target_modules"}


def test_zero_dropout_and_no_modules_to_save_are_what_verl_does():
    cfg = verl_lora_config("plugins.lora.dropout=0.0", "plugins.lora.modules_to_save=[]")
    assert cfg.actor_rollout_ref.model.lora_rank == 8


@pytest.mark.parametrize("override, key", [
    ("plugins.lora.dropout=0.05", r"plugins.lora.dropout=0.05: verl's FSDP engine builds its peft LoraConfig "
                                  r"without lora_dropout"),
    ("plugins.lora.modules_to_save=[norm]", r"plugins.lora.modules_to_save=\['norm'\]: .*without modules_to_save"),
    ("plugins.lora.alpha=12.5", r"plugins.lora.alpha=12.5: verl's lora_alpha is an integer"),
])
def test_lora_keys_verl_cannot_honour_are_refused_naming_key_and_backend(override, key):
    with pytest.raises(ConfigError, match=r"the verl backend \(plugin 'verl', verl [\d.]+\) cannot honour these "
                                          r"LoRA settings of plugin 'lora':\n  " + key):
        verl_lora_config(override)


def test_every_refusal_is_reported_at_once():
    with pytest.raises(ConfigError) as error:
        verl_lora_config("plugins.lora.dropout=0.1", "plugins.lora.modules_to_save=[lm_head]")
    assert "plugins.lora.dropout=0.1" in str(error.value) and "plugins.lora.modules_to_save" in str(error.value)


def test_lora_on_an_engine_the_translation_does_not_reach_is_refused():
    with pytest.raises(ConfigError, match=r"plugins.lora with actor_rollout_ref.actor.strategy=megatron: .*"
                                          r"which only verl's FSDP engine reads"):
        verl_lora_config(**{"actor_rollout_ref.actor.strategy": "megatron"})


def test_verls_own_lora_keys_next_to_the_lora_plugin_are_set_twice():
    with pytest.raises(ConfigError, match=r"plugins.verl.actor_rollout_ref.model.lora_rank is set by agl_core's "
                                          r"plugins.lora.rank"):
        verl_lora_config(**{"actor_rollout_ref.model.lora_rank": 4})


# ----------------------------------------------------------------------------- the reference slot


class RefModel:
    """A plugin that fills the reference slot its own way (a separate reference model)."""

    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        raise AssertionError("not called in these tests")


def context(*overrides, extra=()):
    recipe, plugins = load(None, [*CPU, *overrides], plugin_flags=["verl", "lora"],
                           extra_plugins=list(extra))
    components = Components.collect(plugins)
    return TrainContext(recipe, plugins, components, Path("unused"),
                        slots=plan(recipe, plugins, components, validates=False).slots)


def test_with_a_kl_term_the_recipe_must_choose_between_verl_and_lora():
    with pytest.raises(PluginError, match=r"the slot 'compute_ref_logprob' is filled by several plugins: "
                                          r".*(verl, lora|lora, verl).*plugins.slots.compute_ref_logprob"):
        context(KL)


def test_lora_fills_the_slot_and_verl_builds_no_reference_model():
    ctx = context(KL, "plugins.slots.compute_ref_logprob=lora")
    assert ctx.slots["compute_ref_logprob"][0] == "lora"
    assert ctx.slots["update_actor"][0] == "verl"
    assert backend_name(ctx) == "verl"
    verl_plugin.check_lora_reference(ctx)
    lora_hooks.on_train_start(ctx)  # the start-up check passes
    cfg = build_verl_config(ctx.config, ctx.plugin_config("verl"))
    needs_ref = verl_plugin._owns(ctx, "compute_ref_logprob")  # what on_train_start hands workers.build
    assert not needs_ref
    assert layout(cfg, needs_ref, needs_critic=False) == Layout("actor", None, True, False)
    gpu = build_verl_config(ctx.config, {})
    assert layout(gpu, needs_ref, needs_critic=False) == Layout("actor_rollout", None, True, False)


def test_a_separate_reference_on_verl_with_lora_is_refused_naming_both(monkeypatch):
    ctx = context(KL, "plugins.slots.compute_ref_logprob=verl")
    message = (r"plugins.slots.compute_ref_logprob=verl asks for a separate reference model, but LoRA is active "
               r"\(plugin 'lora'\) and verl takes the reference from the actor with its adapter disabled.*"
               r"set plugins.slots.compute_ref_logprob=lora")
    # The lora plugin's start-up check and the verl plugin's, which runs before any worker or Ray starts.
    with pytest.raises(PluginError, match=message):
        lora_hooks.on_train_start(ctx)
    monkeypatch.setattr(verl_plugin, "_start_ray", lambda cfg: pytest.fail("Ray started before the refusal"))
    with pytest.raises(PluginError, match=message):
        verl_plugin.on_train_start(ctx)


def test_verl_keeps_its_reference_slot_for_verls_own_lora_keys():
    # Without plugin lora, LoRA set with verl's keys is verl's own concern: verl fills the slot (ref_in_actor).
    recipe, plugins = load(None, [KL, *CPU, "plugins.verl.actor_rollout_ref.model.lora_rank=8"], plugin_flags=["verl"])
    components = Components.collect(plugins)
    ctx = TrainContext(recipe, plugins, components, Path("unused"),
                       slots=plan(recipe, plugins, components, validates=False).slots)
    assert ctx.slots["compute_ref_logprob"][0] == "verl"
    verl_plugin.check_lora_reference(ctx)


def test_another_reference_plugin_chosen_by_the_recipe_is_allowed_with_a_warning(caplog):
    ctx = context(KL, "plugins.slots.compute_ref_logprob=ref_model", extra=[("ref_model", RefModel())])
    with caplog.at_level(logging.WARNING, logger="agl_plugin_lora"):
        lora_hooks.on_train_start(ctx)
    assert "separate copy of the weights" in caplog.text
    assert not verl_plugin._owns(ctx, "compute_ref_logprob")


def test_without_a_kl_term_there_is_no_reference_slot():
    ctx = context()
    assert "compute_ref_logprob" not in ctx.slots
    lora_hooks.on_train_start(ctx)
    verl_plugin.check_lora_reference(ctx)


def test_the_rollout_servers_serve_the_trained_adapter_merged():
    """verl's vLLM routes apply an unmerged adapter only to calls that name it; agents' calls name rollout.model, so
    the adapter is merged into the synced weights (model.lora.merge), and no recipe can turn that off."""
    from agl_plugin_verl.rollout import sleep_keeps_weights

    cfg = verl_lora_config()
    assert cfg.actor_rollout_ref.model.lora.merge is True
    assert not sleep_keeps_weights(cfg)  # merged: a full model's weights, discarded asleep and synced at each wake
    recipe, _ = lora_recipe()
    with pytest.raises(ConfigError, match="lora.merge"):
        build_verl_config(recipe, {"actor_rollout_ref": {"model": {"lora": {"merge": False}}}})
    plain, _ = load(None, [], plugin_flags=["verl"])
    assert build_verl_config(plain, {}).actor_rollout_ref.model.lora.merge is False  # no adapter: verl's default
