"""Built-in plugin ``console``: a short line per step with the metrics a person watches, and where the time went."""

from __future__ import annotations

from tqdm import tqdm

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.timing import timing_summary

AGL_HOOK_API = HOOK_API_VERSION
NAME = "console"
TIMING = "timing_s/"

WATCHED = (
    "critic/score/mean_before_processing",
    "val/reward/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/ppo_kl",
    "response_length/mean_after_processing",
    "training/n_triplets_prompt_too_long",
    "timing_s/step",
)


def format_line(metrics, step):
    shown = [f"{key.removesuffix('_before_processing').removesuffix('_after_processing')}={metrics[key]:.4g}"
             for key in WATCHED if metrics.get(key) is not None]
    return f"step {step}: " + "  ".join(shown)


@hookimpl
def log_metrics(ctx, metrics, step):
    # tqdm.write keeps the progress bar intact below the line.
    tqdm.write(format_line(metrics, step))
    if step > 0 and TIMING + "step" in metrics:
        run = ctx.state.setdefault(NAME, {"steps": 0, "timing": {}})
        run["steps"] += 1
        for key, value in metrics.items():
            if key.startswith(TIMING) and key != TIMING + "validate":
                stage = key.removeprefix(TIMING)
                run["timing"][stage] = run["timing"].get(stage, 0.0) + value


@hookimpl
def on_train_end(ctx):
    """The ``timing_s/`` breakdown of the steps this process ran, and the core's share of it."""
    run = ctx.state.pop(NAME, None)
    if run is not None:
        tqdm.write(timing_summary(run["timing"], run["steps"]))
