"""``agl`` commands: plugins, doctor, config show."""

from __future__ import annotations

import json
import platform
from importlib import metadata

from agl_core import HOOK_API_VERSION, __version__
from agl_core.config import load, resolved, to_yaml
from agl_core.plugins import HOOK_KINDS, PluginError, PluginSet, did_you_mean, parse_plugin_flags


def cmd_plugins(args) -> int:
    """List the installed plugins: status, hooks, wrappers, warnings (``--verbose``: import tracebacks)."""
    if args.hook is not None and args.hook not in HOOK_KINDS:
        raise PluginError(f"--hook {args.hook!r}: no such hook{did_you_mean(args.hook, HOOK_KINDS)}; "
                          f"hooks: {', '.join(sorted(HOOK_KINDS))}")
    enable, disable = parse_plugin_flags(args.plugin_flags)
    pset = PluginSet.load(enable=enable, disable=disable)
    rows = [
        {"name": p.name, "distribution": p.distribution, "version": p.version, "status": p.status,
         "builtin": p.builtin, "hooks": p.hooks, "hook_kinds": {hook: HOOK_KINDS[hook] for hook in p.hooks},
         "wrappers": p.wrappers, "order": p.order if p.obj is not None else None,
         "warnings": p.warnings, "reason": p.reason, "traceback": p.traceback}
        for p in pset.plugins.values()
        if args.hook is None or args.hook in p.hooks or args.hook in p.wrappers
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"agl_core plugins (hook API {HOOK_API_VERSION})")
    for column in ("name", "distribution", "version", "status", "hooks"):
        table.add_column(column)
    for row in rows:
        status = row["status"] + (f": {row['reason']}" if row["reason"] and row["status"] != "active" else "")
        hooks = ", ".join(row["hooks"] + [f"{hook} (wrapper)" for hook in row["wrappers"]])
        if row["warnings"]:
            status += f" ({len(row['warnings'])} warning{'s' * (len(row['warnings']) > 1)})"
        table.add_row(row["name"], row["distribution"] or "", row["version"] or "", status, hooks)
    console = Console(width=160)
    console.print(table)
    for row in rows:
        for warning in row["warnings"]:
            console.print(f"warning: plugin {row['name']}: {warning}", markup=False, highlight=False)
        if args.verbose and row["traceback"]:
            console.print(f"\nplugin {row['name']} failed to import:\n{row['traceback']}", markup=False,
                          highlight=False)
    if not args.verbose and any(row["traceback"] for row in rows):
        console.print("(agl plugins --verbose shows the import tracebacks)", markup=False, highlight=False)
    return 0


def cmd_config_show(args) -> int:
    recipe, _ = load(args.recipe, args.overrides, args.plugin_flags)
    print(to_yaml(resolved(recipe)), end="")
    return 0


def cmd_doctor(args) -> int:
    """Versions; the registered components with their plugins; with a recipe, who fills each slot."""
    from agl_core.components import Components

    print(f"python     {platform.python_version()}")
    print(f"agl_core   {__version__} (hook API {HOOK_API_VERSION})")
    for dist in ("torch", "verl", "ray", "transformers", "tensordict", "pluggy", "pydantic", "omegaconf"):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{dist:<10} {version}")
    if args.recipe is None:
        recipe = None
        enable, disable = parse_plugin_flags(args.plugin_flags)
        plugins = PluginSet.load(enable=enable, disable=disable)
    else:
        recipe, plugins = load(args.recipe, args.overrides, args.plugin_flags)
    components = Components.collect(plugins)
    print_components(components, plugins)
    if recipe is None:
        return 0
    from agl_core.wiring import needed_slots

    needed, _, _ = needed_slots(recipe, components, validates=True)
    print(f"\nrecipe {args.recipe}\nslots:")
    problems = 0
    for hook in sorted(h for h, kind in HOOK_KINDS.items() if kind == "slot"):
        try:
            resolved_slot = plugins.resolve_slot(hook, recipe.plugins.slots.get(hook), required=False)
            text = resolved_slot[0] if resolved_slot else "(empty)"
        except PluginError as exc:
            resolved_slot, text = None, f"AMBIGUOUS: {exc}"
        missing = hook in needed and resolved_slot is None
        problems += missing
        print(f"  {hook:<22} {text}{'   <- needed by this recipe' if missing else ''}")
    stages = plugins.pipeline("post_process_batch", recipe.plugins.order.get("post_process_batch"))
    print("post_process_batch pipeline: " + (" -> ".join(n for n, _ in stages) or "(empty)"))
    return 1 if problems else 0


DOCTOR_KINDS = (("estimator", "estimators"), ("policy_loss", "policy losses"), ("aggregator", "aggregators"),
                ("store", "stores"), ("actor_transform", "actor transforms"))


def print_components(components, plugins: PluginSet) -> None:
    """Each registered component and logger with the plugin that provides it; inactive providers marked."""
    from agl_core.components import REGISTRATION_HOOKS, offered_names

    for kind, title in DOCTOR_KINDS:
        print(f"\n{title}:")
        rows = [(c.name, c.plugin) for c in components.all(kind)]
        for plugin in plugins.plugins.values():
            if plugin.status == "active":
                continue
            for name in offered_names(plugin, REGISTRATION_HOOKS[kind]):
                rows.append((name, f"{plugin.name} (not active: -p {plugin.name})"))
        print_rows(sorted(rows) or [("(none)", "")])
    print("\nloggers (log_metrics):")
    active = {name for name, _ in plugins.implementations("log_metrics")}
    for name in plugins.providers("log_metrics"):
        print(f"  {name}{'' if name in active else f' (not active: -p {name})'}")
    print("\nwrappers (outermost first):")
    wrapped = sorted({hook for plugin in plugins.plugins.values() for hook in plugin.wrappers})
    rows = []
    for hook in wrapped:
        active_wrappers = plugins.wrappers_of(hook)
        inactive = [f"{p.name} (not active: -p {p.name})" for p in plugins.plugins.values()
                    if hook in p.wrappers and p.name not in active_wrappers]
        rows.append((hook, ", ".join(active_wrappers + inactive)))
    print_rows(rows or [("(none)", "")])


def print_rows(rows: list[tuple[str, str]]) -> None:
    """Two columns, the first as wide as its longest entry."""
    width = max(len(name) for name, _ in rows)
    for name, owner in rows:
        print(f"  {name:<{width}}  {owner}".rstrip())
