"""Soak: the trainer's resident memory over a long run stays flat once warmed up.

Runs ``agl train`` in a fresh process twice — the quick-start recipe (instant
backend) for 5,000 steps and the default recipe (guess_number: embedded
backend, gateway, SQLite store, 32 agent threads) for 200 steps — and samples
the process's resident set (``VmRSS``) every ``--interval`` seconds next to the
number of steps logged so far. Warm-up is the first 10% of the steps; the
figure is ``growth``: the largest RSS after warm-up over the RSS at the end of
warm-up (target: at most 1.10). Prints one JSON line with, per run, the RSS
when each tenth of the steps was done and the growth.

    python benchmarks/bench_soak.py [--quickstart-steps 5000] [--default-steps 200] [--only quickstart|default]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from procmem import status_bytes

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"quickstart": ROOT / "examples" / "quickstart" / "recipe.yaml",
           "default": ROOT / "examples" / "guess_number" / "recipe.yaml"}
WARM_UP = 0.1
TARGET_GROWTH = 1.10


def steps_logged(metrics: Path) -> int:
    """Training steps in ``metrics.jsonl`` so far (the step-0 validation line is not one)."""
    if not metrics.exists():
        return 0
    with open(metrics, "rb") as f:
        return max(0, f.read().count(b"\n") - 1)


def soak(name: str, steps: int, interval_s: float, run_dir: Path) -> dict:
    """Train ``steps`` steps of recipe ``name`` in a child process; its RSS samples as (steps, bytes)."""
    command = [sys.executable, "-m", "agl_core.cli", "train", str(RECIPES[name]), f"trainer.run_dir={run_dir}",
               f"trainer.total_steps={steps}", "trainer.progress=false", "trainer.save_freq=0",
               f"trainer.test_freq={max(1, steps // 10)}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    samples: list[tuple[int, int]] = []
    start = time.monotonic()
    with open(run_dir.parent / f"{name}.log", "w") as log:
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            try:
                samples.append((steps_logged(run_dir / "metrics.jsonl"), status_bytes("VmRSS", process.pid)))
            except (FileNotFoundError, ProcessLookupError, KeyError):
                pass  # the process is exiting: /proc/PID/status is gone or has no memory fields any more
            time.sleep(interval_s)
    if process.returncode != 0:
        raise SystemExit(f"{name}: agl train exited {process.returncode}; see {run_dir.parent / (name + '.log')}")
    warm = [rss for done, rss in samples if done <= steps * WARM_UP]
    after = [rss for done, rss in samples if done > steps * WARM_UP]
    by_tenth = [next((rss for done, rss in reversed(samples) if done <= steps * k / 10), 0) for k in range(1, 11)]
    return {"steps": steps, "seconds": round(time.monotonic() - start, 1), "samples": len(samples),
            "rss_mb_by_tenth": [round(rss / 2**20, 1) for rss in by_tenth],
            "rss_mb_after_warm_up": round(warm[-1] / 2**20, 1),
            "rss_mb_max": round(max(after) / 2**20, 1),
            "growth": round(max(after) / warm[-1], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quickstart-steps", type=int, default=5000)
    parser.add_argument("--default-steps", type=int, default=200)
    parser.add_argument("--interval", type=float, default=0.25, help="seconds between RSS samples")
    parser.add_argument("--only", choices=sorted(RECIPES))
    args = parser.parse_args()
    steps = {"quickstart": args.quickstart_steps, "default": args.default_steps}
    result = {"bench": "soak", "target_growth_max": TARGET_GROWTH}
    with tempfile.TemporaryDirectory(prefix="agl-soak-") as tmp:
        for name in [args.only] if args.only else list(RECIPES):
            figures = soak(name, steps[name], args.interval, Path(tmp) / name / "run")
            print(f"{name}: {figures}", file=sys.stderr)
            result[name] = figures
    result["flat"] = all(result[name]["growth"] <= TARGET_GROWTH for name in RECIPES if name in result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
