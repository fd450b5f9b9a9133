"""The traces plugin: its hooks. Enable it with ``plugins: {traces: {...}}`` in a recipe (or ``-p traces``).

* ``post_process_batch`` (``AGL_ORDER = 5``, before any backend's stage):
  turns the step's rollouts into rows with the aggregator the recipe names
  (``plugins.traces.aggregator``, recorded in ``batch.meta["aggregator"]``),
  then applies the filters it switches on.
* ``register_aggregators``: ``transition`` and ``trajectory``. An aggregator is
  ``fn(ctx, rollouts) -> Batch`` and reports its metrics in
  ``ctx.step_metrics``; another plugin may register more and a recipe pick them.
* ``register_estimators``: the rollout-level estimators (``grpo_rollout``, …).
* ``on_train_start``: checks that the recipe's aggregator is registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from agl_core import HOOK_API_VERSION, hookimpl

from agl_plugin_traces.mismatch import Tokenizer, write_breaks
from agl_plugin_traces.settings import TracesConfig

if TYPE_CHECKING:
    from agl_core.data import Batch, Rollout

# The aggregators, filters and estimators (torch) are imported in the hooks that use them, so that
# importing the plugin (`agl plugins`) stays cheap.

AGL_HOOK_API = HOOK_API_VERSION
AGL_ORDER = 5  # the aggregator must be the first post_process_batch stage (a backend's own is at 10)
NAME = "traces"


def settings_of(ctx) -> TracesConfig:
    return ctx.plugin_config(NAME)


def tokenizer_of(ctx) -> Tokenizer | None:
    """The tokenizer named by ``plugins.traces.tokenizer``, loaded once per run (None when not set)."""
    name = settings_of(ctx).tokenizer
    if name is None:
        return None
    state = ctx.state.setdefault(NAME, {})
    if "tokenizer" not in state:
        from transformers import AutoTokenizer  # only runs that classify breaks need transformers

        state["tokenizer"] = AutoTokenizer.from_pretrained(name)
    return state["tokenizer"]


def aggregate_transition(ctx, rollouts: list[Rollout]) -> Batch:
    """The ``transition`` aggregator with the run's limits (``data.max_*_length``) and settings."""
    from agl_plugin_traces.transition import transition_batch

    cfg = settings_of(ctx)
    batch, metrics = transition_batch(
        rollouts, ctx.config.data.max_prompt_length, ctx.config.data.max_response_length,
        per_call_rewards=cfg.per_call_rewards, missing_reward=cfg.missing_reward, pad_token_id=cfg.pad_token_id)
    ctx.step_metrics.update(metrics)
    return batch


def aggregate_trajectory(ctx, rollouts: list[Rollout]) -> Batch:
    """The ``trajectory`` aggregator with the run's limits and settings; writes the mismatch log if asked."""
    from agl_plugin_traces.trajectory import trajectory_batch

    cfg, data = settings_of(ctx), ctx.config.data
    batch, metrics, breaks = trajectory_batch(
        rollouts, cfg.trajectory_max_prompt_length or data.max_prompt_length,
        cfg.trajectory_max_response_length or data.max_response_length,
        per_call_rewards=cfg.per_call_rewards, missing_reward=cfg.missing_reward,
        later_prompt_overflow=cfg.later_prompt_overflow, tokenizer=tokenizer_of(ctx),
        keep_break_records=cfg.mismatch_log_dir is not None, pad_token_id=cfg.pad_token_id)
    ctx.step_metrics.update(metrics)
    if cfg.mismatch_log_dir is not None:
        for record in breaks.records:
            record["step"] = ctx.step
        write_breaks(Path(ctx.run_dir) / cfg.mismatch_log_dir, breaks.records)
    return batch


@hookimpl
def plugin_config_schema():
    return TracesConfig


@hookimpl
def register_aggregators(register):
    register("transition", aggregate_transition)
    register("trajectory", aggregate_trajectory)


@hookimpl
def register_estimators(register):
    from agl_plugin_traces.advantage import ROLLOUT_ESTIMATORS

    for name, estimator in ROLLOUT_ESTIMATORS.items():
        register(name, estimator)


@hookimpl
def on_train_start(ctx):
    """Fail before the first step, not after its rollouts, when the recipe names an unknown aggregator."""
    ctx.components.get("aggregator", settings_of(ctx).aggregator)


@hookimpl
def post_process_batch(ctx, batch):
    """Rollouts → rows (when no earlier stage made rows), then the filters the recipe switches on."""
    from agl_plugin_traces.filters import cap_rows_per_rollout, drop_zero_variance_groups

    cfg = settings_of(ctx)
    if "rollouts" in batch.meta and "input_ids" not in batch:
        aggregate = ctx.components.get("aggregator", cfg.aggregator).obj
        if ctx.config.policies:  # several policies: rows per policy, grouped by (policy, task) (agl_core.policy_rows)
            from agl_core.policies import training_policies
            from agl_core.policy_rows import aggregate_by_policy

            trained = training_policies(ctx.config.policies, ctx.config.trainer.agent_match)
            batch = aggregate_by_policy(lambda rollouts: aggregate(ctx, rollouts), batch.meta["rollouts"], trained)
        else:
            batch = aggregate(ctx, batch.meta["rollouts"])
        batch.meta["aggregator"] = cfg.aggregator  # estimators see how the rows were made
    if cfg.drop_zero_variance_groups and len(batch):
        batch, metrics = drop_zero_variance_groups(batch)
        ctx.step_metrics.update(metrics)
    if cfg.max_rows_per_rollout is not None and len(batch):
        # Seeded by the run's seed and the step: a rerun of the recipe keeps the same rows.
        rng = np.random.default_rng((ctx.config.trainer.seed, ctx.step))
        batch, metrics = cap_rows_per_rollout(batch, cfg.max_rows_per_rollout, rng)
        ctx.step_metrics.update(metrics)
    return batch
