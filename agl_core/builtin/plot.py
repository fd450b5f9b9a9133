"""``agl plot RUN_DIR``: a run's curves (reward, validation reward, response length, KL, entropy, step time) as a PNG.

The curves are read from ``<run_dir>/metrics.jsonl``, which the built-in
``jsonl`` logger writes. A step logged twice (a run resumed from a
checkpoint before its last logged step) keeps its last record.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from agl_core.builtin.jsonl_logger import FILENAME

PANELS: list[tuple[str, list[tuple[str, str]]]] = [
    ("reward", [("critic/score/mean_before_processing", "train")]),
    ("validation reward", [("val/reward/mean", "val")]),
    ("response length (tokens)", [("response_length/mean_before_processing", "mean"),
                                  ("response_length/max_before_processing", "max")]),
    ("KL", [("actor/kl_loss", "to reference (loss)"), ("actor/reward_kl_penalty", "to reference (reward)"),
            ("actor/ppo_kl", "old → new policy")]),
    ("entropy", [("actor/entropy", "actor")]),
    ("step time (s)", [("timing_s/step", "step"), ("timing_s/gen", "generation")]),
]
"""One subplot per entry: its title and the ``(metric key, legend label)`` curves it draws when logged."""


def read_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    """The logged metrics by step (the last record of a step wins); finite numbers only."""
    path = run_dir / FILENAME
    if not path.is_file():
        raise ValueError(f"{run_dir} has no {FILENAME}: is it a run directory (with the jsonl logger enabled)?")
    by_step: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            step = int(record.pop("step"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a metrics record: {exc}") from None
        by_step[step] = {k: float(v) for k, v in record.items()
                         if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}
    return dict(sorted(by_step.items()))


def curve(metrics: dict[int, dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one metric over the steps that logged it."""
    points = [(step, record[key]) for step, record in metrics.items() if key in record]
    return [s for s, _ in points], [v for _, v in points]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the curves of the run in ``run_dir`` into ``out`` (default ``<run_dir>/curves.png``); return its path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    out = Path(out) if out is not None else run_dir / "curves.png"
    fig, axes = plt.subplots(2, 3, figsize=(14, 7.5), constrained_layout=True)
    for ax, (title, keys) in zip(axes.flat, PANELS):
        drawn = False
        for key, label in keys:
            steps, values = curve(metrics, key)
            if steps:
                ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=label)
                drawn = True
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.suptitle(str(run_dir))
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
