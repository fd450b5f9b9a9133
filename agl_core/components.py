"""Named components (estimators, policy losses, aggregators, stores, actor transforms) that plugins register."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from agl_core.plugins import Plugin, PluginError, PluginSet, accepts, call, did_you_mean

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

    @functools.cached_property
    def takes_ctx(self) -> bool:
        """Whether ``obj`` takes a ``ctx`` keyword (an estimator of hook API 1.3), read off its signature once."""
        return accepts(self.obj, "ctx")


class Components:
    """Registry of named components, each owned by the plugin that registered it."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Component]] = {kind: {} for kind in REGISTRATION_HOOKS}
        self._plugins: PluginSet | None = None

    @classmethod
    def collect(cls, plugins: PluginSet) -> "Components":
        """Call every ``register_*`` hook of the active plugins, each with its plugin's ``settings``.

        ``settings`` is the plugin's validated recipe section
        (``plugins.settings``, filled when a recipe was validated against the
        set), or None.
        """
        registry = cls()
        registry._plugins = plugins
        for kind, hook in REGISTRATION_HOOKS.items():
            for plugin_name, fn in plugins.implementations(hook):
                fn(register=registry.registrar(kind, plugin_name), settings=plugins.settings.get(plugin_name))
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
        """The component ``name`` of ``kind``.

        The error lists the registered names, the closest one, and the
        installed plugins that would register ``name`` if the recipe enabled
        them.
        """
        try:
            return self._by_kind[kind][name]
        except KeyError:
            pass
        registered = self._by_kind[kind]
        known = ", ".join(sorted(registered)) or "none"
        message = f"unknown {kind} {name!r}{did_you_mean(name, registered)}; registered: {known}"
        inactive = self.inactive_providers(kind, name)
        if inactive:
            message += (f"; installed but not active: plugin {', '.join(inactive)} provides it "
                        f"(enable it in the recipe's plugins section or with -p {inactive[0]})")
        raise PluginError(message)

    def inactive_providers(self, kind: str, name: str) -> list[str]:
        """Installed, imported plugins that are not active and would register ``name`` of ``kind``."""
        if self._plugins is None:
            return []
        hook = REGISTRATION_HOOKS[kind]
        return [plugin.name for plugin in self._plugins.plugins.values()
                if plugin.status != "active" and name in offered_names(plugin, hook)]

    def names(self, kind: str) -> list[str]:
        return sorted(self._by_kind[kind])

    def all(self, kind: str) -> list[Component]:
        """Every component of ``kind``, by name."""
        return [self._by_kind[kind][name] for name in self.names(kind)]


def offered_names(plugin: Plugin, hook: str) -> list[str]:
    """The names a plugin that is not active would register through ``hook`` (a ``register_*`` hook).

    Its implementation is asked directly with a recording callback and
    ``settings=None``; one that fails that way offers nothing ([]): this only
    feeds listings and error hints.
    """
    fn = plugin.impls.get(hook)
    if fn is None:
        return []
    names: list[str] = []
    try:
        call(fn, {"register": lambda name, obj, **options: names.append(name), "settings": None})
    except Exception:  # noqa: BLE001 - a hint, never a new failure
        return []
    return names


def call_estimator(component: Component, batch: Any, config: Any, ctx: Any = None) -> tuple[Any, Any]:
    """Run estimator ``component`` as the ``advantage`` slot does: ``fn(batch, config)``, plus ``ctx=ctx`` when
    the estimator declares a ``ctx`` parameter (hook API 1.3); its result checked by
    :func:`checked_estimator_result`."""
    fn = component.obj
    result = fn(batch, config, ctx=ctx) if component.takes_ctx else fn(batch, config)
    return checked_estimator_result(component, result, batch)


def checked_estimator_result(component: Component, result: Any, batch: Any) -> tuple[Any, Any]:
    """``(advantages, returns)`` of estimator ``component`` once they are two tensors of the responses' shape.

    Otherwise a :class:`PluginError` naming the estimator, its plugin and
    what was expected, instead of a failure deep in the metrics.
    """
    where = f"estimator {component.name!r} of plugin {component.plugin!r}"
    expected = "(advantages, returns): two tensors of the shape of batch['responses']"
    if not (isinstance(result, tuple) and len(result) == 2):
        got = "None" if result is None else f"a {type(result).__name__}"
        raise PluginError(f"{where} returned {got}, expected {expected}")
    shape = tuple(batch["responses"].shape)
    for label, value in zip(("advantages", "returns"), result):
        got = getattr(value, "shape", None)
        if got is None or tuple(got) != shape:
            what = f"shape {tuple(got)}" if got is not None else f"a {type(value).__name__}"
            raise PluginError(f"{where} returned {label} of {what}, expected {expected} {shape}")
    return result
