"""Built-in plugin ``jsonl``: one JSON line per logged step in ``<run_dir>/metrics.jsonl``.

Each step appears once: a resumed run first drops the lines of the steps it
is about to log again (``ctx.purge_step``), so a run killed after its last
checkpoint leaves no duplicates behind.
"""

from __future__ import annotations

import json
import math
import os

from agl_core import HOOK_API_VERSION, hookimpl

AGL_HOOK_API = HOOK_API_VERSION
FILENAME = "metrics.jsonl"


def _jsonable(value):
    value = float(value) if hasattr(value, "__float__") else value
    # JSON has no NaN/inf; null keeps the line readable by every viewer.
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _step_of(line: str) -> int | None:
    """The step of a logged line; None for a line a killed run left half written."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


@hookimpl
def on_train_start(ctx):
    path = ctx.run_dir / FILENAME
    if not path.exists():
        return
    with open(path, encoding="utf-8") as f:
        kept = [line for line in f if (step := _step_of(line)) is not None and step < ctx.purge_step]
    # Written aside and renamed: a kill now leaves the old file or the new one, never half of one.
    partial = path.with_name(FILENAME + ".partial")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)


@hookimpl
def log_metrics(ctx, metrics, step):
    record = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
    # Append + flush per line so a killed run keeps every step it logged.
    with open(ctx.run_dir / FILENAME, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
