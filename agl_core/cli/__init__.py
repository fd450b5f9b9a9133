"""The ``agl`` command: train, plugins, config show, doctor, export, plot, show, serve store|gateway, runner,
new-plugin, and the commands installed distributions add (entry-point group ``agl_core.commands``).

Options, ``-p`` flags and ``key=value`` overrides may come in any order after
the subcommand (``agl train RECIPE -p NAME key=value`` or ``agl train -p NAME
RECIPE key=value``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import metadata

from agl_core import __version__
from agl_core.cli.new_plugin import cmd_new_plugin
from agl_core.cli.plugins import cmd_config_show, cmd_doctor, cmd_plugins
from agl_core.cli.serve import cmd_runner, cmd_serve_gateway, cmd_serve_store
from agl_core.cli.show import cmd_plot, cmd_show
from agl_core.cli.train import cmd_export, cmd_train
from agl_core.config import ConfigError
from agl_core.plugins import TRACE_ENV, PluginError


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

    from agl_core.cli.new_plugin import DEFAULT_HOOKS, TEMPLATED_HOOKS

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
    add_plugin_commands(sub)
    return parser


COMMANDS_GROUP = "agl_core.commands"
"""Entry-point group of commands other distributions add to ``agl`` (e.g. ``agl eval`` of agl-plugin-teachers)."""


def add_plugin_commands(sub) -> None:
    """Add the commands of the entry points of :data:`COMMANDS_GROUP`: each is a function ``register(subparsers)``
    that adds a parser named like the entry point, with ``set_defaults(run=fn)``. One that fails to load, or
    takes a built-in's name, is reported on stderr and left out; the others work."""
    for entry in metadata.entry_points(group=COMMANDS_GROUP):
        if entry.name in sub.choices:
            print(f"agl: {entry.value} adds the command {entry.name!r}, which agl has already; left out",
                  file=sys.stderr)
            continue
        try:
            entry.load()(sub)
        except Exception as exc:  # noqa: BLE001 - one broken distribution never bricks the CLI
            print(f"agl: the command {entry.name!r} ({entry.value}) could not be added: {exc!r}", file=sys.stderr)


def _service_flags(parser: argparse.ArgumentParser, token_env: str) -> None:
    """Where a service listens and the token it requires (the rules of agl_core.http.rules)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs a token")
    parser.add_argument("--port", type=int, default=0, help="port to bind (0: a free one; the URL is printed)")
    parser.add_argument("--token", help=f"bearer token callers must send (default: ${token_env})")
    parser.add_argument("--max-connections", type=int, default=1024,
                        help="connections served at once; one more is answered 503 and closed (docs/reliability.md)")
