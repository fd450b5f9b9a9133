"""Named components (estimators, policy losses, aggregators, stores, actor transforms) that plugins register."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agl_core.plugins import PluginError, PluginSet

REGISTRATION_HOOKS = {
    "estimator": "register_estimators",
    "policy_loss": "register_policy_losses",
    "aggregator": "register_aggregators",
    "store": "register_stores",
    "actor_transform": "register_actor_transforms",
}


@dataclass
class Component:
    kind: str
    name: str
    obj: Any
    plugin: str
    options: dict[str, Any] = field(default_factory=dict)


class Components:
    """Registry of named components, each owned by the plugin that registered it."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Component]] = {kind: {} for kind in REGISTRATION_HOOKS}

    @classmethod
    def collect(cls, plugins: PluginSet) -> "Components":
        """Call every ``register_*`` hook of the active plugins."""
        registry = cls()
        for kind, hook in REGISTRATION_HOOKS.items():
            for plugin_name, fn in plugins.implementations(hook):
                fn(register=registry.registrar(kind, plugin_name))
        return registry

    def registrar(self, kind: str, plugin: str):
        """The ``register(name, obj, **options)`` callback handed to one plugin's hook."""

        def register(name: str, obj: Any, **options: Any) -> None:
            self.add(Component(kind, name, obj, plugin, options))

        return register

    def add(self, component: Component) -> None:
        existing = self._by_kind[component.kind].get(component.name)
        if existing is not None:
            raise PluginError(
                f"{component.kind} {component.name!r} is registered by both plugin "
                f"{existing.plugin!r} and plugin {component.plugin!r}"
            )
        self._by_kind[component.kind][component.name] = component

    def get(self, kind: str, name: str) -> Component:
        """The component ``name`` of ``kind``; the error lists the registered names."""
        try:
            return self._by_kind[kind][name]
        except KeyError:
            known = ", ".join(sorted(self._by_kind[kind])) or "none"
            raise PluginError(f"unknown {kind} {name!r}; registered: {known}") from None

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])
