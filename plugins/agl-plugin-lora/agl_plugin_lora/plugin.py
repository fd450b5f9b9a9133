"""The hook implementations of the ``lora`` plugin.

Two backends: the embedded one (``torch``), whose actor this plugin adapts
through an actor transform, and ``verl``, whose engine adapts its own actor
from the same recipe keys (translated by agl-plugin-verl). On both the
plugin fills the reference slot with the actor's log-probs with its adapter
disabled, and its hooks find the run's backend themselves
(:func:`backend_name`): neither backend plugin is a requirement of this one.

No hook here depends on the order in which plugins are registered: the
embedded backend applies the transform when it makes its actor, before it
loads a checkpoint into it, whichever of ``load_checkpoint`` and
``on_train_start`` makes it first; on verl the start-up check that both
plugins run is the same function.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.lazy_import import LazyModule
from agl_core.plugins import PluginError

from agl_plugin_lora.settings import LoraSettings
from agl_plugin_lora.startup import NAME

if TYPE_CHECKING:
    from agl_plugin_lora import adapter as lora_adapter
    from agl_plugin_lora import embedded, export, verl_backend
    from agl_plugin_lora import policies as lora_policies
    from agl_plugin_torch.backend import Backend
else:  # torch, transformers and peft: imported when a hook first needs them, not with the plugin (`agl plugins`)
    lora_adapter = LazyModule("agl_plugin_lora.adapter", globals(), "lora_adapter")
    embedded = LazyModule("agl_plugin_lora.embedded", globals())
    export = LazyModule("agl_plugin_lora.export", globals())
    verl_backend = LazyModule("agl_plugin_lora.verl_backend", globals())
    lora_policies = LazyModule("agl_plugin_lora.policies", globals(), "lora_policies")

TORCH, VERL = "torch", "verl"
BACKENDS = (TORCH, VERL)
"""The backend plugins whose actor this plugin can adapt."""


def backend_name(ctx) -> str:
    """The run's backend: the plugin that updates the actor, else the one backend plugin that is active."""
    owner = ctx.slots.get("update_actor", (None, None))[0]
    if owner in BACKENDS:
        return owner
    active = [p.name for p in ctx.plugins.active()]
    found = [name for name in BACKENDS if name in active]
    if len(found) == 1:
        return found[0]
    raise PluginError(f"plugin {NAME!r} adapts the actor of a backend plugin, one of {', '.join(BACKENDS)}; "
                      f"the actor is updated by {owner!r} and the active plugins are {', '.join(active) or 'none'}: "
                      f"enable one backend, e.g. plugins: [{TORCH}, {NAME}] or [{VERL}, {NAME}]")


def adapted_backend(ctx) -> Backend:
    """The embedded backend of the run, whose actor carries the adapter; a clear error otherwise."""
    plugin = ctx.plugins.plugins.get(TORCH)
    if plugin is None or plugin.status != "active":
        active = ", ".join(p.name for p in ctx.plugins.active()) or "none"
        raise PluginError(f"plugin {NAME!r} adapts the embedded backend's actor, but plugin {TORCH!r} is not "
                          f"active (active plugins: {active}); enable it with plugins: [{TORCH}, {NAME}]")
    from agl_plugin_torch.plugin import backend_of

    backend = backend_of(ctx)
    if not lora_adapter.has_adapter(backend.actor):
        raise PluginError(f"plugin {NAME!r} is active but the actor of plugin {TORCH!r} has no LoRA adapter: "
                          f"that agl-plugin-torch does not apply the actor_transform components of other plugins")
    return backend


def _embedded_actor_dir(path) -> Path | None:
    """``<checkpoint>/actor``, where the embedded backend writes its actor; None without agl-plugin-torch."""
    try:
        from agl_plugin_torch.backend import ACTOR_DIR
    except ImportError:
        return None
    return Path(path) / ACTOR_DIR


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
        """Refuse an embedded checkpoint that holds a fully fine-tuned actor (there is no adapter to resume).

        verl's checkpoints (``<checkpoint>/verl/actor``) hold the adapter in
        the actor's state dict, which verl's checkpoint manager loads
        strictly into the adapted actor.
        """
        actor = _embedded_actor_dir(path)
        if actor is not None and actor.is_dir() and not export.is_adapter_dir(actor):
            raise PluginError(f"the checkpoint {path} holds a fully fine-tuned actor, not a LoRA adapter; "
                              f"resume it without plugin {NAME!r}, or start a new run")

    @hookimpl
    def on_train_start(self, ctx):
        """Embedded: check that the actor, which the endpoint serves, carries the adapter. verl: the reference slot."""
        if backend_name(ctx) == VERL:
            verl_backend.check_start(ctx)
        else:
            adapted_backend(ctx)

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        """``ref_log_prob``: the actor's log-probs with its adapter disabled, i.e. the base model's."""
        if backend_name(ctx) == VERL:
            batch["ref_log_prob"] = verl_backend.reference_logprobs(ctx, batch)
        else:
            batch["ref_log_prob"] = embedded.reference_logprobs(adapted_backend(ctx), batch)
        return batch

    @hookimpl
    def save_checkpoint(self, ctx, path):
        """Several policies (embedded): each adapter as a PEFT directory, ``<checkpoint>/policies/<name>``.

        The backend's own ``torch_state.pt`` holds every trained adapter and
        its optimizer for resuming; these directories are what ``agl export``
        writes and what peft loads.
        """
        if ctx.config.policies and backend_name(ctx) == TORCH:
            backend = adapted_backend(ctx)
            with backend.lock:
                lora_policies.save_adapters(backend.actor, backend.tokenizer, Path(path) / lora_policies.POLICIES_DIR,
                                            str(backend.source))

    @hookimpl
    def export_model(self, path, out, merged, policy):
        """An embedded checkpoint that holds an adapter: merged into its base model, or the adapter alone.

        Of several policies: ``policy``'s adapter (merged or alone), or every
        adapter alone in ``out/<name>``.
        """
        policies_dir = Path(path) / lora_policies.POLICIES_DIR
        if policies_dir.is_dir():
            return str(export.export_policies(policies_dir, Path(out), merged, policy))
        adapter = _embedded_actor_dir(path)
        if adapter is None or not export.is_adapter_dir(adapter):
            return None
        return str((export.merge if merged else export.copy_adapter)(adapter, Path(out)))


plugin = LoraPlugin()
