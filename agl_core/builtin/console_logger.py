"""Built-in plugin ``console``: a short line per step with the metrics a person watches."""

from __future__ import annotations

from tqdm import tqdm

from agl_core import HOOK_API_VERSION, hookimpl

AGL_HOOK_API = HOOK_API_VERSION

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
