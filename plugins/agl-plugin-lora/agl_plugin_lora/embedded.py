"""LoRA on the embedded backend (agl-plugin-torch): an actor transform, and the reference as the base model.

The torch backend applies the ``actor_transform`` components of the active
plugins when it makes its actor (:func:`agl_plugin_torch.backend.create`):
right after loading the initial weights, before a checkpoint is loaded into
it, before the endpoint serves it and before its optimizer is made. This
plugin's transform puts the adapter on the actor there, so a resumed run's
actor takes the checkpoint's adapter whatever the order of the plugins'
hooks, and the backend's optimizer is only ever built over the adapter.
Because the actor stays the same object of the same class, the policy
endpoint serves the adapted weights and the backend's own checkpoints save
the adapter, with no LoRA code in the backend.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from agl_core.data import Batch

from agl_core.policies import POLICY_ADAPTERS

from agl_plugin_lora import policies
from agl_plugin_lora.adapter import adapter_disabled, add_adapter
from agl_plugin_lora.startup import NAME, check_reference_slot

if TYPE_CHECKING:  # agl-plugin-torch is needed only when it is the backend
    from agl_plugin_torch.backend import Backend

log = logging.getLogger("agl_plugin_lora")


def adapt_actor(actor: PreTrainedModel, ctx) -> PreTrainedModel:
    """The ``lora`` actor transform: check the reference slot, then put the recipe's adapter(s) on ``actor``.

    With a ``policies`` section, one named adapter per policy that is not the
    base (:mod:`agl_plugin_lora.policies`); else the one adapter.
    """
    check_reference_slot(ctx)
    if ctx.config.policies:
        from agl_core.policies import training_policies

        settings = policies.adapter_settings(ctx.plugin_config(NAME), ctx.config.policies)
        trains = set(training_policies(ctx.config.policies, ctx.config.trainer.agent_match))
        policies.add_policy_adapters(actor, settings, trains, list(ctx.config.policies))
    else:
        add_adapter(actor, ctx.plugin_config(NAME))
    trainable = sum(p.numel() for p in actor.parameters() if p.requires_grad)
    total = sum(p.numel() for p in actor.parameters())
    log.info("LoRA on the actor: %.3fM of %.2fM parameters train", trainable / 1e6, total / 1e6)
    return actor


def lora_policies(actor: PreTrainedModel) -> dict[str, str] | None:
    """``{policy: adapter}`` of an actor that carries a named adapter per policy, else None."""
    return getattr(actor, POLICY_ADAPTERS, None)


def reference_logprobs(backend: Backend, batch: Batch) -> torch.Tensor:
    """Response log-probs of ``batch`` under the base model: the actor with its adapter disabled.

    Held under the backend's lock: while the adapter is off, the endpoint must
    not generate with the shared actor.
    """
    disabled = policies.adapters_disabled if lora_policies(backend.actor) else adapter_disabled
    with backend.lock, disabled(backend.actor) as base:
        return backend.logprobs(base, batch, with_entropy=False)[0]
