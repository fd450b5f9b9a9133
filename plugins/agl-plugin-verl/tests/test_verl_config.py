"""verl's config for a run: one test per translated key, conflicts, verl's own keys, the plugin's defaults."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from packaging.version import Version

from agl_core.config import ConfigError, read_recipe, validate_recipe

from agl_plugin_verl.config import (CPU_DEFAULTS, DEFAULTS, TRANSLATION, VerlSection, build_verl_config,
                                    check_overrides, required_settings, translate, verl_defaults)

# agl_core key → (recipe overrides that set it to a value unlike either default, the verl value expected)
CASES = {
    "algorithm.estimator": (["algorithm.estimator=reinforce++-baseline"], "reinforce_plus_plus_baseline"),
    "algorithm.gamma": (["algorithm.gamma=0.95"], 0.95),
    "algorithm.lam": (["algorithm.lam=0.9"], 0.9),
    "algorithm.norm_adv_by_std_in_grpo": (["algorithm.norm_adv_by_std_in_grpo=false"], False),
    "algorithm.use_kl_in_reward": (["algorithm.use_kl_in_reward=true"], True),
    "algorithm.kl_penalty": (["algorithm.kl_penalty=low_var_kl"], "low_var_kl"),
    "algorithm.kl_ctrl.type": (["algorithm.kl_ctrl.type=adaptive"], "adaptive"),
    "algorithm.kl_ctrl.kl_coef": (["algorithm.kl_ctrl.kl_coef=0.05"], 0.05),
    "algorithm.kl_ctrl.target_kl": (["algorithm.kl_ctrl.target_kl=0.3"], 0.3),
    "algorithm.kl_ctrl.horizon": (["algorithm.kl_ctrl.horizon=500"], 500),
    "algorithm.policy_loss.name": (["algorithm.policy_loss.name=gspo"], "gspo"),
    "algorithm.policy_loss.clip_ratio": (["algorithm.policy_loss.clip_ratio=0.28"], 0.28),
    "algorithm.policy_loss.clip_ratio_low": (["algorithm.policy_loss.clip_ratio_low=0.1"], 0.1),
    "algorithm.policy_loss.clip_ratio_high": (["algorithm.policy_loss.clip_ratio_high=0.35"], 0.35),
    "algorithm.policy_loss.clip_ratio_c": (["algorithm.policy_loss.clip_ratio_c=5.0"], 5.0),
    "algorithm.policy_loss.loss_agg_mode": (["algorithm.policy_loss.loss_agg_mode=seq-mean-token-mean"],
                                            "seq-mean-token-mean"),
    "algorithm.policy_loss.entropy_coeff": (["algorithm.policy_loss.entropy_coeff=0.02"], 0.02),
    "algorithm.policy_loss.use_kl_loss": (["algorithm.policy_loss.use_kl_loss=true"], True),
    "algorithm.policy_loss.kl_loss_coef": (["algorithm.policy_loss.kl_loss_coef=0.04"], 0.04),
    "algorithm.policy_loss.kl_loss_type": (["algorithm.policy_loss.kl_loss_type=k2"], "k2"),
    # rows → prompts: 64 rows of 8 samples per prompt are 8 prompts
    "algorithm.ppo_mini_batch_size": (["algorithm.ppo_mini_batch_size=64", "rollout.n=8"], 8),
    "algorithm.ppo_epochs": (["algorithm.ppo_epochs=3"], 3),
    "data.train_batch_size": (["data.train_batch_size=48"], 48),
    "data.max_prompt_length": (["data.max_prompt_length=1024"], 1024),
    "data.max_response_length": (["data.max_response_length=2048"], 2048),
    "rollout.n": (["rollout.n=5"], 5),
    "rollout.sampling.temperature": (["rollout.sampling.temperature=0.7"], 0.7),
    "rollout.sampling.top_p": (["rollout.sampling.top_p=0.9"], 0.9),
    "trainer.project_name": (["trainer.project_name=calc"], "calc"),
    "trainer.experiment_name": (["trainer.experiment_name=run7"], "run7"),
    "trainer.critic_warmup": (["trainer.critic_warmup=2"], 2),
    "plugins.lora.rank": (["plugins.lora.rank=16"], 16),
    "plugins.lora.alpha": (["plugins.lora.alpha=64"], 64),
    "plugins.lora.target_modules": (["plugins.lora.target_modules=[q_proj,v_proj]"], ["q_proj", "v_proj"]),
}


def recipe(overrides=()):
    return validate_recipe(read_recipe(None, list(overrides)))


def verl_value(cfg, key):
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def test_every_translated_key_has_a_case():
    assert {row.agl_key for row in TRANSLATION} == set(CASES)


@pytest.mark.parametrize("row", TRANSLATION, ids=lambda row: row.agl_key)
def test_key_is_translated(row):
    overrides, expected = CASES[row.agl_key]
    cfg = build_verl_config(recipe(overrides), {})
    assert verl_value(cfg, row.verl_key) == expected
    default = verl_value(verl_defaults(), row.verl_key)
    assert default != expected  # the case proves the value came from the recipe


@pytest.mark.parametrize("row", TRANSLATION, ids=lambda row: row.verl_key)
def test_setting_a_translated_key_in_plugins_verl_names_both(row):
    with pytest.raises(ConfigError) as err:
        build_verl_config(recipe(CASES[row.agl_key][0]), {row.verl_key: 1})
    assert f"plugins.verl.{row.verl_key}" in str(err.value) and row.agl_key in str(err.value)


def test_a_section_holding_a_translated_key_clashes_too():
    with pytest.raises(ConfigError, match=r"plugins.verl.algorithm.kl_ctrl is set by agl_core's algorithm.kl_ctrl"):
        build_verl_config(recipe(), {"algorithm": {"kl_ctrl": None}})


def test_unset_clip_bounds_follow_clip_ratio():
    cfg = build_verl_config(recipe(["algorithm.policy_loss.clip_ratio=0.3"]), {})
    assert cfg.actor_rollout_ref.actor.clip_ratio_low == cfg.actor_rollout_ref.actor.clip_ratio_high == 0.3


def test_lora_rows_apply_only_with_a_lora_section():
    assert not {key for key in translate(recipe()) if "lora" in key or "target_modules" in key}
    assert "actor_rollout_ref.model.lora_rank" in translate(recipe(["plugins.lora.rank=8"]))


def test_verl_keys_nested_or_dotted_are_applied_key_by_key():
    nested = build_verl_config(recipe(), {"actor_rollout_ref": {"actor": {"optim": {"lr": 3e-6}}},
                                          "trainer.n_gpus_per_node": 4})
    dotted = build_verl_config(recipe(), {"actor_rollout_ref.actor.optim.lr": 3e-6, "trainer": {"n_gpus_per_node": 4}})
    assert nested.actor_rollout_ref.actor.optim.lr == dotted.actor_rollout_ref.actor.optim.lr == 3e-6
    assert nested.trainer.n_gpus_per_node == dotted.trainer.n_gpus_per_node == 4
    assert nested.actor_rollout_ref.actor.optim.betas == [0.9, 0.999]  # siblings keep verl's defaults


def test_unknown_verl_key_is_refused_unless_added_with_plus():
    with pytest.raises(ConfigError, match=r"plugins.verl.actor_rollout_ref.actor.no_such_key: verl [\d.]+ has no"):
        build_verl_config(recipe(), {"actor_rollout_ref.actor.no_such_key": 1})
    cfg = build_verl_config(recipe(), {"+actor_rollout_ref.model.override_config.attn_implementation": "sdpa"})
    assert cfg.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"
    nested = build_verl_config(recipe(), {"actor_rollout_ref": {"model": {"+override_config": {"attn_implementation":
                                                                                              "sdpa"}}}})
    assert nested.actor_rollout_ref.model.override_config.attn_implementation == "sdpa"


def test_interpolations_are_resolved_after_translation():
    cfg = build_verl_config(recipe(["data.max_prompt_length=333", "algorithm.ppo_epochs=4"]), {})
    assert cfg.actor_rollout_ref.rollout.prompt_length == 333  # verl: ${oc.select:data.max_prompt_length,512}
    assert cfg.critic.ppo_epochs == 4  # verl's critic follows the actor's
    assert not OmegaConf.is_missing(cfg.critic.model, "path")


def test_plugin_defaults_apply_and_can_be_set_back():
    cfg = build_verl_config(recipe(), {"actor_rollout_ref.model.path": "/models/m"})
    for key, value in DEFAULTS.items():
        assert OmegaConf.select(cfg, key) == (value if "${" not in str(value) else "/models/m")
    cfg = build_verl_config(recipe(), {"actor_rollout_ref.actor.use_dynamic_bsz": False})
    assert cfg.actor_rollout_ref.actor.use_dynamic_bsz is False


def test_cpu_device_gets_fixed_micro_batches():
    gpu = build_verl_config(recipe(), {})
    cpu = build_verl_config(recipe(), {"trainer.device": "cpu", "critic.fsdp.micro_batch_size_per_gpu": 2})
    assert gpu.actor_rollout_ref.actor.use_dynamic_bsz and "micro_batch_size_per_gpu" not in gpu.critic.fsdp
    for key, value in CPU_DEFAULTS.items():
        expected = 2 if key == "+critic.fsdp.micro_batch_size_per_gpu" else value
        assert OmegaConf.select(cpu, key.lstrip("+")) == expected


def test_verl_0_7_needs_its_engine_worker_switch_which_a_recipe_cannot_unset():
    assert required_settings(Version("0.7.1")) == {"trainer.use_legacy_worker_impl": "disable"}
    assert required_settings(Version("0.9.1")) == {}
    with pytest.raises(ConfigError, match="agl-plugin-verl sets verl key trainer.use_legacy_worker_impl"):
        check_overrides({"trainer.use_legacy_worker_impl": "auto"}, {}, required_settings(Version("0.7.0")))


def test_section_schema_holds_any_verl_mapping():
    section = VerlSection.model_validate({"trainer": {"nnodes": 2}, "actor_rollout_ref.rollout.name": "sglang"})
    assert section.root["trainer"] == {"nnodes": 2}
    assert VerlSection().root == {}


def test_the_critic_takes_the_actors_attention_unless_flash_attn_is_importable(monkeypatch):
    """verl loads a model that names no attention kernel with flash_attention_2, which needs the flash-attn package."""
    import importlib.util

    sdpa = {"+actor_rollout_ref.model.override_config.attn_implementation": "sdpa"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else _find(name))
    assert verl_value(build_verl_config(recipe(), sdpa), "critic.model.override_config.attn_implementation") == "sdpa"
    assert verl_value(build_verl_config(recipe(), {}), "critic.model.override_config.attn_implementation") == "sdpa"
    own = build_verl_config(recipe(), {**sdpa, "+critic.model.override_config.attn_implementation": "eager"})
    assert verl_value(own, "critic.model.override_config.attn_implementation") == "eager"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else _find(name))
    assert verl_value(build_verl_config(recipe(), sdpa), "critic.model.override_config.attn_implementation") is None


def _find(name):
    import importlib.machinery

    return importlib.machinery.PathFinder.find_spec(name)
