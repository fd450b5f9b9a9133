"""The ``agl`` command: train, plugins, config show, doctor, export, plot, show, serve store|gateway, runner, new-plugin.

Options, ``-p`` flags and ``key=value`` overrides may come in any order after
the subcommand (``agl train RECIPE -p NAME key=value`` or ``agl train -p NAME
RECIPE key=value``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import signal
import sys
from importlib import metadata
from pathlib import Path

from agl_core import HOOK_API_VERSION, __version__
from agl_core.config import ConfigError, load, resolved, to_yaml
from agl_core.plugins import HOOK_KINDS, TRACE_ENV, PluginError, PluginSet, did_you_mean, parse_plugin_flags


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO (the agents' model calls, the trainer's calls to services): ours stay readable.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except (ConfigError, PluginError, ValueError) as exc:
        print(f"agl: error: {exc}", file=sys.stderr)
        return 2


class DefaultsHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help that shows each option's default where it has one (not None, False or empty) and does not say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
                and "default" not in text):
            text += " (default: %(default)s)"
        return text


class IntermixedParser(argparse.ArgumentParser):
    """A (sub)command parser whose options and positionals may come in any order.

    argparse matches ``RECIPE`` and ``overrides`` (``nargs="*"``) in one go,
    so a ``-p NAME`` between them left ``key=value`` unrecognized; the
    intermixed parse reads the options first. A parser with subcommands of its
    own (``config``, ``serve``) parses as usual: its subcommand's parser is
    intermixed.
    """

    _intermixing = False

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)  # subcommands' parsers are of this class too
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        has_subcommands = any(isinstance(a, argparse._SubParsersAction) for a in self._actions)
        if self._intermixing or has_subcommands:
            return super().parse_known_args(args, namespace)
        self._intermixing = True  # parse_known_intermixed_args calls parse_known_args itself
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


def build_parser() -> argparse.ArgumentParser:
    parser = IntermixedParser(prog="agl", description="Train LLM agents with reinforcement learning.")
    parser.add_argument("--version", action="version", version=f"agl_core {__version__}")
    plugin_flag = argparse.ArgumentParser(add_help=False)
    plugin_flag.add_argument("-p", dest="plugin_flags", action="append", default=[], metavar="NAME",
                             help="enable plugin NAME; -p no:NAME disables it (built-ins too)")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    train = sub.add_parser("train", parents=[plugin_flag], help="run a recipe")
    train.add_argument("recipe", help="YAML recipe")
    train.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_steps=50")
    train.add_argument("--trace-hooks", action="store_true",
                       help=f"log every hook call: plugin, duration, result (as {TRACE_ENV}=1 does)")
    train.set_defaults(run=cmd_train)

    plugins = sub.add_parser("plugins", parents=[plugin_flag], help="list installed plugins")
    plugins.add_argument("--json", action="store_true",
                         help="machine-readable output (with each hook's kind and the plugin's AGL_ORDER)")
    plugins.add_argument("--hook", help="only plugins implementing this hook")
    plugins.add_argument("-v", "--verbose", action="store_true",
                         help="show a failed plugin's import traceback and every warning")
    plugins.set_defaults(run=cmd_plugins)

    from agl_core.new_plugin import DEFAULT_HOOKS, TEMPLATED_HOOKS

    templated = "\n".join(f"  {hook:<24} {what}" for hook, what in TEMPLATED_HOOKS.items())
    new_plugin = sub.add_parser(
        "new-plugin", help="render a new plugin distribution from the template (needs copier: agl-core[plugin-dev])",
        epilog=f"hooks the template has a starting point for (NAME is the plugin's name):\n{templated}\n"
               f"A slot of the step (compute_old_logprob, ...) has none: add it by hand (docs/hooks.md).")
    new_plugin.add_argument("name", help="the plugin's name (its entry point)")
    new_plugin.add_argument("--hook", action="append", default=[], metavar="HOOK",
                            help=f"a hook the plugin implements (one of those listed below); repeatable "
                                 f"(default: {' '.join(DEFAULT_HOOKS)})")
    new_plugin.add_argument("-o", "--output", default=None, metavar="DIR", help="where to write the distribution")
    new_plugin.set_defaults(run=cmd_new_plugin)

    config = sub.add_parser("config", help="inspect recipes")
    config_sub = config.add_subparsers(required=True, metavar="ACTION")
    show = config_sub.add_parser("show", parents=[plugin_flag], help="print the resolved recipe with defaults")
    show.add_argument("recipe")
    show.add_argument("overrides", nargs="*")
    show.set_defaults(run=cmd_config_show)

    doctor = sub.add_parser("doctor", parents=[plugin_flag],
                            help="versions, registered components and their plugins, and which plugin fills each slot")
    doctor.add_argument("recipe", nargs="?")
    doctor.add_argument("overrides", nargs="*")
    doctor.set_defaults(run=cmd_doctor)

    export = sub.add_parser("export", parents=[plugin_flag],
                            help="write a run's trained policy as a model (--merged: a plain Hugging Face model)")
    export.add_argument("run_dir", help="run directory (its latest checkpoint is exported), or one of its checkpoints")
    export.add_argument("overrides", nargs="*", help="key=value overrides of the run's recipe")
    target = export.add_mutually_exclusive_group(required=True)
    target.add_argument("--merged", metavar="OUT",
                        help="write a model that loads on its own (e.g. a LoRA adapter folded into its base)")
    target.add_argument("--out", metavar="OUT", help="write the policy in its plugin's own format (e.g. the adapter)")
    export.add_argument("--policy", metavar="NAME", help="in a run of several policies: the one to write (--out "
                                                         "without it writes each, in OUT/<name>)")
    export.set_defaults(run=cmd_export)

    serve = sub.add_parser("serve", help="run a service of the rollout plane in this process (docs/scaling-out.md)")
    services = serve.add_subparsers(required=True, metavar="SERVICE")
    store = services.add_parser("store", help="the rollout store over HTTP, backed by an SQLite file")
    store.add_argument("--db", required=True, help="the SQLite file (created if missing)")
    _service_flags(store, token_env="AGL_STORE_TOKEN")
    store.set_defaults(run=cmd_serve_store)
    gateway = services.add_parser("gateway", help="the gateway agents call, recording into a store service")
    gateway.add_argument("--store", required=True, metavar="URL", help="the store service's URL")
    gateway.add_argument("--store-token", help="bearer token of the store service (default: $AGL_STORE_TOKEN)")
    gateway.add_argument("--upstream", action="append", default=[], metavar="URL",
                         help="a policy server's base URL (…/v1); repeatable. The trainer sets them each step")
    gateway.add_argument("--policy", action="append", default=[], metavar="NAME", dest="policies",
                         help="a policy of the run (its recipe's policies section); repeatable. Calls are routed "
                              "by model name or role to one of them (docs/multi-policy.md)")
    gateway.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                         help="a rollout.gateway setting, e.g. --config max_n=16; repeatable")
    _service_flags(gateway, token_env="AGL_GATEWAY_TOKEN")
    gateway.set_defaults(run=cmd_serve_gateway)

    runner = sub.add_parser("runner", help="run agents on rollouts leased from a store service, calling a gateway")
    runner.add_argument("--store", required=True, metavar="URL", help="the store service's URL")
    runner.add_argument("--store-token", help="bearer token of the store service (default: $AGL_STORE_TOKEN)")
    runner.add_argument("--gateway", required=True, metavar="URL", help="the gateway's URL")
    runner.add_argument("--gateway-token", help="bearer token of the gateway (default: $AGL_GATEWAY_TOKEN)")
    runner.add_argument("--agent", required=True, help="the agent: 'package.module:function' or a registered name")
    runner.add_argument("--workers", type=int, default=8, help="agent workers (threads) of this runner")
    runner.add_argument("--model", default="policy", help="model name agents are given (llm.model)")
    runner.add_argument("--timeout-s", type=float, default=600.0, help="time an attempt may take (rollout.timeout_s)")
    runner.add_argument("--lease-s", type=float, default=30.0, help="lease of a running attempt (rollout.lease_s)")
    runner.add_argument("--connect-timeout-s", type=float, default=60.0,
                        help="how long to keep retrying a store or gateway that does not answer before exiting")
    runner.add_argument("--drain-s", type=float, default=30.0,
                        help="on SIGINT/SIGTERM, time the running attempts get to end (the rest are requeued)")
    runner.set_defaults(run=cmd_runner)

    plot = sub.add_parser("plot", help="draw a run's curves (reward, KL, entropy, ...) into a PNG")
    plot.add_argument("run_dir", help="run directory (trainer.run_dir) holding metrics.jsonl")
    plot.add_argument("-o", "--out", help="PNG to write (default: RUN_DIR/curves.png)")
    plot.set_defaults(run=cmd_plot)

    rows = sub.add_parser("show", help="print a few trained rows of a step: prompt, response, reward, advantage "
                                       "(written by the samples plugin)")
    rows.add_argument("run_dir", help="run directory (trainer.run_dir) of a run with plugins.samples")
    rows.add_argument("--step", type=int, default=None, help="the step (default: the last one written)")
    rows.add_argument("-n", "--rows", type=int, default=3, help="rows to print")
    rows.set_defaults(run=cmd_show)
    return parser


def _service_flags(parser: argparse.ArgumentParser, token_env: str) -> None:
    """Where a service listens and the token it requires (the rules of agl_core.http_rules)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs a token")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one; the URL is printed)")
    parser.add_argument("--token", help=f"bearer token callers must send (default: ${token_env})")


def cmd_train(args) -> int:
    """Run the recipe. SIGINT (Ctrl-C) and SIGTERM stop it the same clean way: once the running step
    ends (a second signal: at once), every plugin's ``on_train_end`` runs, the run directory is released,
    and the exit code is 128 + the signal."""
    from agl_core.checkpoint import latest_checkpoint
    from agl_core.loop import Trainer
    from agl_core.stop import Interrupted, raise_interrupted

    if args.trace_hooks:
        os.environ[TRACE_ENV] = "1"  # read when the plugin set is loaded
    signal.signal(signal.SIGTERM, raise_interrupted)  # until the trainer exists: stop at once
    trainer = None
    try:
        recipe, plugins = load(args.recipe, args.overrides, args.plugin_flags)
        trainer = Trainer(recipe, plugins)
        trainer.stop.install()
        trainer.fit()
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        if trainer is None:
            print(f"agl: interrupted by {signal.Signals(signum).name} before training began", file=sys.stderr)
            return 128 + signum
        last = latest_checkpoint(trainer.ctx.run_dir)
        then = (f"continue from its last checkpoint ({last.name}) with trainer.resume=auto" if last is not None
                else "it wrote no checkpoint yet (trainer.save_freq), so a rerun starts over")
        print(f"agl: interrupted by {signal.Signals(signum).name} at step {trainer.ctx.step} of "
              f"{trainer.ctx.run_dir}; {then}", file=sys.stderr)
        return 128 + signum
    return 0


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


def cmd_new_plugin(args) -> int:
    from agl_core.new_plugin import main as new_plugin

    return new_plugin(args)


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


def check_export_policy(recipe, policy: str | None, merged: bool) -> None:
    """ValueError when ``--policy`` names no policy of the run, or a merge of several policies names none."""
    names = ", ".join(recipe.policies)
    if policy is not None and policy not in recipe.policies:
        raise ValueError(f"--policy {policy!r}: the run's policies are {names or 'none (it has one policy)'}")
    if merged and policy is None and recipe.policies:
        raise ValueError(f"the run has several policies ({names}): name the one to merge with --policy NAME")


def cmd_export(args) -> int:
    """Ask the plugins of the run's recipe to export its checkpoint; exactly one must (hook ``export_model``)."""
    from agl_core.checkpoint import locate
    from agl_core.components import Components
    from agl_core.context import TrainContext

    given = Path(args.run_dir)
    run_dir, checkpoint = locate(given)
    recipe_file = run_dir / "config.yaml"
    if not recipe_file.is_file():
        raise ValueError(f"{given} is not a run directory or a checkpoint of one: {recipe_file} does not exist")
    if checkpoint is None:
        raise ValueError(f"the run directory {run_dir} holds no complete checkpoint to export "
                         f"(checkpoints are written every trainer.save_freq steps and at the end)")
    out = Path(args.merged or args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty directory; choose a new one")
    recipe, plugins = load(recipe_file, args.overrides, args.plugin_flags)
    check_export_policy(recipe, args.policy, merged=args.merged is not None)
    ctx = TrainContext(recipe, plugins, Components.collect(plugins), run_dir)
    results = plugins.broadcast("export_model", ctx=ctx, path=str(checkpoint), out=str(out),
                                merged=args.merged is not None, policy=args.policy)
    exported = {name: result for name, result in results.items() if result is not None}
    if not exported:
        asked = ", ".join(results) or "none of the run's active plugins implements export_model"
        raise ValueError(f"no plugin of run {run_dir} can export its checkpoint {checkpoint.name} "
                         f"(asked: {asked}; installed exporters: "
                         f"{', '.join(plugins.providers('export_model')) or 'none'})")
    if len(exported) > 1:
        raise PluginError(f"plugins {', '.join(exported)} all exported {checkpoint} to {out}; "
                          f"disable all but one with -p no:NAME")
    (name, where), = exported.items()
    print(f"{where}  ({'merged' if args.merged else 'exported'} by plugin {name} from {checkpoint})")
    return 0


def cmd_serve_store(args) -> int:
    from agl_core.store_server import main as serve_store

    return serve_store(args)


def cmd_serve_gateway(args) -> int:
    from agl_core.gateway.service import main as serve_gateway

    return serve_gateway(args)


def cmd_runner(args) -> int:
    from agl_core.runner_service import main as run_runner

    return run_runner(args)


def cmd_plot(args) -> int:
    from agl_core.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def cmd_show(args) -> int:
    from agl_core.show import show

    show(args.run_dir, args.step, args.rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
