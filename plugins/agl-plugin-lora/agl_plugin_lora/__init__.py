"""agl-plugin-lora: LoRA adapters on the actor, the base model as the reference policy.

With LoRA the reference policy is the base model, so no second copy of the
weights is needed: reference log-probs are the actor's with its adapter
disabled. Modules, one idea each:

- ``settings``: the recipe section ``plugins.lora``
- ``adapter``: putting a LoRA adapter on a transformers model, and switching it off
- ``embedded``: the embedded backend (agl-plugin-torch): the actor transform that adapts it, the reference pass
- ``verl_backend``: the verl backend (agl-plugin-verl): the start-up check, the reference from verl's actor
- ``startup``: the start-up check that the reference slot is this plugin's
- ``export``: a checkpoint's adapter, alone or merged into a plain Hugging Face model (``agl export``)
- ``plugin``: the hook implementations
"""

from agl_plugin_lora.plugin import plugin

__all__ = ["plugin"]
