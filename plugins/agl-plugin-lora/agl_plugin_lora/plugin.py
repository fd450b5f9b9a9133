"""The hook implementations of the ``lora`` plugin.

The plugin registers an actor transform that puts the adapter on the actor
of the embedded backend (``torch``), fills the reference slot, and exports
checkpoints that hold an adapter. Only the embedded backend is supported so
far.

No hook here depends on the order in which plugins are registered: the
backend applies the transform when it makes its actor, before it loads a
checkpoint into it, whichever of ``load_checkpoint`` and ``on_train_start``
makes it first.
"""

from __future__ import annotations

from pathlib import Path

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError

from agl_plugin_torch.backend import ACTOR_DIR, Backend
from agl_plugin_torch.backend import NAME as TORCH
from agl_plugin_torch.plugin import backend_of

from agl_plugin_lora import embedded, export
from agl_plugin_lora.adapter import has_adapter
from agl_plugin_lora.settings import LoraSettings
from agl_plugin_lora.startup import NAME


def adapted_backend(ctx) -> Backend:
    """The embedded backend of the run, whose actor carries the adapter; a clear error otherwise."""
    plugin = ctx.plugins.plugins.get(TORCH)
    if plugin is None or plugin.status != "active":
        active = ", ".join(p.name for p in ctx.plugins.active()) or "none"
        raise PluginError(f"plugin {NAME!r} adapts the embedded backend's actor, but plugin {TORCH!r} is not "
                          f"active (active plugins: {active}); enable it with plugins: [{TORCH}, {NAME}]")
    backend = backend_of(ctx)
    if not has_adapter(backend.actor):
        raise PluginError(f"plugin {NAME!r} is active but the actor of plugin {TORCH!r} has no LoRA adapter: "
                          f"that agl-plugin-torch does not apply the actor_transform components of other plugins")
    return backend


class LoraPlugin:
    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def plugin_config_schema(self):
        return LoraSettings

    @hookimpl
    def register_actor_transforms(self, register):
        """The adapter goes on the actor when the backend makes it (see :mod:`agl_plugin_lora.embedded`)."""
        register(NAME, embedded.adapt_actor)

    @hookimpl
    def load_checkpoint(self, ctx, path):
        """Refuse a checkpoint that holds a fully fine-tuned actor (there is no adapter to resume)."""
        if not export.is_adapter_dir(Path(path) / ACTOR_DIR):
            raise PluginError(f"the checkpoint {path} holds a fully fine-tuned actor, not a LoRA adapter; "
                              f"resume it without plugin {NAME!r}, or start a new run")

    @hookimpl
    def on_train_start(self, ctx):
        """Check that the backend's actor, which the endpoint serves, carries the adapter."""
        adapted_backend(ctx)

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        """``ref_log_prob``: the actor's log-probs with its adapter disabled, i.e. the base model's."""
        batch["ref_log_prob"] = embedded.reference_logprobs(adapted_backend(ctx), batch)
        return batch

    @hookimpl
    def export_model(self, path, out, merged):
        """A checkpoint that holds an adapter: merged into its base model, or the adapter alone."""
        adapter = Path(path) / ACTOR_DIR
        if not export.is_adapter_dir(adapter):
            return None
        return str((export.merge if merged else export.copy_adapter)(adapter, Path(out)))


plugin = LoraPlugin()
