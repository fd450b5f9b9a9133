"""Minutes from ``agl new-plugin`` to a plugin whose tests pass and that trains one step, beside the hand-made figure.

The path a plugin author takes, each step a real command in a subprocess:
``agl new-plugin NAME --hook register_estimators --hook log_metrics`` →
``pip install --no-build-isolation --no-deps -e DIR`` → ``python -m pytest DIR/tests`` (the plugin loads,
passes the contract suite and trains one step) → ``agl train -p NAME examples/quickstart/recipe.yaml
trainer.total_steps=1 algorithm.estimator=NAME_baseline`` → ``pip uninstall``. No editing: the figure is the
machine's part of the path. The hand-made figure (16 minutes: a separate distribution with an estimator, a
logger, a stage and settings, written from the docs alone) is issue 15's, measured by a person, not here.

Prints one JSON line.

    python benchmarks/bench_new_plugin.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BY_HAND_MIN = 16.0  # issue 15: "it worked in about 16 minutes"


def step(argv: list[str], cwd: Path | None = None) -> float:
    """Run one command of the path; its wall time in seconds. A failure stops the benchmark with its output."""
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    if done.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    name = f"bench{os.getpid()}"
    agl = [sys.executable, "-m", "agl_core.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        out, run_dir = Path(tmp) / "dist", Path(tmp) / "run"
        phases = {"new_plugin_s": step([*agl, "new-plugin", name, "--hook", "register_estimators",
                                        "--hook", "log_metrics", "-o", str(out)])}
        phases["pip_install_s"] = step([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation",
                                        "--no-deps", "-e", str(out)])
        try:
            phases["its_tests_s"] = step([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          str(out / "tests")], cwd=out)
            quickstart = REPO / "examples/quickstart"
            phases["train_one_step_s"] = step([
                *agl, "train", "-p", name, str(quickstart / "recipe.yaml"), f"algorithm.estimator={name}_baseline",
                "trainer.total_steps=1", f"trainer.run_dir={run_dir}", "trainer.progress=false",
                f"data.train_files=[{quickstart / 'train.jsonl'}]", f"data.val_files=[{quickstart / 'val.jsonl'}]"])
        finally:
            step([sys.executable, "-m", "pip", "uninstall", "-q", "-y", f"agl-plugin-{name}"])
    total_min = sum(phases.values()) / 60
    print(json.dumps({"scaffold_to_trained_min": round(total_min, 2), "by_hand_min": BY_HAND_MIN,
                      "by_hand_over_scaffold": round(BY_HAND_MIN / total_min, 1),
                      **{k: round(v, 2) for k, v in phases.items()}}))


if __name__ == "__main__":
    main()
