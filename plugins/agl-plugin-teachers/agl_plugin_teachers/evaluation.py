"""``agl eval``: how good is a policy on a recipe's tasks — a checkpoint, the recipe's own model, or any
OpenAI-compatible endpoint (a base model, an API model).

It runs the recipe's agent through the recipe's own rollout plane (its
``collect_rollouts`` slot: the local runner, gateway and store by default)
against the chosen policy, ``--n`` rollouts per task, and writes one JSON line
per rollout (task, sample, status, reward, tokens, error) to ``-o OUT`` and a
summary beside it (``OUT`` with ``.summary.json``): mean reward, pass@k,
tokens, failures. ``agl eval --compare A B`` prints two result files side by
side. Nothing is trained; the run directory is a temporary one.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BACKEND_SLOTS = ("policy_endpoints", "compute_old_logprob", "update_actor")
"""Slots a training backend fills: with ``--endpoint`` its plugin is switched off (it would build a model)."""
TRAINING_ONLY = ("distill", "sft")
"""Plugins of this distribution that only act on training steps: switched off for an evaluation."""


def register_command(subparsers) -> None:
    """Add ``agl eval`` to the CLI (entry point of the group ``agl_core.commands``)."""
    parser = subparsers.add_parser(
        "eval", help="run a recipe's agent on its tasks against a policy; write per-task results and a summary",
        description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", help="the recipe whose agent, tasks and rollout plane are used")
    parser.add_argument("overrides", nargs="*", help="dotlist overrides of the recipe (key=value)")
    parser.add_argument("-p", dest="plugin_flags", action="append", default=[], metavar="NAME",
                        help="enable plugin NAME (no:NAME disables it), as for agl train")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="a checkpoint directory (…/global_step_N), its actor directory, a "
                                             "run directory (its latest checkpoint) or a Hugging Face model "
                                             "directory, served by the recipe's embedded backend")
    source.add_argument("--endpoint", help="base URL of an OpenAI-compatible server (…/v1) to evaluate")
    parser.add_argument("--model", help="with --endpoint: the model name to send (default: rollout.model)")
    parser.add_argument("--split", choices=("val", "train"), default="val", help="which task files (data.*_files)")
    parser.add_argument("--n", type=int, default=1, help="rollouts per task (pass@k up to n)")
    parser.add_argument("--limit", type=int, help="evaluate the first LIMIT tasks only")
    parser.add_argument("--success", type=float, default=1.0,
                        help="a rollout passes when its reward is at least this (default 1.0)")
    parser.add_argument("-o", "--out", default="eval.jsonl", help="per-rollout results (JSONL); the summary goes "
                                                                 "beside it as OUT.summary.json")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="print two result files side by side")
    parser.set_defaults(run=cmd_eval)


def cmd_eval(args) -> int:
    if args.compare:
        print(compare(*(load_summary(Path(p)) for p in args.compare), *args.compare))
        return 0
    if not args.recipe:
        raise ValueError("agl eval needs a RECIPE (or --compare A B)")
    if args.n < 1:
        raise ValueError(f"--n must be at least 1, got {args.n}")
    if args.model and not args.endpoint:
        raise ValueError("--model names the model of --endpoint; give --endpoint too")
    summary = evaluate(args.recipe, list(args.overrides), args.plugin_flags, checkpoint=args.checkpoint,
                       endpoint=args.endpoint, model=args.model, split=args.split, n=args.n, limit=args.limit,
                       success=args.success, out=Path(args.out))
    print(json.dumps(summary, indent=2))
    return 0


# ------------------------------------------------------------------ running


def checkpoint_source(path: Path) -> tuple[Path | None, Path | None]:
    """``(model_dir, checkpoint)``: what ``--checkpoint path`` serves.

    A Hugging Face model directory (``path`` itself, its ``actor/``, or a run's
    latest checkpoint's ``actor/``) is served as the recipe's model: ``(model_dir,
    None)``. A checkpoint whose actor is not a whole model (a LoRA adapter, the
    adapters of several policies) is restored as the trainer resumes it, into
    the recipe's own model: ``(None, checkpoint)``; the recipe must then be the
    one the run trained with.
    """
    from agl_core.checkpoint import locate

    if (path / "config.json").is_file():
        return path, None
    if (path / "actor" / "config.json").is_file():
        return path / "actor", None
    latest = locate(path)[1] if path.is_dir() else None
    if latest is not None and (latest / "actor" / "config.json").is_file():
        return latest / "actor", None
    if latest is not None:
        return None, latest
    if path.name == "actor" and locate(path.parent)[1] == path.parent:  # a checkpoint's adapters: the checkpoint
        return None, path.parent
    raise ValueError(f"--checkpoint {path}: not a model directory, a checkpoint or a run directory with one")


def endpoint_policy(url: str):
    """The plugin ``eval_policy``: fills ``policy_endpoints`` with the evaluated endpoint."""
    from agl_core import HOOK_API_VERSION, hookimpl

    class EndpointPolicy:
        AGL_HOOK_API = HOOK_API_VERSION

        @hookimpl
        def policy_endpoints(self, ctx):
            return [url]

    return EndpointPolicy()


def evaluate(recipe_path: str, overrides: list[str], plugin_flags: list[str], *, checkpoint: str | None = None,
             endpoint: str | None = None, model: str | None = None, split: str = "val", n: int = 1,
             limit: int | None = None, success: float = 1.0, out: Path = Path("eval.jsonl")) -> dict[str, Any]:
    """Run the evaluation; write the results and the summary; return the summary."""
    from agl_core.checkpoint import load as load_checkpoint_state
    from agl_core.components import Components
    from agl_core.config import load
    from agl_core.context import TrainContext
    from agl_core.plugins import call
    from agl_core.rollout.tasks import load_tasks

    work = Path(tempfile.mkdtemp(prefix="agl-eval-"))
    overrides = [*overrides, f"trainer.run_dir={work / 'run'}", "trainer.progress=true"]
    model_dir, restore = checkpoint_source(Path(checkpoint)) if checkpoint is not None else (None, None)
    if model_dir is not None:
        overrides += [f"plugins.torch.model.path={model_dir}", "plugins.torch.model.build=null"]
    if model is not None:
        overrides.append(f"rollout.model={model}")
    flags = [*plugin_flags, *(f"no:{name}" for name in TRAINING_ONLY)]
    extra = []
    if endpoint is not None:
        recipe, plugins = load(recipe_path, overrides, flags)
        backends = {name for hook in BACKEND_SLOTS for name, _ in plugins.implementations(hook)}
        flags += [f"no:{name}" for name in sorted(backends)]
        extra = [("eval_policy", endpoint_policy(endpoint))]
    recipe, plugins = load(recipe_path, overrides, flags, extra_plugins=extra)
    files = recipe.data.val_files if split == "val" else recipe.data.train_files
    tasks = load_tasks(files, split)[:limit]
    if not tasks:
        raise ValueError(f"no {split} tasks in {files}")
    components = Components.collect(plugins)
    slots = {hook: plugins.resolve_slot(hook, recipe.plugins.slots.get(hook))
             for hook in ("policy_endpoints", "collect_rollouts")}
    ctx = TrainContext(recipe, plugins, components, work / "run", slots=slots)
    ctx.run_id = f"eval-{int(time.time())}"
    ctx.run_dir.mkdir(parents=True)
    try:
        if restore is not None:  # adapters: every plugin restores its part, as when the trainer resumes
            ctx.step = load_checkpoint_state(restore)["step"]
            plugins.broadcast("load_checkpoint", ctx=ctx, path=str(restore))
        plugins.broadcast("on_train_start", ctx=ctx)
        # As the trainer does: what start-up built (models, servers) out of the cyclic collector's sight.
        gc.collect()
        gc.freeze()
        start = time.perf_counter()
        # n rollouts per task: the task n times, through the validation path the recipe's runner takes
        rollouts = ctx.call("collect_rollouts", tasks=[t for t in tasks for _ in range(n)], mode="val")
        seconds = time.perf_counter() - start
    finally:
        gc.unfreeze()
        for name, fn in plugins.implementations("on_train_end"):
            try:
                call(fn, {"ctx": ctx})
            except Exception as exc:  # noqa: BLE001 - every plugin is ended; the first error is shown
                print(f"agl eval: on_train_end of {name} failed: {exc!r}", file=sys.stderr)
        shutil.rmtree(work, ignore_errors=True)
    results = [result_line(r) for r in rollouts]
    policy = endpoint or (f"checkpoint {checkpoint}" if checkpoint else "the recipe's model")
    summary = summarize(results, success, n, seconds,
                        {"recipe": recipe_path, "policy": policy, "model": recipe.rollout.model, "split": split})
    write_results(out, results, summary)
    return summary


def result_line(rollout) -> dict[str, Any]:
    """What one rollout gave: its task, status, reward, model calls and tokens, and its error."""
    calls = [s for s in rollout.spans if s.kind == "llm_call"]
    return {"task_id": rollout.task_id, "rollout_id": rollout.rollout_id, "status": rollout.status,
            "reward": rollout.final_reward, "calls": len(calls),
            "prompt_tokens": sum(len(s.prompt_token_ids) for s in calls),
            "response_tokens": sum(len(s.response_token_ids) for s in calls),
            "seconds": (rollout.end_time - rollout.start_time) if rollout.end_time and rollout.start_time else None,
            "error": rollout.error}


def write_results(out: Path, results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in results))
    summary_path(out).write_text(json.dumps(summary, indent=2) + "\n")


def summary_path(results: Path) -> Path:
    return results.with_name(results.name.removesuffix(".jsonl") + ".summary.json")


# ------------------------------------------------------------------ figures


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` passed (Chen et al., 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def summarize(results: list[dict[str, Any]], success: float, n: int, seconds: float,
              about: dict[str, Any]) -> dict[str, Any]:
    """Mean reward (failed rollouts apart), pass@k per task averaged, tokens, failures by error."""
    finished = [r for r in results if r["status"] == "succeeded" and r["reward"] is not None]
    by_task: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in results:
        by_task[r["task_id"]].append(r)
    ks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, n) if k <= n})
    passes = {}
    for k in ks:
        # A failed rollout counts as a sample that did not pass: failures lower pass@k, never vanish from it.
        passes[f"pass@{k}"] = statistics.fmean(
            pass_at_k(len(rs), sum(r["status"] == "succeeded" and (r["reward"] or 0) >= success for r in rs), k)
            for rs in by_task.values())
    failures = collections.Counter((r["error"] or r["status"]).splitlines()[0][:200]
                                   for r in results if r["status"] != "succeeded" or r["reward"] is None)
    return {
        **about, "n_tasks": len(by_task), "n_per_task": n, "n_rollouts": len(results),
        "reward_mean": statistics.fmean(r["reward"] for r in finished) if finished else None,
        "reward_std": statistics.pstdev(r["reward"] for r in finished) if finished else None,
        **passes, "success_threshold": success,
        "n_failed": sum(failures.values()), "failures": dict(failures.most_common(10)),
        "prompt_tokens": sum(r["prompt_tokens"] for r in results),
        "response_tokens": sum(r["response_tokens"] for r in results),
        "response_tokens_mean": statistics.fmean(r["response_tokens"] for r in results) if results else 0.0,
        "seconds": seconds, "rollouts_per_s": len(results) / seconds if seconds else None,
    }


def load_summary(path: Path) -> dict[str, Any]:
    """A summary from a result file (``X.jsonl``, its ``X.summary.json`` beside it) or a summary file."""
    if path.name.endswith(".summary.json"):
        return json.loads(path.read_text())
    summary = summary_path(path)
    if not summary.is_file():
        raise ValueError(f"{path}: no summary beside it ({summary.name}); was it written by agl eval?")
    return json.loads(summary.read_text())


def compare(a: dict[str, Any], b: dict[str, Any], name_a: str = "A", name_b: str = "B") -> str:
    """A table of the two summaries' figures: A, B and B - A."""
    keys = [k for k in a if isinstance(a[k], int | float) and isinstance(b.get(k), int | float) and k != "n_tasks"]
    keys += [k for k in b if k not in a and k.startswith("pass@")]
    width = max(len(k) for k in keys) + 2
    lines = [f"{'':<{width}}{name_a[-24:]:>26}{name_b[-24:]:>26}{'B - A':>14}"]
    for key in ("policy", "split", "n_tasks"):
        lines.append(f"{key:<{width}}{str(a.get(key))[-24:]:>26}{str(b.get(key))[-24:]:>26}")
    for key in keys:
        x, y = a.get(key), b.get(key)
        diff = f"{y - x:+.4g}" if isinstance(x, int | float) and isinstance(y, int | float) else ""
        lines.append(f"{key:<{width}}{_fmt(x):>26}{_fmt(y):>26}{diff:>14}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def main(argv: list[str] | None = None) -> int:
    """``python -m agl_plugin_teachers.evaluation …``: the same command without the agl CLI."""
    parser = argparse.ArgumentParser(prog="agl")
    register_command(parser.add_subparsers(required=True))
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
