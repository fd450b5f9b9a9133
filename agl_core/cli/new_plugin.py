"""``agl new-plugin NAME [--hook HOOK ...] [-o DIR]``: a complete plugin distribution, rendered from a template.

The template (``agl_core/templates/plugin``, package data of agl-core) is a
copier template: pyproject with build system and entry point, the module with
``AGL_HOOK_API``, a settings model, a README, tests that pass as generated
(the plugin loads, passes the contract suite, trains one step) and a CI
workflow. Each hook asked for gets a working implementation to start from.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from agl_core import __version__
from agl_core.plugins import HOOK_KINDS, RESERVED_NAMES, did_you_mean

TEMPLATE = Path(__file__).parents[1] / "templates" / "plugin"
DEFAULT_HOOKS = ("register_estimators", "log_metrics")
TEMPLATED_HOOKS = {
    "register_estimators": "an advantage estimator NAME_baseline (reward minus its group's mean)",
    "register_policy_losses": "a policy loss NAME_clip (the PPO clipped objective)",
    "log_metrics": "a logger writing chosen metrics to a JSON-lines file (each step once, also after a resume)",
    "post_process_batch": "a filter stage dropping rows with too short a response",
    "on_train_start": "set-up with the validated settings",
    "on_step_start": "per-step state in ctx.state",
    "on_step_end": "a metric of its own added to the step's",
    "save_checkpoint": "its state written into checkpoints (with load_checkpoint, on_step_end, on_train_end)",
    "load_checkpoint": "its state read back on resume (with save_checkpoint, on_step_end, on_train_end)",
    "on_train_end": "release of its state",
}
"""The hooks the template implements, and what it writes for each."""
NAME_RULE = re.compile(r"^[a-z][a-z0-9_]*$")


class NewPluginError(ValueError):
    """The name, a hook or the output directory cannot make a plugin."""


def render(name: str, hooks: list[str], output: Path) -> Path:
    """Render the distribution of plugin ``name`` implementing ``hooks`` into ``output``; return ``output``.

    Raises :class:`NewPluginError` for a name that is not a plugin name, a
    hook the contract or the template does not know, or an output directory
    that exists and is not empty.
    """
    if not NAME_RULE.match(name):
        raise NewPluginError(f"plugin name {name!r}: use lower-case letters, digits and _, starting with a letter "
                             f"(it is the entry point, the recipe section plugins.{name} and -p {name})")
    if name in RESERVED_NAMES:
        raise NewPluginError(f"plugin name {name!r} is reserved in the recipe's plugins section "
                             f"({', '.join(sorted(RESERVED_NAMES))})")
    for hook in hooks:
        if hook not in HOOK_KINDS:
            raise NewPluginError(f"--hook {hook!r} is not a hook of agl_core{did_you_mean(hook, HOOK_KINDS)}; "
                                 f"hooks with a template: {', '.join(TEMPLATED_HOOKS)}")
        if hook not in TEMPLATED_HOOKS and hook != "plugin_config_schema":
            raise NewPluginError(
                f"--hook {hook!r}: the template has no starting point for a {HOOK_KINDS[hook]} hook like it; "
                f"generate with the hooks it knows ({', '.join(TEMPLATED_HOOKS)}) and add it by hand "
                f"(docs/hooks.md)")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise NewPluginError(f"{output} exists and is not an empty directory; choose another with -o DIR")
    try:
        import copier  # only this command needs the templating engine
    except ImportError:
        raise NewPluginError('agl new-plugin renders its template with copier, which is not installed: '
                             'pip install "agl-core[plugin-dev]" (copier and pytest; from a clone: '
                             'pip install -e ".[plugin-dev]")') from None
    hooks = list(dict.fromkeys(h for h in hooks if h != "plugin_config_schema"))  # the schema is always there
    copier.run_copy(str(TEMPLATE), output, data={
        "name": name, "hooks": hooks, "agl_core_version": ".".join(__version__.split(".")[:2]),
        "description": f"The agl_core plugin {name}",
        "hook_docs": {hook: TEMPLATED_HOOKS[hook].replace("NAME", name) for hook in hooks},
    }, defaults=True, quiet=True, unsafe=False, overwrite=True)
    return output


def main(args) -> int:
    """``agl new-plugin``: ``args.name``, ``args.hook`` (list, may be empty), ``args.output`` (None: ./agl-plugin-NAME)."""
    hooks = list(args.hook or DEFAULT_HOOKS)
    output = Path(args.output) if args.output else Path(f"agl-plugin-{args.name.replace('_', '-')}")
    render(args.name, hooks, output)
    module = f"agl_plugin_{args.name}"
    print(f"wrote {output}/ (plugin {args.name!r}, module {module}, hooks: {', '.join(hooks)})\n"
          f"next:\n  pip install -e {output}\n  python -m pytest {output}/tests\n"
          f"  agl train RECIPE -p {args.name}", file=sys.stdout)
    return 0


def cmd_new_plugin(args) -> int:
    return main(args)
