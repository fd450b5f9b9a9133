"""Built-in plugin ``jsonl``: one JSON line per logged step in ``<run_dir>/metrics.jsonl``."""

from __future__ import annotations

import json
import math

from agl_core import HOOK_API_VERSION, hookimpl

AGL_HOOK_API = HOOK_API_VERSION
FILENAME = "metrics.jsonl"


def _jsonable(value):
    value = float(value) if hasattr(value, "__float__") else value
    # JSON has no NaN/inf; null keeps the line readable by every viewer.
    return None if isinstance(value, float) and not math.isfinite(value) else value


@hookimpl
def log_metrics(ctx, metrics, step):
    record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
    # Append + flush per line so a killed run keeps every step it logged.
    with open(ctx.run_dir / FILENAME, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
