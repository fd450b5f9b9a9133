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

Dispatch goes through pluggy's own caller. Every call the core makes reaches
exactly one (non-wrapper) implementation: :meth:`PluginSet.caller` is
``PluginManager.subset_hook_caller`` without the other plugins' implementations
of the hook, so every active wrapper of the hook (``@hookimpl(wrapper=True)``
or old-style ``hookwrapper=True``) wraps that one call. A wrapper thus wraps
the slot's call, each stage of a pipeline and each plugin's call of a
broadcast, and its ``yield`` returns that implementation's result.
``PluginManager.add_hookcall_monitoring`` and ``enable_tracing`` see the same
calls; ``AGL_TRACE_HOOKS=1`` logs each of them (:func:`trace_hooks`).
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import inspect
import logging
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Mapping
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
TRACE_ENV = "AGL_TRACE_HOOKS"
HOOK_API_FORMAT = re.compile(r"^(\d+)\.(\d+)(\.\d+)?$")

log = logging.getLogger("agl_core.plugins")
trace_log = logging.getLogger("agl_core.hooks")

hookimpl = pluggy.HookimplMarker(hookspecs.PROJECT)
HOOK_KINDS: dict[str, str] = {
    name: fn.agl_kind for name, fn in vars(hookspecs).items() if hasattr(fn, "agl_kind")
}


class PluginError(Exception):
    """A plugin cannot be used: missing, failed, invalid or ambiguous."""


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` when a candidate is close to ``name``, else ``""``."""
    close = difflib.get_close_matches(name, sorted(candidates), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


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
    wrappers: list[str] = field(default_factory=list)
    """Hooks this plugin wraps (``wrapper=True`` or ``hookwrapper=True``)."""
    warnings: list[str] = field(default_factory=list)
    """What looks wrong but does not stop the plugin, e.g. a function named like a hook without ``@hookimpl``."""
    traceback: str | None = None
    """The import traceback of a plugin that failed to import (``agl plugins --verbose``)."""
    impls: dict[str, Callable] = field(default_factory=dict, repr=False)
    """Hook name → this plugin's (non-wrapper) implementation, known once the plugin is validated."""

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


def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is set to something other than empty, ``0`` or ``false``."""
    return os.environ.get(name, "").strip() not in ("", "0", "false")


def autoload_disabled() -> bool:
    return env_flag("AGL_DISABLE_PLUGIN_AUTOLOAD")


def parse_plugin_flags(flags: Iterable[str]) -> tuple[list[str], list[str]]:
    """Split ``-p`` values into (enable, disable): ``name`` enables, ``no:name`` disables.

    For a name given both ways the later flag wins, as in pytest.
    """
    last: dict[str, bool] = {}
    for flag in flags:
        name, enabled = (flag[3:], False) if flag.startswith("no:") else (flag, True)
        last.pop(name, None)  # re-inserted: the order of the later flag
        last[name] = enabled
    return [n for n, on in last.items() if on], [n for n, on in last.items() if not on]


def check_hook_api(plugin: Plugin) -> None:
    """Refuse a plugin written against an incompatible version of the hook contract."""
    declared = getattr(plugin.obj, "AGL_HOOK_API", None)
    if declared is None:
        raise PluginError(
            f"plugin {plugin.label} declares no AGL_HOOK_API; "
            f"set AGL_HOOK_API = {HOOK_API_VERSION!r} in the plugin module"
        )
    # A string only: as a float, 1.10 would read as 1.1.
    found = HOOK_API_FORMAT.match(declared.strip()) if isinstance(declared, str) else None
    if found is None:
        raise PluginError(
            f"plugin {plugin.label}: AGL_HOOK_API = {declared!r} is not a hook API version; "
            f"write it as the string 'MAJOR.MINOR' of the agl_core it was written for, "
            f"e.g. AGL_HOOK_API = {HOOK_API_VERSION!r} (this agl_core's)"
        )
    major, minor = int(found[1]), int(found[2])
    core_major, core_minor = (int(part) for part in HOOK_API_VERSION.split("."))
    if major != core_major or minor > core_minor:
        raise PluginError(
            f"plugin {plugin.label} was written for agl_core hook API {declared}, "
            f"this agl_core provides hook API {HOOK_API_VERSION}"
        )


def validate_hookimpls(plugin: Plugin, manager: pluggy.PluginManager) -> list[str]:
    """Check every hook implementation of ``plugin`` against the contract; return the hook names.

    Refused: a hook name the contract does not declare (with the closest
    one), an argument the hook does not declare, an ``async def``
    implementation (every hook is sync), a wrapper that is not a generator
    function, and ``tryfirst``/``trylast`` on a slot's implementation (one
    implementation is called; the recipe chooses it with ``plugins.slots``).
    Fills ``plugin.impls`` and ``plugin.wrappers``, and ``plugin.warnings``
    with each function named like a hook that lacks ``@hookimpl`` (pluggy
    would ignore it silently). The returned names are the hooks it implements,
    wrappers apart.
    """
    implemented, wrappers, impls = [], [], {}
    for attr in dir(plugin.obj):
        opts = manager.parse_hookimpl_opts(plugin.obj, attr)
        if opts is None:
            continue
        fn = getattr(plugin.obj, attr)
        hook_name = opts.get("specname") or attr
        if hook_name not in HOOK_KINDS:
            raise PluginError(
                f"plugin {plugin.label} implements unknown hook {hook_name!r}"
                f"{did_you_mean(hook_name, HOOK_KINDS)}; known hooks: {', '.join(sorted(HOOK_KINDS))}"
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
        if opts.get("wrapper") or opts.get("hookwrapper"):
            if not inspect.isgeneratorfunction(fn):
                raise PluginError(
                    f"plugin {plugin.label}: the wrapper of hook {hook_name!r} is not a generator function; "
                    f"it must 'yield' exactly once (result = yield) around the call it wraps"
                )
            wrappers.append(hook_name)
            continue
        if HOOK_KINDS[hook_name] == SLOT and (opts.get("tryfirst") or opts.get("trylast")):
            which = "tryfirst" if opts.get("tryfirst") else "trylast"
            raise PluginError(
                f"plugin {plugin.label}: hook {hook_name!r} is a slot (one implementation is called), so "
                f"{which} has no meaning there; the recipe chooses the slot's plugin with "
                f"plugins.slots.{hook_name}=<name>"
            )
        implemented.append(hook_name)
        impls[hook_name] = fn
    plugin.wrappers, plugin.impls = sorted(wrappers), impls
    plugin.warnings = unmarked_hooks(plugin.obj, manager)
    return sorted(implemented)


def unmarked_hooks(obj: Any, manager: pluggy.PluginManager) -> list[str]:
    """A warning for each function of ``obj`` named like a hook but not marked with ``@hookimpl``.

    Only functions defined where the plugin is (the module itself, or the
    module of the plugin object's class) count, so an imported helper or an
    inherited library method that happens to share a hook's name
    (``validate``) is not reported.
    """
    own_module = obj.__name__ if inspect.ismodule(obj) else type(obj).__module__
    found = []
    for name in sorted(HOOK_KINDS):
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn) or manager.parse_hookimpl_opts(obj, name) is not None:
            continue
        if getattr(fn, "__module__", None) != own_module:
            continue
        if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            continue
        found.append(f"function {name!r} is named like the hook {name!r} but is not marked "
                     f"@hookimpl, so it is never called; decorate it with @agl_core.hookimpl")
    return found


def discover() -> list[importlib_metadata.EntryPoint]:
    """The entry points of group ``agl_core.plugins``, one per name (first one wins)."""
    seen: dict[str, importlib_metadata.EntryPoint] = {}
    for ep in importlib_metadata.entry_points(group=ENTRY_POINT_GROUP):
        seen.setdefault(ep.name, ep)
    return sorted(seen.values(), key=lambda ep: ep.name)


def distribution_of(ep: importlib_metadata.EntryPoint) -> tuple[str | None, str | None]:
    """(name, version) of the distribution an entry point comes from; (None, None) when its metadata is unreadable
    (a distribution being installed or removed at this moment must not break the CLI)."""
    try:
        dist = ep.dist
        return (dist.name, dist.version) if dist is not None else (None, None)
    except Exception:  # noqa: BLE001 - importlib_metadata raises several kinds for a broken dist-info
        return None, None


class PluginSet:
    """The plugins of one run: which are active, and the hook implementations they bring."""

    def __init__(self, plugins: list[Plugin], manager: pluggy.PluginManager):
        self.plugins = {p.name: p for p in plugins}
        self.manager = manager
        wrapped = {hook for p in plugins if p.status == "active" for hook in p.wrappers if hook in RESULT_CHECKS}
        self.inner_results = InnerResults(sorted(wrapped))
        if wrapped:  # registered last, so it is the innermost wrapper of each call
            manager.register(self.inner_results, name=InnerResults.NAME)
        self.settings: dict[str, Any] = {}
        """Plugin name → its validated recipe section, filled when a recipe is validated against this set."""

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
            plugin = Plugin(ep.name, *distribution_of(ep))
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
                plugin.traceback = traceback.format_exc()
                continue
            cls._admit(plugin, manager, active=plugin.name in enable or not plugin.opt_in)
        for name, obj in extra:
            plugin = Plugin(name, None, None, obj=obj)
            plugins.append(plugin)
            if name not in disable:
                cls._admit(plugin, manager, active=True)
        pset = cls(plugins, manager)
        pset._check_enabled(enable)
        if env_flag(TRACE_ENV):
            trace_hooks(manager)
        return pset

    @staticmethod
    def _admit(plugin: Plugin, manager: pluggy.PluginManager, active: bool) -> None:
        try:
            if plugin.name in RESERVED_NAMES:
                raise PluginError(f"plugin {plugin.label} uses the reserved name {plugin.name!r}")
            check_hook_api(plugin)
            plugin.hooks = validate_hookimpls(plugin, manager)
            if active:
                manager.register(plugin.obj, name=plugin.name)
        except (PluginError, ValueError, pluggy.PluginValidationError) as exc:
            plugin.status, plugin.reason = "failed", str(exc)
            return
        if active:
            plugin.status = "active"
            for warning in plugin.warnings:
                log.warning("plugin %s: %s", plugin.label, warning)

    def _check_enabled(self, enable: list[str]) -> None:
        for name in enable:
            plugin = self.plugins.get(name)
            if plugin is None:
                known = ", ".join(sorted(self.plugins)) or "none"
                raise PluginError(
                    f"plugin {name!r} is enabled but not installed{did_you_mean(name, self.plugins)} "
                    f"(installed plugins: {known})"
                )
            if plugin.status == "failed":
                raise PluginError(f"plugin {plugin.label} is enabled but failed: {plugin.reason}")
            if plugin.status == "disabled":
                raise PluginError(f"plugin {plugin.label} is both enabled and disabled")

    # ----------------------------------------------------------------- dispatch

    def implementations(self, hook: str) -> list[tuple[str, "HookCall"]]:
        """(plugin name, call) of every active implementation of ``hook`` that is not a wrapper.

        In the order a broadcast calls them: ``tryfirst`` ones first, ``trylast``
        ones last, the rest in registration order. Each :class:`HookCall` goes
        through pluggy, so the hook's wrappers wrap it.
        """
        impls = sorted(self._impls(hook), key=_tier)
        return [(impl.plugin_name, HookCall(self, hook, impl.plugin_name)) for impl in impls]

    def _impls(self, hook: str) -> list[pluggy.HookImpl]:
        """pluggy's active implementations of ``hook``, wrappers left out."""
        return [impl for impl in getattr(self.manager.hook, hook).get_hookimpls() if not _is_wrapper(impl)]

    def caller(self, hook: str, plugin: str) -> pluggy.HookCaller:
        """pluggy's caller of ``hook`` that reaches ``plugin``'s implementation and every wrapper of the hook.

        ``PluginManager.subset_hook_caller`` without the plugins that implement
        the hook otherwise, so wrappers, ``tryfirst``/``trylast`` among
        wrappers, and hook-call monitoring hold. A plugin that both implements
        and wraps the same hook (``specname``) wraps only its own calls.
        """
        others = [impl.plugin for impl in self._impls(hook) if impl.plugin_name != plugin]
        return self.manager.subset_hook_caller(hook, others)

    def call(self, hook: str, plugin: str, **kwargs: Any) -> Any:
        """Call ``plugin``'s implementation of ``hook`` through pluggy and check what it returned.

        Every argument of the hook is passed by keyword (pluggy hands each
        implementation the ones it declares). A result of the wrong kind
        (a stage returning ``None``, an ``advantage`` without ``advantages``)
        is a :class:`PluginError` naming the plugin, the hook and what was
        expected.
        """
        caller = self.caller(hook, plugin)
        if hook in self.inner_results.hooks:
            with self.inner_results.recording() as inner:
                result = caller(**kwargs)
        else:
            result, inner = caller(**kwargs), []
        problem = result_problem(hook, result, kwargs)
        if problem is None:
            return result
        if inner and result is not inner[0] and result_problem(hook, inner[0], kwargs) is None:
            wrappers = self.wrappers_of(hook)
            raise PluginError(
                f"{'the wrapper' if len(wrappers) == 1 else 'a wrapper'} of hook {hook!r} "
                f"({', '.join(self.label(name) for name in wrappers)}) replaced the result of plugin "
                f"{self.label(plugin)}: it {problem}; a wrapper returns what its 'result = yield' gave it, "
                f"or a result of the same kind")
        raise PluginError(f"plugin {self.label(plugin)}: hook {hook!r} {problem}")

    def wrappers_of(self, hook: str) -> list[str]:
        """Names of the active plugins that wrap ``hook``, outermost first (the core's own probe left out)."""
        impls = getattr(self.manager.hook, hook).get_hookimpls()
        return [impl.plugin_name for impl in reversed(impls)
                if _is_wrapper(impl) and impl.plugin_name != InnerResults.NAME]

    def label(self, name: str) -> str:
        plugin = self.plugins.get(name)
        return plugin.label if plugin is not None else repr(name)

    def resolve_slot(self, hook: str, choice: str | None = None,
                     required: bool = True) -> tuple[str, "HookCall"] | None:
        """(plugin name, call) of the one implementation that fills slot ``hook``.

        ``choice`` is the recipe's ``plugins.slots.<hook>``. Without a choice,
        a single candidate the recipe enabled (third-party or opt-in built-in)
        wins over the default built-ins. An empty slot is an error when
        ``required``, else None.
        """
        assert HOOK_KINDS[hook] == SLOT, f"{hook} is not a slot"
        candidates = dict(self.implementations(hook))
        if choice is not None:
            if choice not in candidates:
                hint = did_you_mean(choice, candidates) or did_you_mean(choice, self.plugins)
                raise PluginError(
                    f"plugins.slots.{hook} names {choice!r}, which does not implement it{hint}; "
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

    def pipeline(self, hook: str, order: list[str] | None = None) -> list[tuple[str, "HookCall"]]:
        """The stages of pipeline ``hook`` in the order they run.

        ``order`` is the recipe's ``plugins.order.<hook>``: when given it must
        name every active implementation exactly once. Otherwise stages marked
        ``tryfirst`` run first and ``trylast`` last, each group by the plugin's
        ``AGL_ORDER``, then name.
        """
        assert HOOK_KINDS[hook] == PIPELINE, f"{hook} is not a pipeline"
        stages = dict(self.implementations(hook))
        if order is None:
            tier = {impl.plugin_name: _tier(impl) for impl in self._impls(hook)}
            return sorted(stages.items(), key=lambda s: (tier[s[0]], self.plugins[s[0]].order, s[0]))
        if sorted(order) != sorted(stages):
            unknown = "".join(f"; {name!r} is not one{did_you_mean(name, stages)}" for name in order
                              if name not in stages)
            raise PluginError(
                f"plugins.order.{hook} lists {order}, but the active stages are {sorted(stages)}{unknown}; "
                f"list each exactly once"
            )
        return [(name, stages[name]) for name in order]

    def broadcast(self, hook: str, **kwargs: Any) -> dict[str, Any]:
        """Call every active implementation of broadcast ``hook`` (see :meth:`implementations`); results by plugin.

        Each plugin's implementation is its own pluggy call, so a wrapper
        wraps each of them; the first one that raises stops the broadcast.
        """
        assert HOOK_KINDS[hook] == BROADCAST, f"{hook} is not a broadcast"
        return {name: self.call(hook, name, **kwargs) for name, _ in self.implementations(hook)}

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


class InnerResults:
    """The innermost wrapper of each checked hook that a plugin wraps: it keeps what the implementation itself
    returned, so that a bad result is blamed on the wrapper that made it, not on the plugin it wrapped.

    Registered after every plugin with ``trylast``, which makes it the innermost wrapper (pluggy calls the
    wrappers registered later in a tier closer to the implementation). :meth:`recording` collects, per thread,
    the inner result of the call made inside it (a hook called from within the call records into its own).
    """

    NAME = "agl_core.inner_results"

    def __init__(self, hooks: list[str]):
        self.hooks = frozenset(hooks)
        self._local = threading.local()
        for hook in hooks:
            setattr(self, f"record_{hook}", hookimpl(wrapper=True, trylast=True, specname=hook)(self._recorder()))

    def _recorder(self) -> Callable:
        local = self._local

        def record():
            result = yield
            stack = getattr(local, "stack", None)
            if stack:
                stack[-1].append(result)
            return result

        return record

    @contextlib.contextmanager
    def recording(self):
        """A list that holds the inner result of the one call made in the block (empty when no wrapper ran)."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append([])
        try:
            yield stack[-1]
        finally:
            stack.pop()


class HookCall:
    """One active plugin's implementation of one hook, called through pluggy (:meth:`PluginSet.call`).

    Called with the hook's arguments by keyword, or positionally in the
    order of the hook's specification. ``function`` is the implementation
    itself, for introspection; calling it directly would skip the wrappers.
    """

    __slots__ = ("plugins", "hook", "plugin")

    def __init__(self, plugins: PluginSet, hook: str, plugin: str):
        self.plugins, self.hook, self.plugin = plugins, hook, plugin

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:
            kwargs.update(zip(_argnames_in_order(getattr(hookspecs, self.hook)), args))
        return self.plugins.call(self.hook, self.plugin, **kwargs)

    @property
    def function(self) -> Callable:
        return self.plugins.plugins[self.plugin].impls[self.hook]

    def __repr__(self) -> str:
        return f"<HookCall {self.hook} of plugin {self.plugin!r}>"


def _is_wrapper(impl: pluggy.HookImpl) -> bool:
    return bool(impl.wrapper or impl.hookwrapper)


def _tier(impl: pluggy.HookImpl) -> int:
    """Where ``tryfirst``/``trylast`` put an implementation: 0 first, 1 unmarked, 2 last."""
    return 0 if impl.tryfirst else 2 if impl.trylast else 1


@functools.lru_cache(maxsize=None)
def _argnames_in_order(fn: Callable) -> tuple[str, ...]:
    return tuple(inspect.signature(fn).parameters)


@functools.lru_cache(maxsize=None)
def _argnames(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def accepts(fn: Callable, name: str) -> bool:
    """Whether ``fn`` can be called with the keyword argument ``name`` (a parameter of that name, or ``**kwargs``)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: positional use only
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def call(fn: Callable, kwargs: dict[str, Any]) -> Any:
    """Call a hook implementation with the subset of ``kwargs`` it accepts.

    A :class:`HookCall` (what slots, pipelines and :meth:`PluginSet.implementations`
    hold) gets them all and goes through pluggy, wrappers included.
    """
    if isinstance(fn, HookCall):
        return fn(**kwargs)
    accepted = _argnames(fn)
    return fn(**{k: v for k, v in kwargs.items() if k in accepted})


# --------------------------------------------------------------------------
# What each hook must return
# --------------------------------------------------------------------------


def _is_batch(value: Any) -> bool:
    # A Batch exists only once agl_core.data was imported: no import (of torch) here just to check.
    data = sys.modules.get("agl_core.data")
    return data is not None and isinstance(value, data.Batch)


def _has_response_columns(*names: str) -> Callable[[Any, dict[str, Any]], str | None]:
    def check(batch: Any, kwargs: dict[str, Any]) -> str | None:
        if not _is_batch(batch):
            return f"returned {_kind_of(batch)}, expected the Batch with {' and '.join(names)}"
        shape = tuple(batch["responses"].shape) if "responses" in batch else None
        for name in names:
            if name not in batch:
                return f"returned a Batch without {name!r}, expected the Batch with {' and '.join(names)}"
            got = tuple(getattr(batch[name], "shape", ()))
            if shape is not None and got != shape:
                return f"returned {name!r} of shape {got}, expected the shape of 'responses' {shape}"
        return None

    return check


def _returns(description: str, test: Callable[[Any], bool]) -> Callable[[Any, dict[str, Any]], str | None]:
    return lambda value, kwargs: None if test(value) else f"returned {_kind_of(value)}, expected {description}"


def _is_model_class(value: Any) -> bool:
    from pydantic import BaseModel

    return value is None or (isinstance(value, type) and issubclass(value, BaseModel))


RESULT_CHECKS: dict[str, Callable[[Any, dict[str, Any]], str | None]] = {
    "plugin_config_schema": _returns("a pydantic BaseModel subclass or None", _is_model_class),
    "policy_endpoints": _returns("a list of base URLs (str)",
                                 lambda v: isinstance(v, list) and all(isinstance(u, str) for u in v)),
    "collect_rollouts": _returns("a list of Rollout", lambda v: isinstance(v, list)),
    "post_process_batch": _returns("the Batch it was given (filtered or extended)", _is_batch),
    "compute_old_logprob": _has_response_columns("old_log_probs", "entropys"),
    "compute_ref_logprob": _has_response_columns("ref_log_prob"),
    "compute_values": _has_response_columns("values"),
    "advantage": _has_response_columns("advantages", "returns"),
    "update_critic": _returns("a dict of metrics", lambda v: isinstance(v, Mapping)),
    "update_actor": _returns("a dict of metrics", lambda v: isinstance(v, Mapping)),
    "validate": _returns("a dict of val/... metrics", lambda v: isinstance(v, Mapping)),
    "export_model": _returns("the directory it wrote (str) or None", lambda v: v is None or isinstance(v, str)),
}
"""Hook → check of an implementation's result: None when fine, else what is wrong (hooks not listed return None)."""


def result_problem(hook: str, result: Any, kwargs: dict[str, Any]) -> str | None:
    """What is wrong with ``result`` as the return value of ``hook``, or None."""
    check = RESULT_CHECKS.get(hook)
    return None if check is None else check(result, kwargs)


def _kind_of(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


# --------------------------------------------------------------------------
# Tracing
# --------------------------------------------------------------------------


def summarize(value: Any) -> str:
    """A short description of a hook's result for the trace: kind and size, never the content."""
    if value is None:
        return "None"
    if _is_batch(value):
        return f"Batch({len(value)} rows)"
    if isinstance(value, Mapping):
        keys = list(value)
        return f"dict({len(keys)} keys: {', '.join(map(str, keys[:3]))}{', ...' if len(keys) > 3 else ''})"
    if isinstance(value, (list, tuple, set)):
        return f"{type(value).__name__}({len(value)})"
    if isinstance(value, type):
        return value.__name__
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def trace_hooks(manager: pluggy.PluginManager, logger: logging.Logger = trace_log) -> Callable[[], None]:
    """Log every hook call of ``manager`` at INFO: hook, plugin, duration, a summary of the result.

    Through ``PluginManager.add_hookcall_monitoring``, so it sees each call
    the core makes (one implementation each, wrappers included). Calls on
    other threads (the runner's) are timed on their own. Returns pluggy's undo
    function.
    """
    started = threading.local()

    def before(hook_name, hook_impls, kwargs):
        stack = getattr(started, "stack", None)
        if stack is None:
            stack = started.stack = []
        stack.append(time.perf_counter())

    def after(outcome, hook_name, hook_impls, kwargs):
        elapsed_ms = (time.perf_counter() - started.stack.pop()) * 1e3
        owners = [impl.plugin_name for impl in hook_impls if not _is_wrapper(impl)]
        wrapped = [impl.plugin_name for impl in hook_impls
                   if _is_wrapper(impl) and impl.plugin_name != InnerResults.NAME]
        result = (f"raised {type(outcome.exception).__name__}: {outcome.exception}"
                  if outcome.exception is not None else summarize(outcome.get_result()))
        logger.info("hook %s [%s]%s %.2f ms -> %s", hook_name, ", ".join(owners) or "-",
                    f" wrapped by {', '.join(wrapped)}" if wrapped else "", elapsed_ms, result)

    return manager.add_hookcall_monitoring(before, after)
