"""The plugin's contract: its recipe section, its hooks, the start-up check of the reference slot, clear refusals."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from agl_core.plugins import PluginError
from agl_core.testing import check_plugin

from agl_plugin_lora import plugin
from agl_plugin_lora.embedded import adapt_actor
from agl_plugin_lora.export import merge
from agl_plugin_lora.plugin import adapted_backend
from agl_plugin_lora.settings import LoraSettings
from agl_plugin_lora.startup import check_reference_slot


def test_the_plugin_passes_the_contract_check():
    assert check_plugin(plugin, "lora").hooks == ["compute_ref_logprob", "export_model", "load_checkpoint",
                                                  "on_train_start", "plugin_config_schema",
                                                  "register_actor_transforms", "save_checkpoint"]


def test_the_plugin_registers_its_actor_transform():
    registered = []
    plugin.register_actor_transforms(register=lambda name, fn, **options: registered.append((name, fn, options)))
    assert registered == [("lora", adapt_actor, {})]


def test_the_recipe_section():
    assert LoraSettings().target_modules == "all-linear"
    assert LoraSettings(rank=16, alpha=32, dropout=0.05, target_modules=["q_proj"]).target_modules == ["q_proj"]
    for bad in ({"rank": 0}, {"dropout": 1.0}, {"target_modules": "all"}, {"lora_rank": 8}):
        with pytest.raises(ValidationError):
            LoraSettings(**bad)


def ctx_with(owner=None, chosen=None):
    slots = {} if owner is None else {"compute_ref_logprob": (owner, None)}
    choices = {} if chosen is None else {"compute_ref_logprob": chosen}
    return SimpleNamespace(slots=slots, config=SimpleNamespace(plugins=SimpleNamespace(slots=choices)))


def test_the_reference_slot_must_be_lora_unless_the_recipe_chooses(caplog):
    check_reference_slot(ctx_with())  # no KL term: no reference slot at all
    check_reference_slot(ctx_with("lora"))
    with pytest.raises(PluginError, match=r"plugin 'torch' fills the slot 'compute_ref_logprob'.*"
                                          r"plugins.slots.compute_ref_logprob=lora"):
        check_reference_slot(ctx_with("torch"))
    with caplog.at_level(logging.WARNING, logger="agl_plugin_lora"):
        check_reference_slot(ctx_with("torch", chosen="torch"))
    assert "separate copy of the weights" in caplog.text


def test_without_the_embedded_backend_the_plugin_says_what_to_enable():
    ctx = SimpleNamespace(plugins=SimpleNamespace(plugins={}, active=lambda: []))
    with pytest.raises(PluginError, match=r"plugin 'torch' is not active.*plugins: \[torch, lora\]"):
        adapted_backend(ctx)


def test_a_fully_fine_tuned_checkpoint_is_not_resumed_with_lora(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "model.safetensors").write_bytes(b"")
    with pytest.raises(PluginError, match="holds a fully fine-tuned actor, not a LoRA adapter"):
        plugin.load_checkpoint(ctx=None, path=str(tmp_path))


def test_export_says_where_it_looked_for_an_adapter(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"no LoRA adapter at {tmp_path}"):
        merge(tmp_path, tmp_path / "out")


def test_a_checkpoint_without_an_adapter_is_left_to_another_exporter(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "model.safetensors").write_bytes(b"")
    assert plugin.export_model(path=str(tmp_path), out=str(tmp_path / "out"), merged=True, policy=None) is None
    assert not (tmp_path / "out").exists()


def test_an_actor_the_backend_did_not_adapt_is_a_clear_error():
    from agl_plugin_torch.backend import NAME as TORCH

    actor = SimpleNamespace(_hf_peft_config_loaded=False)
    ctx = SimpleNamespace(plugins=SimpleNamespace(plugins={TORCH: SimpleNamespace(status="active")}),
                          state={TORCH: SimpleNamespace(actor=actor)})
    with pytest.raises(PluginError, match="has no LoRA adapter.*actor_transform"):
        adapted_backend(ctx)
