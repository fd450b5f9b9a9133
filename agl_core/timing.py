"""Wall-clock timing of the step's stages (``timing_s/<stage>``)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def timer(name: str, timing: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to ``timing[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


MODEL_STAGES = ("gen", "old_log_prob", "ref", "values", "update_critic", "update_actor")
"""Stages whose time is the backend's work: generation (with the rollouts around it), forward and backward
passes. The rest of a step (``timing_s/step`` minus these) is the core's own: hooks, batch operations, metrics."""


def timing_summary(totals: dict[str, float], steps: int) -> str:
    """A few lines on where ``steps`` steps spent their time, from the sums of their ``timing_s/<stage>``.

    One line per stage with its seconds and its share of ``timing_s/step``,
    then the core's own share: the step time not spent in :data:`MODEL_STAGES`.
    """
    step = totals.get("step", 0.0)
    if steps == 0 or step <= 0:
        return "timing: no training step ran"
    lines = [f"timing over {steps} steps ({step:.1f} s of steps, {step / steps:.3f} s a step):"]
    for stage, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        if stage != "step":
            lines.append(f"  timing_s/{stage:<18} {seconds:10.3f} s  {seconds / step:7.2%}")
    core = step - sum(totals.get(stage, 0.0) for stage in MODEL_STAGES)
    lines.append(f"  core's own share (step minus {', '.join(MODEL_STAGES)}): {core:.3f} s, {core / step:.2%}")
    return "\n".join(lines)
