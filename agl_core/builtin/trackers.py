"""What the plugins that send a run to an experiment tracker (TensorBoard, W&B, MLflow, …) share.

:func:`chartable` is the part of a step's metrics a tracker can chart; :func:`curves_png` is ``agl plot``'s
PNG of the run, for a tracker to keep at the end. Light to import: the CLI loads the loggers at start-up.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

log = logging.getLogger("agl_core.builtin.trackers")


def chartable(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of ``metrics`` as floats: no bools, no text, no NaN or inf (the JSONL file's nulls)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not hasattr(value, "__float__"):
            continue
        value = float(value)
        if math.isfinite(value):
            out[key] = value
    return out


def curves_png(run_dir: Path, tracker: str) -> Path | None:
    """``agl plot``'s PNG of the run in ``run_dir`` (``<run_dir>/curves.png``); None, with a warning naming
    ``tracker``, when there is nothing to draw (no ``metrics.jsonl``: the jsonl logger was disabled)."""
    from agl_core.builtin.plot import plot_run  # imports matplotlib: only at the end of a run

    try:
        return plot_run(run_dir)
    except ValueError as exc:
        log.warning("%s: no curves to log: %s", tracker, exc)
        return None
