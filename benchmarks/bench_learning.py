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

    python benchmarks/bench_learning.py [--seeds 0 1 2] [overrides ...]
"""

from __future__ import annotations

import argparse
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


def run_seed(seed: int, run_dir: Path, overrides: list[str]) -> dict:
    """Train one seed; return its figures."""
    command = [sys.executable, "-m", "agl_core.cli", "train", str(RECIPE), f"trainer.seed={seed}",
               f"trainer.run_dir={run_dir}", "trainer.progress=false", *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    metrics_file = run_dir / "metrics.jsonl"
    start = time.monotonic()
    reached_at = None
    with open(run_dir.parent / f"seed{seed}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            if reached_at is None and any((r.get("val/reward/mean") or 0) >= TARGET
                                          for r in read_records(metrics_file)):
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
        "wall_s": round(wall, 1),
        "core_share": round((step_time - model_time) / step_time, 4) if step_time else None,
        "rollout_plane_share": round((gen_time - sampling_time) / step_time, 4) if step_time else None,
        "sampling_share": round(sampling_time / step_time, 4) if step_time else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("overrides", nargs="*", help="recipe overrides, e.g. trainer.total_steps=40")
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench_learning_") as tmp:
        for seed in args.seeds:
            run_dir = Path(tmp) / f"seed{seed}" / "run"
            run_dir.parent.mkdir(parents=True)
            runs.append(run_seed(seed, run_dir, args.overrides))
            print(f"seed {seed}: {json.dumps(runs[-1])}", file=sys.stderr)
    # ru_maxrss of the children: the peak resident set of the largest run, in KiB on Linux.
    peak_rss_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    times = [r["time_to_target_s"] for r in runs]
    print(json.dumps({
        "benchmark": "learning",
        "recipe": str(RECIPE.relative_to(ROOT)),
        "seeds": args.seeds,
        "start_val_reward": [r["start_val_reward"] for r in runs],
        "end_val_reward": [r["end_val_reward"] for r in runs],
        "time_to_0.9_s": times,
        "all_reached_0.9_within_300s": all(t is not None and t <= 300 for t in times),
        "steps_per_min": round(sum(r["steps_per_min"] for r in runs) / len(runs), 2),
        "core_overhead_share": max(r["core_share"] for r in runs),
        "rollout_plane_share": max(r["rollout_plane_share"] for r in runs),
        "peak_rss_gb": round(peak_rss_gb, 3),
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
