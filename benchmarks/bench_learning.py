"""The default recipe learns on a CPU: validation reward, time to 0.9, steps per minute, core overhead, peak memory.

Runs ``agl train examples/guess_number/recipe.yaml`` (a randomly initialised
model) once per seed, each in a fresh process, and watches its
``metrics.jsonl``. Times are wall-clock seconds from the launch of the
process, so they include start-up (imports, model creation, servers).

The core's share of a step is what is left of ``timing_s/step`` after
generation, forward and backward: the ``gen`` stage (the agents' games:
agents, HTTP, gateway, store and the policy's sampling), ``old_log_prob``,
``ref``, ``values`` (forward passes), ``update_actor``, ``update_critic``
(forward and backward). Inside ``gen``, the torch backend reports the CPU
time its engine spent sampling (``perf/gen_engine_cpu_s``); the rest of
``gen`` is the rollout plane's share (agents, HTTP, gateway, store), reported
too. Peak RSS is the largest resident
set of a run's process.

Prints the timing breakdown of each run to stderr and one JSON line to stdout.
Targets: start reward <= 0.4, every seed reaches 0.9 within 300 s, core share
<= 5 %, peak RSS <= 3 GB.

With ``--async K`` each seed is trained twice, synchronously and with
``trainer.async.max_staleness=K`` and the token-level TIS correction
(``algorithm.rollout_correction.rollout_is=token``; ``--no-tis`` leaves it
off), the two alternated (sync, async, sync, …)
so that both see the same machine; the JSON line holds both sets of figures
and their ratio. Steps per minute are then wall-clock (``steps_per_min_wall``:
steps between the first and the last step's record, validations included,
which is fair to both: an asynchronous run's validation also waits for the
next step's games queued before it). Goals on 2 cores: steps per minute >= 1.25x
synchronous, time to validation reward 0.9 no worse than synchronous on every
seed, final validation reward >= 0.95 on every seed.
``--async-set KEY=VALUE`` (repeatable) sets a key of the asynchronous runs
only, e.g. their learning rate (docs/async.md, "What k trades") or
``trainer.async.prefetch_share``: the
synchronous runs then keep the recipe's, so each side trains as it would be
set up on its own.

``--recipe`` trains another recipe the same way, e.g.
``examples/guess_number/recipe_ray.yaml``: the same game with the agents,
the store and the gateway in processes of their own. (In the trainer's
process the rollout plane's Python shares the trainer's interpreter lock, and
on 2 cores an asynchronous run of the default recipe gains little.) ``--keep DIR`` keeps the runs' directories
(``metrics.jsonl``, logs) for a look at the ``async/…`` metrics.

    python benchmarks/bench_learning.py [--seeds 0 1 2] [--async K [--no-tis] [--async-set KEY=VALUE ...]]
                                        [--recipe R] [--keep DIR] [overrides ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agl_core.timing import MODEL_STAGES

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "examples" / "guess_number" / "recipe.yaml"
TARGET = 0.9


def read_records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.endswith("}")]  # the last line may be half written


def run_seed(seed: int, run_dir: Path, overrides: list[str], recipe: Path = RECIPE) -> dict:
    """Train one seed; return its figures."""
    command = [sys.executable, "-m", "agl_core.cli", "train", str(recipe), f"trainer.seed={seed}",
               f"trainer.run_dir={run_dir}", "trainer.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    metrics_file = run_dir / "metrics.jsonl"
    start = time.monotonic()
    reached_at = None
    seen_at: dict[int, float] = {}  # when each step's record appeared
    with open(run_dir.parent / f"seed{seed}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            records = read_records(metrics_file)
            for record in records:
                seen_at.setdefault(record["step"], time.monotonic() - start)
            if reached_at is None and any((r.get("val/reward/mean") or 0) >= TARGET for r in records):
                reached_at = time.monotonic() - start
            time.sleep(0.2)
    wall = time.monotonic() - start
    if process.returncode != 0:
        raise SystemExit(f"seed {seed} failed (exit {process.returncode}); see {run_dir.parent / f'seed{seed}.log'}")
    records = read_records(metrics_file)
    val = [(r["step"], r["val/reward/mean"]) for r in records if r.get("val/reward/mean") is not None]
    if reached_at is None and any(v >= TARGET for _, v in val):
        reached_at = wall  # reached in the last moments, between two polls
    steps = [r for r in records if r["step"] > 0 and "timing_s/step" in r]
    step_time = sum(r["timing_s/step"] for r in steps)
    model_time = sum(r.get(f"timing_s/{stage}", 0.0) for r in steps for stage in MODEL_STAGES)
    gen_time = sum(r.get("timing_s/gen", 0.0) for r in steps)
    sampling_time = sum(r.get("perf/gen_engine_cpu_s", 0.0) for r in steps)
    breakdown = {key: round(sum(r.get(key, 0.0) for r in steps), 3)
                 for key in sorted({k for r in steps for k in r if k.startswith("timing_s/")})}
    print(f"seed {seed} timing_s (sum over {len(steps)} steps): {json.dumps(breakdown)}", file=sys.stderr)
    first_step = min((r["step"] for r in records if r.get("val/reward/mean") is not None
                      and r["val/reward/mean"] >= TARGET), default=None)
    return {
        "seed": seed,
        "start_val_reward": val[0][1] if val else None,
        "end_val_reward": val[-1][1] if val else None,
        "time_to_target_s": None if reached_at is None else round(reached_at, 1),
        "step_to_target": first_step,
        "steps": len(steps),
        "steps_per_min": round(len(steps) / step_time * 60, 2) if step_time else None,
        "steps_per_min_wall": steps_per_min_wall(seen_at),
        "wall_s": round(wall, 1),
        "core_share": round((step_time - model_time) / step_time, 4) if step_time else None,
        "rollout_plane_share": round((gen_time - sampling_time) / step_time, 4) if step_time else None,
        "sampling_share": round(sampling_time / step_time, 4) if step_time else None,
    }


def steps_per_min_wall(seen_at: dict[int, float]) -> float | None:
    """Steps per minute of wall-clock between the first and the last training step's record."""
    steps = sorted(step for step in seen_at if step > 0)
    if len(steps) < 2 or seen_at[steps[-1]] <= seen_at[steps[0]]:
        return None
    return round((steps[-1] - steps[0]) / (seen_at[steps[-1]] - seen_at[steps[0]]) * 60, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--async", dest="max_staleness", type=int, default=None, metavar="K",
                        help="also train each seed with trainer.async.max_staleness=K, alternated with a "
                             "synchronous run, and compare")
    parser.add_argument("--no-tis", action="store_true",
                        help="with --async: train without the TIS correction (on by default: one-step-stale "
                             "samples of the default recipe learn worse without it)")
    parser.add_argument("--async-set", action="append", default=[], metavar="KEY=VALUE",
                        help="with --async: a recipe override of the asynchronous runs only (repeatable)")
    parser.add_argument("--recipe", type=Path, default=RECIPE,
                        help="the recipe to train (default: examples/guess_number/recipe.yaml)")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR",
                        help="keep the runs' directories (metrics.jsonl, logs) under DIR instead of a temporary one")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. trainer.total_steps=40")
    args = parser.parse_args()
    recipe = args.recipe.resolve()
    modes = {"sync": []} if args.max_staleness is None else {
        "sync": ["trainer.async.max_staleness=0"],
        "async": [f"trainer.async.max_staleness={args.max_staleness}"]
        + ([] if args.no_tis else ["algorithm.rollout_correction.rollout_is=token"])
        + args.async_set}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    keep = contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="bench_learning_")
    with keep as tmp:
        for seed in args.seeds:
            for mode, extra in modes.items():
                run_dir = Path(tmp) / mode / f"seed{seed}" / "run"
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                runs[mode].append(run_seed(seed, run_dir, args.overrides + extra, recipe))
                print(f"{mode} seed {seed}: {json.dumps(runs[mode][-1])}", file=sys.stderr)
    if args.max_staleness is None:
        print(json.dumps(summary(runs["sync"], args.seeds, recipe)))
        return
    sync, asynchronous = summary(runs["sync"], args.seeds, recipe), summary(runs["async"], args.seeds, recipe)
    ratio = (asynchronous["steps_per_min_wall"] / sync["steps_per_min_wall"]
             if sync["steps_per_min_wall"] and asynchronous["steps_per_min_wall"] else None)
    no_slower = [a is not None and (s is None or a <= s)
                 for s, a in zip(sync["time_to_0.9_s"], asynchronous["time_to_0.9_s"])]
    print(json.dumps({
        "benchmark": "learning_async",
        "recipe": shown(recipe),
        "max_staleness": args.max_staleness,
        "async_overrides": modes["async"],
        "seeds": args.seeds,
        "steps_per_min_wall_ratio": None if ratio is None else round(ratio, 3),
        "goal_steps_per_min_ratio_ge_1.25": ratio is not None and ratio >= 1.25,
        "goal_time_to_0.9_no_worse_every_seed": all(no_slower),
        "goal_final_val_reward_ge_0.95_every_seed": all(
            r is not None and r >= 0.95 for r in asynchronous["end_val_reward"]),
        "sync": sync,
        "async": asynchronous,
    }))


def shown(recipe: Path) -> str:
    """The recipe's path as the figures name it: relative to the repository when it is in it."""
    return str(recipe.relative_to(ROOT)) if recipe.is_relative_to(ROOT) else str(recipe)


def summary(runs: list[dict], seeds: list[int], recipe: Path) -> dict:
    """The figures of one set of runs (one per seed)."""
    # ru_maxrss of the children: the peak resident set of the largest run, in KiB on Linux.
    peak_rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    times = [r["time_to_target_s"] for r in runs]
    walls = [r["steps_per_min_wall"] for r in runs if r["steps_per_min_wall"]]
    return {
        "benchmark": "learning",
        "recipe": shown(recipe),
        "seeds": seeds,
        "start_val_reward": [r["start_val_reward"] for r in runs],
        "end_val_reward": [r["end_val_reward"] for r in runs],
        "time_to_0.9_s": times,
        "all_reached_0.9_within_300s": all(t is not None and t <= 300 for t in times),
        "steps_per_min": round(sum(r["steps_per_min"] for r in runs) / len(runs), 2),
        "steps_per_min_wall": round(sum(walls) / len(walls), 2) if walls else None,
        "core_overhead_share": max(r["core_share"] for r in runs),
        "rollout_plane_share": max(r["rollout_plane_share"] for r in runs),
        "peak_rss_gb": round(peak_rss_gb, 3),
        "runs": runs,
    }


if __name__ == "__main__":
    main()
