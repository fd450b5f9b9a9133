"""The hook implementations of the ``lora`` plugin.

The plugin adapts the actor of the active backend and fills the reference
slot. Only the embedded backend (``torch``) is supported so far.

Ordering: on resume the adapter must be on the actor before the backend loads
its checkpoint into it. Broadcast hooks run in registration order, which for
installed plugins is the order of their entry-point names, so ``lora`` comes
before ``torch``.
"""

from __future__ import annotations

import logging
from pathlib import Path

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError

from agl_plugin_torch.backend import ACTOR_DIR, Backend
from agl_plugin_torch.backend import NAME as TORCH
from agl_plugin_torch.plugin import backend_of

from agl_plugin_lora import embedded
from agl_plugin_lora.adapter import ADAPTER_CONFIG
from agl_plugin_lora.settings import LoraSettings
from agl_plugin_lora.startup import NAME, check_reference_slot

log = logging.getLogger("agl_plugin_lora")


def adapted_backend(ctx) -> Backend:
    """The embedded backend of the run with the adapter on its actor (checked and adapted on first call)."""
    plugin = ctx.plugins.plugins.get(TORCH)
    if plugin is None or plugin.status != "active":
        active = ", ".join(p.name for p in ctx.plugins.active()) or "none"
        raise PluginError(f"plugin {NAME!r} adapts the embedded backend's actor, but plugin {TORCH!r} is not "
                          f"active (active plugins: {active}); enable it with plugins: [{TORCH}, {NAME}]")
    backend = backend_of(ctx)
    if embedded.adapt(backend, ctx.plugin_config(NAME)):
        check_reference_slot(ctx)
        trainable = sum(p.numel() for p in backend.actor.parameters() if p.requires_grad)
        total = sum(p.numel() for p in backend.actor.parameters())
        log.info("LoRA on the actor: %.3fM of %.2fM parameters train", trainable / 1e6, total / 1e6)
    return backend


class LoraPlugin:
    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def plugin_config_schema(self):
        return LoraSettings

    @hookimpl
    def load_checkpoint(self, ctx, path):
        """Adapt the actor before the backend loads the checkpoint's adapter into it."""
        if not (Path(path) / ACTOR_DIR / ADAPTER_CONFIG).is_file():
            raise PluginError(f"the checkpoint {path} holds a fully fine-tuned actor, not a LoRA adapter; "
                              f"resume it without plugin {NAME!r}, or start a new run")
        adapted_backend(ctx)

    @hookimpl
    def on_train_start(self, ctx):
        """Adapt the actor (the endpoint then serves the adapted weights) and check the reference slot."""
        adapted_backend(ctx)

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        """``ref_log_prob``: the actor's log-probs with its adapter disabled, i.e. the base model's."""
        batch["ref_log_prob"] = embedded.reference_logprobs(adapted_backend(ctx), batch)
        return batch


plugin = LoraPlugin()
