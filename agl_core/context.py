"""The run's context, handed to every hook as ``ctx``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from agl_core.components import Components
from agl_core.config import Recipe
from agl_core.plugins import PluginError, PluginSet, call


@dataclass
class TrainContext:
    """What a hook may read (and the few fields it may set) during a run.

    ``world_size`` is set by the backend in ``on_train_start``: rows are padded
    to a multiple of it and balanced over it. ``step_metrics`` collects the
    metrics that hooks report during the current step; the loop logs them.
    ``state`` is free space for plugins, keyed by plugin name. ``slots`` holds
    the resolved slot implementations; call them with :meth:`call`.
    """

    config: Recipe
    plugins: PluginSet
    components: Components
    run_dir: Path
    step: int = 0
    epoch: int = 0
    world_size: int = 1
    step_metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    slots: dict[str, tuple[str, Callable]] = field(default_factory=dict)

    def plugin_config(self, name: str) -> BaseModel:
        """The validated recipe section ``plugins.<name>``."""
        return self.config.plugin_config[name]

    def call(self, hook: str, **kwargs: Any) -> Any:
        """Call the implementation that fills slot ``hook`` (``ctx`` is passed for you)."""
        try:
            _, fn = self.slots[hook]
        except KeyError:
            raise PluginError(f"the slot {hook!r} was not resolved for this run") from None
        return call(fn, {"ctx": self, **kwargs})
