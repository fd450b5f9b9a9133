"""Plugin discovery, loading, validation and hook dispatch.

Plugins are found through the entry-point group ``agl_core.plugins``; the
built-ins are entry points of the ``agl-core`` distribution itself. A
built-in is active unless disabled; a third-party plugin, and a built-in whose
module sets ``AGL_OPT_IN = True`` (an alternative to a default, such as
``remote_runners``), is active when the recipe (or ``-p NAME``) enables it.
A plugin that fails to import or to validate is recorded with the reason and
is fatal only when it was enabled.
``AGL_DISABLE_PLUGIN_AUTOLOAD=1`` stops the import of third-party plugins that
were not asked for, as pytest's variable of that name does.
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import importlib_metadata
import pluggy

from agl_core import hookspecs
from agl_core.hookspecs import BROADCAST, HOOK_API_VERSION, PIPELINE, SLOT

ENTRY_POINT_GROUP = "agl_core.plugins"
BUILTIN_DISTRIBUTION = "agl-core"
RESERVED_NAMES = frozenset({"slots", "order", "disable"})
"""Keys of the recipe's ``plugins`` section that are settings, not plugin names."""
DEFAULT_ORDER = 100

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT)
HOOK_KINDS: dict[str, str] = {
    name: fn.agl_kind for name, fn in vars(hookspecs).items() if hasattr(fn, "agl_kind")
}


class PluginError(Exception):
    """A plugin cannot be used: missing, failed, invalid or ambiguous."""


@dataclass
class Plugin:
    """One discovered plugin and what became of it."""

    name: str
    distribution: str | None
    version: str | None
    status: str = "available"  # active | available | disabled | failed
    reason: str | None = None
    hooks: list[str] = field(default_factory=list)
    obj: Any = None

    @property
    def builtin(self) -> bool:
        return self.distribution == BUILTIN_DISTRIBUTION

    @property
    def opt_in(self) -> bool:
        """Active only when enabled: a third-party plugin, or a built-in whose module sets ``AGL_OPT_IN = True``."""
        return not self.builtin or getattr(self.obj, "AGL_OPT_IN", False)

    @property
    def label(self) -> str:
        """How messages name the plugin: ``name (distribution version)``."""
        return f"{self.name} ({self.distribution or 'unregistered'} {self.version or '?'})"

    @property
    def order(self) -> int:
        return getattr(self.obj, "AGL_ORDER", DEFAULT_ORDER)


def autoload_disabled() -> bool:
    return os.environ.get("AGL_DISABLE_PLUGIN_AUTOLOAD", "").strip() not in ("", "0", "false")


def parse_plugin_flags(flags: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split ``-p`` values into (enable, disable): ``name`` enables, ``no:name`` disables."""
    enable, disable = [], []
    for flag in flags:
        if flag.startswith("no:"):
            disable.append(flag[3:])
        else:
            enable.append(flag)
    return enable, disable


def check_hook_api(plugin: Plugin) -> None:
    """Refuse a plugin written against an incompatible version of the hook contract."""
    declared = getattr(plugin.obj, "AGL_HOOK_API", None)
    if declared is None:
        raise PluginError(
            f"plugin {plugin.label} declares no AGL_HOOK_API; "
            f"set AGL_HOOK_API = {HOOK_API_VERSION!r} in the plugin module"
        )
    major, minor = (int(part) for part in str(declared).split(".")[:2])
    core_major, core_minor = (int(part) for part in HOOK_API_VERSION.split("."))
    if major != core_major or minor > core_minor:
        raise PluginError(
            f"plugin {plugin.label} was written for agl_core hook API {declared}, "
            f"this agl_core provides hook API {HOOK_API_VERSION}"
        )


def validate_hookimpls(plugin: Plugin, manager: pluggy.PluginManager) -> list[str]:
    """Check every hook implementation of ``plugin`` against the contract; return the hook names.

    Refused: a hook name the contract does not declare, an argument the hook
    does not declare, and an ``async def`` implementation (every hook is sync).
    """
    implemented = []
    for attr in dir(plugin.obj):
        opts = manager.parse_hookimpl_opts(plugin.obj, attr)
        if opts is None:
            continue
        fn = getattr(plugin.obj, attr)
        hook_name = opts.get("specname") or attr
        if hook_name not in HOOK_KINDS:
            raise PluginError(
                f"plugin {plugin.label} implements unknown hook {hook_name!r}; "
                f"known hooks: {', '.join(sorted(HOOK_KINDS))}"
            )
        spec_args = set(inspect.signature(getattr(hookspecs, hook_name)).parameters)
        extra = [a for a in inspect.signature(fn).parameters if a not in spec_args]
        if extra:
            raise PluginError(
                f"plugin {plugin.label}: hook {hook_name!r} has unknown argument(s) "
                f"{', '.join(extra)}; the hook takes {', '.join(sorted(spec_args)) or 'no arguments'}"
            )
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
            raise PluginError(
                f"plugin {plugin.label}: hook {hook_name!r} is async but the hook is synchronous; "
                f"define it with 'def'"
            )
        implemented.append(hook_name)
    return sorted(implemented)


def discover() -> list[importlib_metadata.EntryPoint]:
    """The entry points of group ``agl_core.plugins``, one per name (first one wins)."""
    seen: dict[str, importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault(ep.name, ep)
    return sorted(seen.values(), key=lambda ep: ep.name)


class PluginSet:
    """The plugins of one run: which are active, and the hook implementations they bring."""

    def __init__(self, plugins: list[Plugin], manager: pluggy.PluginManager):
        self.plugins = {p.name: p for p in plugins}
        self.manager = manager

    # ------------------------------------------------------------------ loading

    @classmethod
    def load(
        cls,
        enable: Iterable[str] = (),
        disable: Iterable[str] = (),
        extra: Iterable[tuple[str, Any]] = (),
        autoload: bool | None = None,
    ) -> "PluginSet":
        """Discover, import, validate and register the plugins.

        ``enable`` names third-party plugins to activate, ``disable`` names
        plugins (built-in ones too) to keep out; ``extra`` adds ``(name,
        object)`` plugins that are not installed (tests, notebooks). Raises
        :class:`PluginError` when an enabled plugin is missing or broken;
        anything else that fails is only recorded.
        """
        enable, disable = list(enable), set(disable)
        autoload = not autoload_disabled() if autoload is None else autoload
        manager = pluggy.PluginManager(hookspecs.PROJECT)
        manager.add_hookspecs(hookspecs)
        plugins: list[Plugin] = []
        for ep in discover():
            dist = ep.dist
            plugin = Plugin(ep.name, dist.name if dist else None, dist.version if dist else None)
            plugins.append(plugin)
            if plugin.name in disable:
                plugin.status, plugin.reason = "disabled", "disabled by the recipe or -p no:"
                continue
            wanted = plugin.builtin or plugin.name in enable
            if not (wanted or autoload):
                plugin.reason = "not imported: AGL_DISABLE_PLUGIN_AUTOLOAD is set"
                continue
            try:
                plugin.obj = ep.load()
            except Exception as exc:  # a broken plugin must never break the CLI
                plugin.status, plugin.reason = "failed", f"import failed: {type(exc).__name__}: {exc}"
                continue
            cls._admit(plugin, manager, active=plugin.name in enable or not plugin.opt_in)
        for name, obj in extra:
            plugin = Plugin(name, None, None, obj=obj)
            plugins.append(plugin)
            if name not in disable:
                cls._admit(plugin, manager, active=True)
        pset = cls(plugins, manager)
        pset._check_enabled(enable)
        return pset

    @staticmethod
    def _admit(plugin: Plugin, manager: pluggy.PluginManager, active: bool) -> None:
        try:
            if plugin.name in RESERVED_NAMES:
                raise PluginError(f"plugin {plugin.label} uses the reserved name {plugin.name!r}")
            check_hook_api(plugin)
            plugin.hooks = validate_hookimpls(plugin, manager)
        except (PluginError, ValueError) as exc:
            plugin.status, plugin.reason = "failed", str(exc)
            return
        if active:
            manager.register(plugin.obj, name=plugin.name)
            plugin.status = "active"

    def _check_enabled(self, enable: list[str]) -> None:
        for name in enable:
            plugin = self.plugins.get(name)
            if plugin is None:
                known = ", ".join(sorted(self.plugins)) or "none"
                raise PluginError(
                    f"plugin {name!r} is enabled but not installed (installed plugins: {known})"
                )
            if plugin.status == "failed":
                raise PluginError(f"plugin {plugin.label} is enabled but failed: {plugin.reason}")
            if plugin.status == "disabled":
                raise PluginError(f"plugin {plugin.label} is both enabled and disabled")

    # ----------------------------------------------------------------- dispatch

    def implementations(self, hook: str) -> list[tuple[str, Callable]]:
        """(plugin name, function) of every active implementation of ``hook``, in registration order."""
        impls = getattr(self.manager.hook, hook).get_hookimpls()
        return [(impl.plugin_name, impl.function) for impl in impls]

    def resolve_slot(self, hook: str, choice: str | None = None,
                     required: bool = True) -> tuple[str, Callable] | None:
        """(plugin name, function) of the one implementation that fills slot ``hook``.

        ``choice`` is the recipe's ``plugins.slots.<hook>``. Without a choice,
        a single candidate the recipe enabled (third-party or opt-in built-in)
        wins over the default built-ins. An empty slot is an error when
        ``required``, else None.
        """
        assert HOOK_KINDS[hook] == SLOT, f"{hook} is not a slot"
        candidates = dict(self.implementations(hook))
        if choice is not None:
            if choice not in candidates:
                raise PluginError(
                    f"plugins.slots.{hook} names {choice!r}, which does not implement it; "
                    f"candidates: {', '.join(candidates) or 'none'}"
                )
            return choice, candidates[choice]
        enabled = [n for n in candidates if self.plugins[n].opt_in]
        pool = enabled or list(candidates)
        if len(pool) == 1:
            return pool[0], candidates[pool[0]]
        if not pool:
            if not required:
                return None
            raise PluginError(
                f"no active plugin fills the slot {hook!r}; enable a plugin that implements it "
                f"(installed: {', '.join(self.providers(hook)) or 'none'})"
            )
        raise PluginError(
            f"the slot {hook!r} is filled by several plugins: {', '.join(pool)}; "
            f"choose one with plugins.slots.{hook}=<name>"
        )

    def pipeline(self, hook: str, order: list[str] | None = None) -> list[tuple[str, Callable]]:
        """The stages of pipeline ``hook`` in the order they run.

        ``order`` is the recipe's ``plugins.order.<hook>``: when given it must
        name every active implementation exactly once.
        """
        assert HOOK_KINDS[hook] == PIPELINE, f"{hook} is not a pipeline"
        stages = dict(self.implementations(hook))
        if order is None:
            return sorted(stages.items(), key=lambda s: (self.plugins[s[0]].order, s[0]))
        if sorted(order) != sorted(stages):
            raise PluginError(
                f"plugins.order.{hook} lists {order}, but the active stages are {sorted(stages)}; "
                f"list each exactly once"
            )
        return [(name, stages[name]) for name in order]

    def broadcast(self, hook: str, **kwargs: Any) -> dict[str, Any]:
        """Call every active implementation of broadcast ``hook``; results by plugin name."""
        assert HOOK_KINDS[hook] == BROADCAST, f"{hook} is not a broadcast"
        return {name: call(fn, kwargs) for name, fn in self.implementations(hook)}

    def providers(self, hook: str) -> list[str]:
        """Names of all installed plugins (active or not) that implement ``hook``."""
        return [p.name for p in self.plugins.values() if hook in p.hooks]

    def active(self) -> list[Plugin]:
        return [p for p in self.plugins.values() if p.status == "active"]

    def manifest(self) -> list[dict[str, Any]]:
        """The active plugin set with versions, as written into run directories and checkpoints."""
        return [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": p.hooks}
            for p in self.active()
        ]


@functools.lru_cache(maxsize=None)
def _argnames(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def call(fn: Callable, kwargs: dict[str, Any]) -> Any:
    """Call a hook implementation with the subset of ``kwargs`` it accepts."""
    accepted = _argnames(fn)
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})
