"""agl-plugin-stepadv: the estimator ``step_grpo`` and a CSV logger, as a third party would ship them.

Enable it in a recipe and pick the estimator::

    algorithm: {estimator: step_grpo}
    plugins:
      stepadv: {columns: [critic/score/mean_before_processing, val/reward/mean]}

or on the command line: ``agl train recipe.yaml -p stepadv algorithm.estimator=step_grpo``.
"""

from __future__ import annotations

import functools

from pydantic import BaseModel, ConfigDict, Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_plugin_stepadv.csv_logger import drop_steps_from, write_row

AGL_HOOK_API = HOOK_API_VERSION
NAME = "stepadv"

__all__ = ["StepAdvConfig"]


class StepAdvConfig(BaseModel):
    """The recipe section ``plugins.stepadv``."""

    model_config = ConfigDict(extra="forbid")
    filename: str = Field("metrics.csv", description="the CSV file, in the run directory")
    columns: list[str] = Field(
        default_factory=lambda: ["critic/score/mean_before_processing", "val/reward/mean", "actor/pg_loss"],
        min_length=1, description="the metrics written, one column each, in this order")
    epsilon: float = Field(1e-6, gt=0, description="step_grpo: added to a group's std before dividing by it")


def step_grpo(batch, config, epsilon: float):
    """The estimator ``step_grpo``: ``algorithm.norm_adv_by_std_in_grpo`` chooses the std division, as for grpo;
    ``epsilon`` is the plugin's setting, bound at registration."""
    # Imported here, not with the plugin: its math needs torch, which `agl plugins` should not pay for.
    from agl_plugin_stepadv.advantages import step_group_advantages

    return step_group_advantages(batch["token_level_rewards"], batch["response_mask"], batch["uid"],
                                 batch["turn_index"], norm_by_std=config.norm_adv_by_std_in_grpo, epsilon=epsilon)


@hookimpl
def plugin_config_schema():
    return StepAdvConfig


@hookimpl
def register_estimators(register, settings):
    # The estimator is called with the algorithm section only: its own setting is bound here. settings is None
    # when the plugin set was loaded without a recipe (agl doctor alone): the defaults then.
    epsilon = (settings or StepAdvConfig()).epsilon
    register("step_grpo", functools.partial(step_grpo, epsilon=epsilon))


@hookimpl
def on_train_start(ctx):
    """Drop the lines of the steps this run logs again (``ctx.purge_step``): each step is in the file once."""
    cfg = ctx.plugin_config(NAME)
    drop_steps_from(ctx.run_dir / cfg.filename, ctx.purge_step)


@hookimpl
def log_metrics(ctx, metrics, step):
    cfg = ctx.plugin_config(NAME)
    write_row(ctx.run_dir / cfg.filename, cfg.columns, step, metrics)
