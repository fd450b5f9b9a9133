"""Built-in plugin ``validation``: the default ``validate`` slot.

Runs the agents on the validation tasks in ``"val"`` mode through the
``collect_rollouts`` slot and reports reward statistics of the rollouts.
"""

from __future__ import annotations

import statistics

from agl_core import HOOK_API_VERSION, hookimpl

AGL_HOOK_API = HOOK_API_VERSION


@hookimpl
def validate(ctx, tasks):
    rollouts = ctx.call("collect_rollouts", tasks=tasks, mode="val")
    rewards = [r.final_reward for r in rollouts if r.status == "succeeded" and r.final_reward is not None]
    metrics = {
        "val/n_rollouts": float(len(rollouts)),
        "val/n_failed": float(sum(r.status != "succeeded" for r in rollouts)),
    }
    if rewards:
        metrics.update({
            "val/reward/mean": statistics.fmean(rewards),
            "val/reward/std": statistics.pstdev(rewards),
            "val/reward/max": max(rewards),
            "val/reward/min": min(rewards),
        })
    return metrics
