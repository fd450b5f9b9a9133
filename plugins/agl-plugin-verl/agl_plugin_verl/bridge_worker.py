"""What every worker class of the plugin adds to verl's (GPU ones in ``workers.py``, CPU ones in ``cpu.py``).

A module of its own below both, so that ``workers.py`` (which picks the CPU
classes for ``trainer.device: cpu``) and ``cpu.py`` (which builds them on
this mixin) do not import each other.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, register

from agl_core.config import AlgorithmConfig

from agl_plugin_verl.bridge import Registrations, install, registered_names, verl_advantage


class BridgeMixin:
    """Installs agl_core's components into verl's registries in the worker's process; two diagnostics."""

    def install_bridge(self, registrations: Registrations | None) -> None:
        self.agl_bridged = install(registrations or Registrations())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_registered_names(self) -> dict[str, list[str]]:
        """The names in verl's estimator and policy-loss registries, as this worker process sees them."""
        return registered_names()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def agl_compute_advantage(self, data: Any, name: str, algorithm: dict[str, Any]) -> torch.Tensor:
        """Advantages of ``data`` (a DataProto) by verl's ``compute_advantage`` with estimator ``name``, here."""
        return verl_advantage(data, name, AlgorithmConfig(**algorithm)).batch["advantages"]
