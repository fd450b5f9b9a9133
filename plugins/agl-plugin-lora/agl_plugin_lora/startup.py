"""The start-up check: with LoRA active, the reference policy is the actor with its adapter disabled."""

from __future__ import annotations

import logging

from agl_core.plugins import PluginError

log = logging.getLogger("agl_plugin_lora")

NAME = "lora"
REF_SLOT = "compute_ref_logprob"


def check_reference_slot(ctx) -> None:
    """Raise PluginError when another plugin fills the reference slot and the recipe did not choose it.

    Any other owner would compute the reference from a separate copy of the
    weights: that costs the memory LoRA saves and, on a backend that loads a
    reference from elsewhere, may not even be this actor's base model. A
    recipe that names another plugin in ``plugins.slots.compute_ref_logprob``
    gets what it asked for, with a warning. A run without a KL term resolves
    no reference slot and passes. The embedded backend runs this check
    before it adapts its actor; on verl this plugin's ``on_train_start`` runs
    it, after refusing verl itself as the owner (with LoRA verl has no
    separate reference to give).
    """
    if REF_SLOT not in ctx.slots:
        return
    owner = ctx.slots[REF_SLOT][0]
    if owner == NAME:
        return
    if ctx.config.plugins.slots.get(REF_SLOT) == owner:
        log.warning("LoRA is active but plugins.slots.%s chooses %r: the reference log-probs come from a "
                    "separate copy of the weights, not from the actor with its adapter disabled", REF_SLOT, owner)
        return
    raise PluginError(f"LoRA is active, so the reference policy is the actor with its adapter disabled "
                      f"(plugin {NAME!r}), but plugin {owner!r} fills the slot {REF_SLOT!r}; "
                      f"set plugins.slots.{REF_SLOT}={NAME}, or {owner} to keep a separate reference copy")
