"""``agl`` commands: train, export."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from agl_core.config import load
from agl_core.plugins import TRACE_ENV, PluginError


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
