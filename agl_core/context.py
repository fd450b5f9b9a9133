"""The run's context, handed to every hook as ``ctx``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from agl_core.components import Components
from agl_core.config import Recipe
from agl_core.plugins import PluginError, PluginSet, call, did_you_mean


@dataclass
class TrainContext:
    """What a hook may read (and the few fields it may set) during a run.

    ``config`` is the validated recipe; :meth:`plugin_config` a plugin's own
    validated section. ``plugins`` is the run's :class:`~agl_core.plugins.PluginSet`
    and ``components`` the estimators, losses, aggregators, stores and actor
    transforms the active plugins registered (``components.get(kind, name)``).
    ``run_dir`` is the run directory, this trainer's alone during the run.
    ``world_size`` is set by the backend in ``on_train_start``: rows are padded
    to a multiple of it and balanced over it. ``tokenizer`` is the policy's
    tokenizer (anything with ``decode(ids) -> str``), set there by a backend
    that has one, for plugins that show text (the ``samples`` plugin);
    ``None`` otherwise. ``step_metrics`` collects the
    metrics that hooks report during the current step; the loop logs them.
    ``state`` is free space for plugins, keyed by plugin name. ``slots`` maps
    each resolved slot hook to ``(plugin name, call)``; call them with
    :meth:`call`. ``run_id`` is the id of the run (``<run_dir>/run.json``),
    set before any checkpoint is loaded; ``step`` is the step the run resumed
    from (0 for a fresh start) until the loop starts counting, then the
    current step (from 1); ``epoch`` the current epoch.
    """

    config: Recipe
    plugins: PluginSet
    components: Components
    run_dir: Path
    run_id: str | None = None
    step: int = 0
    epoch: int = 0
    world_size: int = 1
    tokenizer: Any = None
    step_metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, tuple[str, Callable]] = field(default_factory=dict)

    @property
    def purge_step(self) -> int:
        """The first step this run logs: at ``on_train_start`` a per-step log drops its records of it and later.

        A resumed run logs again every step after its checkpoint's; a run from
        step 0 logs everything again, the validation before training included.
        Read-only: it is computed from ``step``.
        """
        return self.step + 1 if self.step else 0

    def plugin_config(self, name: str) -> BaseModel:
        """The validated recipe section ``plugins.<name>`` (a method: ``ctx.plugin_config("lora")``)."""
        try:
            return self.config.plugin_config[name]
        except KeyError:
            raise PluginError(f"plugin {name!r} has no settings in this run: it is not active or defines no "
                              f"plugin_config_schema{did_you_mean(name, self.config.plugin_config)}") from None

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call the implementation that fills slot ``hook`` (``ctx`` is passed for you).

        It goes through pluggy, so the hook's wrappers wrap it, and its result
        is checked (:meth:`agl_core.plugins.PluginSet.call`).
        """
        try:
            _, fn = self.slots[hook]
        except KeyError:
            raise PluginError(f"the slot {hook!r} was not resolved for this run") from None
        return call(fn, {"ctx": self, **kwargs})
