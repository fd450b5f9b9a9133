"""Helpers of the LoRA plugin's tests: the embedded backend's test kit, with a deeper tiny model and an adapter."""

from __future__ import annotations

from types import SimpleNamespace

from agl_core.config import Recipe

from agl_plugin_torch import testing
from agl_plugin_torch.backend import Backend, create
from agl_plugin_torch.settings import TorchConfig

from agl_plugin_lora.embedded import adapt_actor
from agl_plugin_lora.settings import LoraSettings


def tiny_section(**overrides) -> dict:
    """The torch kit's tiny llama with two layers (adapters stack) and a learning rate an adapter moves with."""
    return testing.tiny_section(num_layers=2, lr=0.05, **overrides)


def adapted_backend(tmp_path, settings: LoraSettings, **section) -> Backend:
    """A torch backend (not serving) made with the plugin's actor transform, as a run with ``plugins.lora`` is."""
    ctx = SimpleNamespace(slots={}, plugin_config=lambda name: settings,  # no KL term: no reference slot to check
                          config=Recipe())
    return create(TorchConfig.model_validate(tiny_section(**section)), tmp_path, seed=0, with_critic=False,
                  transforms=[lambda actor: adapt_actor(actor, ctx)])


def algorithm(**overrides):
    """Mini-batches of 8 rows, two epochs: an update that moves the adapter."""
    return testing.algorithm(**{"ppo_mini_batch_size": 8, "ppo_epochs": 2, **overrides})
