"""LoRA on the verl backend (agl-plugin-verl): verl puts the adapter on its actor, the reference is the base model.

Nothing is adapted here: agl-plugin-verl translates the recipe section
``plugins.lora`` into verl's LoRA options (``actor_rollout_ref.model.lora_rank``,
``lora_alpha``, ``target_modules``) and refuses the keys verl cannot honour
(:func:`agl_plugin_verl.config.check_lora`); verl's engine then wraps its
actor with peft. With ``lora_rank > 0`` verl takes the reference from the
actor with its adapter disabled (its ``ref_in_actor``) and builds no
reference model. This plugin fills the reference slot by calling verl's
actor worker group that way, through the verl plugin's own
:func:`agl_plugin_verl.plugin.reference_logprobs`: one code path for the
reference on verl, whichever plugin holds the slot.
"""

from __future__ import annotations

import torch

from agl_core.data import Batch
from agl_core.plugins import PluginError

from agl_plugin_lora.startup import NAME, check_reference_slot


def check_start(ctx) -> None:
    """The start-up check on verl: the reference slot is this plugin's unless the recipe chose another plugin.

    verl itself cannot be that other plugin: with LoRA it gives no separate
    reference (:func:`agl_plugin_verl.plugin.check_lora_reference`, which the
    verl plugin also runs before it builds its workers).
    """
    from agl_plugin_verl.plugin import check_lora_reference, check_policies

    check_lora_reference(ctx)
    check_policies(ctx)  # verl serves one adapter: several policies are refused naming that limit
    check_reference_slot(ctx)


def reference_logprobs(ctx, batch: Batch) -> torch.Tensor:
    """Response log-probs of ``batch`` under the base model: verl's actor with its adapter disabled."""
    from agl_plugin_verl.plugin import NAME as VERL
    from agl_plugin_verl.plugin import reference_logprobs as verl_reference, run_of

    if not run_of(ctx).groups.layout.ref_in_actor:
        raise PluginError(f"plugin {NAME!r} is active but the actor of plugin {VERL!r} carries no LoRA adapter "
                          f"(actor_rollout_ref.model.lora_rank is 0): that agl-plugin-verl does not translate "
                          f"plugins.{NAME}")
    return verl_reference(ctx, batch)
