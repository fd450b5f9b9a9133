"""Several policies on one base model: a named LoRA adapter per policy of the recipe's ``policies`` section.

Each policy that is not the base gets its own adapter (peft's named adapters on
the one model: the base weights are held once); its shape is ``plugins.lora``
with the policy's ``adapter`` keys over it. A trainable policy's adapter
requires a gradient, a frozen one (``trainable: false``) never does, and a
base policy is served by the model with every adapter off. The actor records
which adapter serves each policy (:data:`agl_plugin_torch.policies.POLICY_ADAPTERS`)
for the backend's serving and training; the reference of every adapter is the
base model, the actor with its adapters off (:func:`adapters_disabled`).

Checkpoints: ``<checkpoint>/policies/<name>/`` holds each adapter as a PEFT
directory (``adapter_config.json``, ``adapter_model.safetensors``, the
tokenizer), which ``PeftModel.from_pretrained(base, dir)`` loads and
``agl export`` copies or merges.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from pydantic import ValidationError
from transformers import PreTrainedModel

from agl_core.plugins import PluginError
from agl_core.policies import BASE_ADAPTER as BASE, POLICY_ADAPTERS

from agl_plugin_lora.adapter import ADAPTER_CONFIG, lora_config
from agl_plugin_lora.settings import LoraSettings

PEFT_PREFIX = "base_model.model."
POLICIES_DIR = "policies"
"""``<checkpoint>/policies/<name>``: each policy's adapter."""



def adapter_settings(defaults: LoraSettings, policies) -> dict[str, LoraSettings]:
    """Each adapter policy's LoRA settings: ``plugins.lora`` with its ``adapter`` keys over it; errors name the key."""
    out = {}
    for name, spec in policies.items():
        if spec.base:
            continue
        try:
            out[name] = LoraSettings.model_validate({**defaults.model_dump(), **spec.adapter})
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise PluginError(f"policies.{name}.adapter: {problems}") from None
    return out


def add_policy_adapters(model: PreTrainedModel, settings: dict[str, LoraSettings], trainable: set[str],
                        policies: list[str]) -> None:
    """Put a fresh named adapter per policy of ``settings`` on ``model``; only those in ``trainable`` train.

    ``policies`` lists every policy, base ones included, for the routing table.
    Each adapter starts as the identity (B = 0), so every policy starts as the base model.
    """
    if not settings:
        raise PluginError("every policy of the policies section is the base model: there is no adapter to serve "
                          "or train; drop the lora plugin or give a policy an adapter")
    for name, lora in settings.items():
        model.add_adapter(lora_config(lora), adapter_name=name)
    check_mixable(model)
    set_trainable(model, trainable)
    setattr(model, POLICY_ADAPTERS, {name: name if name in settings else BASE for name in policies})


MIXABLE = (torch.nn.Linear, torch.nn.Embedding)
"""Modules whose trained copies (modules_to_save) peft computes per row in a mixed-adapter batch."""


def check_mixable(model: PreTrainedModel) -> None:
    """PluginError naming a ``modules_to_save`` entry whose copies a mixed-adapter batch cannot use (e.g. a norm)."""
    from peft.utils.other import ModulesToSaveWrapper

    for name, module in model.named_modules():
        if isinstance(module, ModulesToSaveWrapper) and not isinstance(module.original_module, MIXABLE):
            raise PluginError(f"modules_to_save {name.rsplit('.', 1)[-1]!r} ({type(module.original_module).__name__} "
                              f"at {name}): with several policies each row of a batch runs its own adapter, and "
                              f"peft does that only for linear and embedding modules; drop it from modules_to_save")


def adapter_name_of(param_name: str) -> str | None:
    """The adapter a parameter belongs to (``…lora_A.<adapter>.weight``, ``…modules_to_save.<adapter>.…``)."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "modules_to_save"):
            return parts[i + 1]
    return None


def set_trainable(model: PreTrainedModel, trainable: set[str]) -> None:
    """Exactly the parameters of the adapters in ``trainable`` require a gradient.

    peft's adapter switches (``set_adapter``, ``enable_adapters``) reset
    these flags to 'the active adapter trains': they are set again after each.
    """
    for name, param in model.named_parameters():
        param.requires_grad_(adapter_name_of(name) in trainable)


@contextmanager
def adapters_disabled(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """``model`` computing as its base model for the block (every policy's reference); trainable flags kept."""
    trains = {adapter_name_of(n) for n, p in model.named_parameters() if p.requires_grad} - {None}
    model.disable_adapters()
    try:
        yield model
    finally:
        model.enable_adapters()
        set_trainable(model, trains)


def save_adapters(model: PreTrainedModel, tokenizer, out: Path, base_path: str) -> dict[str, Path]:
    """Each policy's adapter as a PEFT directory ``out/<name>`` (config, weights, tokenizer); their paths."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    written = {}
    for policy, adapter in getattr(model, POLICY_ADAPTERS).items():
        if adapter == BASE:
            continue
        directory = Path(out) / policy
        directory.mkdir(parents=True, exist_ok=True)
        state = get_peft_model_state_dict(model, adapter_name=adapter)
        # PeftModel's own layout: its keys start with the wrapper's path to the model (a transformers model's own
        # adapter state has none).
        save_file({f"{PEFT_PREFIX}{k}": v.detach().contiguous().cpu() for k, v in state.items()},
                  str(directory / "adapter_model.safetensors"))
        config = model.peft_config[adapter].to_dict()
        config["base_model_name_or_path"] = str(base_path)
        config["target_modules"] = sorted(config["target_modules"]) if isinstance(config.get("target_modules"), set) \
            else config.get("target_modules")
        (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, default=_json_default))
        tokenizer.save_pretrained(directory)
        written[policy] = directory
    return written


def _json_default(value):
    if isinstance(value, set):
        return sorted(value)
    if hasattr(value, "value"):  # enums (task_type, peft_type)
        return value.value
    raise TypeError(f"cannot write {type(value).__name__} into adapter_config.json")
