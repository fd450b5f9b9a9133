"""A LoRA adapter put on a transformers model in place, and switched off for the reference policy.

The adapter is injected with transformers' own peft integration
(``model.add_adapter``) rather than wrapped in a ``PeftModel``: the model stays
the same object of the same class, so whoever already holds it (the serving
engine, the backend's checkpoint code) keeps working; ``save_pretrained``
then writes only the adapter, and ``from_pretrained`` of that directory
loads the base model and the adapter with the same parameter names.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from peft import LoraConfig
from transformers import PreTrainedModel

from agl_plugin_lora.settings import LoraSettings

ADAPTER_CONFIG = "adapter_config.json"
"""The file ``save_pretrained`` of an adapted model writes next to the adapter's weights."""


def lora_config(settings: LoraSettings) -> LoraConfig:
    """peft's config of the adapter the recipe asks for."""
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                      target_modules=settings.target_modules, modules_to_save=settings.modules_to_save or None,
                      bias="none", task_type="CAUSAL_LM")


def has_adapter(model: PreTrainedModel) -> bool:
    return bool(getattr(model, "_hf_peft_config_loaded", False))


def is_adapter_parameter(name: str) -> bool:
    """Whether parameter ``name`` belongs to the adapter (LoRA matrices, trained copies of modules_to_save)."""
    return "lora_" in name or ".modules_to_save." in name


def add_adapter(model: PreTrainedModel, settings: LoraSettings) -> None:
    """Put a fresh adapter on ``model``: only its parameters train, and it starts as the identity.

    (B = 0, and each module to save starts as a copy of the original.) peft
    freezes the base weights when it injects the adapter; they are frozen
    again here because the reference policy's equality with the base model
    rests on it.
    """
    model.add_adapter(lora_config(settings))
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))


@contextmanager
def adapter_disabled(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """``model`` computing as its base model for the duration of the block (the reference policy).

    The switch changes the shared model: the caller must keep generation and
    training off it meanwhile (the embedded backend's lock).
    """
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()
