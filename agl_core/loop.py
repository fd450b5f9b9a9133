"""The trainer loop: the reference trainer's step and fit, as a sequence of hooks.

Read :meth:`Trainer.train_step` top to bottom: it is the list of stages in
DESIGN.md. Everything a stage does lives in a hook implementation or a pure
function; this module only orders them, times them and gathers metrics.
"""

from __future__ import annotations

import gc
import json
import logging
import random
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from agl_core import checkpoint, run_dir
from agl_core.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty
from agl_core.algorithms.losses import agg_loss_value
from agl_core.algorithms.rollout_correction import tis_weights
from agl_core.balance import balanced_order
from agl_core.batching import rows_to_keep, shuffle_and_floor
from agl_core.components import Components
from agl_core.config import Recipe, resolved, to_yaml
from agl_core.context import TrainContext
from agl_core.data import Batch, Task
from agl_core.rollout.async_rollouts import STATE_KEY as ASYNC_STATE, AsyncRollouts
from agl_core.metrics import (compute_throughput_metrics, compute_timing_metrics, row_statistics, sequence_lengths,
                              summarize)
from agl_core.plugins import PluginSet, call
from agl_core.rollout.tasks import TaskSampler, load_tasks
from agl_core.stop import StopRequest
from agl_core.timing import timer
from agl_core.wiring import plan

log = logging.getLogger("agl_core")


class Trainer:
    """Runs a recipe with a plugin set. ``train_tasks``/``val_tasks`` replace the recipe's files."""

    def __init__(self, recipe: Recipe, plugins: PluginSet,
                 train_tasks: list[Task] | None = None, val_tasks: list[Task] | None = None):
        cfg = recipe
        seed_everything(cfg.trainer.seed)
        self.train_tasks = train_tasks if train_tasks is not None else load_tasks(cfg.data.train_files, "train")
        self.val_tasks = val_tasks if val_tasks is not None else load_tasks(cfg.data.val_files, "val")
        if cfg.data.val_batch_size:
            self.val_tasks = self.val_tasks[: cfg.data.val_batch_size]
        validates = bool(self.val_tasks) and (cfg.trainer.val_before_train or cfg.trainer.test_freq > 0)
        components = Components.collect(plugins)
        self.plan = plan(cfg, plugins, components, validates)
        self.ctx = TrainContext(cfg, plugins, components, Path(cfg.trainer.run_dir), slots=self.plan.slots)
        self.sampler = TaskSampler(self.train_tasks, cfg.data.train_batch_size, cfg.data.shuffle, cfg.trainer.seed)
        self.total_steps = cfg.trainer.total_steps or cfg.trainer.total_epochs * self.sampler.batches_per_epoch
        self.rng = np.random.default_rng(cfg.trainer.seed)
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon) if kl.type == "adaptive"
                        else FixedKLController(kl.kl_coef))
        # trainer.async.max_staleness >= 1: the next steps' rollouts are collected while this one trains.
        self.pipeline = (AsyncRollouts(self.ctx, self.sampler, cfg.trainer.async_, self.total_steps)
                         if cfg.trainer.async_.max_staleness else None)
        # A stop asked for by a signal (agl train installs the handler): honoured between steps.
        self.stop = StopRequest()

    # ------------------------------------------------------------------ the step

    def train_step(self, tasks: list[Task]) -> dict[str, float]:
        """One step of the reference trainer (Agent Lightning's ``_train_step``)."""
        ctx, cfg, plan_ = self.ctx, self.ctx.config, self.plan
        metrics: dict[str, float] = {}
        ctx.step_metrics = metrics
        timing: dict[str, float] = {}
        with timer("step", timing):
            with timer("gen", timing):
                rollouts = (ctx.call("collect_rollouts", tasks=tasks, mode="train") if self.pipeline is None
                            else self.pipeline.take(ctx.step))
            with timer("gen_postprocess", timing):
                batch = self.post_process(Batch(meta={"rollouts": rollouts}))
            if len(batch) == 0:
                log.warning("step %d: no trainable rows (all %d rollouts failed or were filtered); "
                            "skipping the update", ctx.step, len(rollouts))
                metrics["training/skipped_step"] = 1.0
                return metrics
            lengths = sequence_lengths(batch)
            batch.meta["global_token_num"] = (lengths[0] + lengths[1]).long().tolist()

            batch, pad_size = batch.pad_to_divisor(ctx.world_size)
            with timer("old_log_prob", timing):
                batch = ctx.call("compute_old_logprob", batch=batch)
                metrics["actor/entropy"] = agg_loss_value(
                    batch.pop("entropys"), batch["response_mask"], cfg.algorithm.policy_loss.loss_agg_mode)
            if cfg.algorithm.rollout_correction.rollout_is is not None:
                batch["rollout_is_weights"], tis_metrics = self.rollout_correction(batch)
                metrics.update(tis_metrics)
            elif "rollout_log_probs" in batch:
                # Measured on every run, correction or not (one exp over the batch): weights far from 1 mean the
                # served policy is not the trained one (stale or wrong weights, other numerics), which
                # scripts/check_run.py fails a run for.
                correction = cfg.algorithm.rollout_correction
                metrics.update(tis_weights(batch["old_log_probs"], batch["rollout_log_probs"],
                                           batch["response_mask"], correction.rollout_is_threshold)[1])
            if plan_.needs_ref:
                with timer("ref", timing):
                    batch = ctx.call("compute_ref_logprob", batch=batch)
            if plan_.needs_critic:
                with timer("values", timing):
                    batch = ctx.call("compute_values", batch=batch)
            batch = batch.unpad(pad_size)

            with timer("adv", timing):
                if cfg.algorithm.use_kl_in_reward:
                    batch["token_level_rewards"], kl_metrics = apply_kl_penalty(
                        batch["token_level_scores"], batch["old_log_probs"], batch["ref_log_prob"],
                        batch["response_mask"], self.kl_ctrl, cfg.algorithm.kl_penalty)
                    metrics.update(kl_metrics)
                else:
                    batch["token_level_rewards"] = batch["token_level_scores"]
                batch = ctx.call("advantage", batch=batch)
            stats = row_statistics(batch, plan_.needs_critic, lengths)
            metrics.update(summarize(stats, suffix="_before_processing"))

            rows, drop_metrics = rows_to_keep(batch["is_drop_mask"])
            metrics.update(drop_metrics)
            rows, floor_metrics = shuffle_and_floor(rows, cfg.algorithm.ppo_mini_batch_size, self.rng)
            metrics.update(floor_metrics)
            if len(rows) == 0:
                log.warning("step %d: fewer rows than one PPO mini-batch (%d); skipping the update",
                            ctx.step, cfg.algorithm.ppo_mini_batch_size)
                metrics["training/skipped_step"] = 1.0
                return metrics
            if cfg.trainer.balance_batch:
                seqlens = (stats.column("prompt_length") + stats.column("response_length")).astype(np.int64)
                order, balance_metrics = balanced_order(seqlens[rows], ctx.world_size)
                rows = rows[order]
                metrics.update(balance_metrics)
            batch, stats = batch[rows], stats[rows]

            if plan_.needs_critic:
                with timer("update_critic", timing):
                    metrics.update(ctx.call("update_critic", batch=batch))
            if cfg.trainer.critic_warmup <= ctx.step:
                with timer("update_actor", timing):
                    metrics.update(ctx.call("update_actor", batch=batch))
                if self.pipeline is not None:
                    with timer("weight_sync", timing):
                        metrics.update(self.pipeline.sync_weights(ctx.step))

        metrics.update(summarize(stats, suffix="_after_processing"))
        metrics.update(compute_timing_metrics(timing, stats.column("prompt_length").sum(),
                                              stats.column("response_length").sum()))
        metrics.update(compute_throughput_metrics(batch, timing, ctx.world_size))
        return metrics

    def rollout_correction(self, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        """TIS weights between the policy that served the rollouts and the trainer's old log-probs."""
        if "rollout_log_probs" not in batch:
            raise RuntimeError("algorithm.rollout_correction.rollout_is is set, but the batch has no "
                               "rollout_log_probs: the policy server returned no log-probs of its samples")
        correction = self.ctx.config.algorithm.rollout_correction
        return tis_weights(batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"],
                           correction.rollout_is_threshold, level=correction.rollout_is)

    def post_process(self, batch: Batch) -> Batch:
        """Run the ``post_process_batch`` pipeline stage by stage."""
        for name, stage in self.plan.post_process:
            batch = call(stage, {"ctx": self.ctx, "batch": batch})
            if not isinstance(batch, Batch):
                raise TypeError(f"post_process_batch stage {name!r} returned {type(batch).__name__}, not Batch")
        if "input_ids" not in batch and any(r.status == "succeeded" for r in batch.meta.get("rollouts", ())):
            raise RuntimeError("no post_process_batch stage turned the rollouts into rows; "
                               "enable a trace aggregator plugin (agl-plugin-traces)")
        return batch

    # ------------------------------------------------------------------ the run

    def fit(self) -> dict[str, float]:
        """Train for ``total_steps``, validating and checkpointing on schedule; return the last metrics.

        The run directory is this trainer's from start to end (:func:`run_dir.claim`):
        nothing is written into it before, and a second trainer on it fails at once.
        """
        ctx, cfg = self.ctx, self.ctx.config.trainer
        with run_dir.claim(ctx.run_dir):
            # Settled before anything is written, so a bad trainer.resume leaves the directory as it was.
            found = checkpoint.to_resume(ctx.run_dir, cfg.resume, run_dir.read_run_id(ctx.run_dir))
            ctx.run_id = run_dir.prepare(ctx.run_dir, fresh=cfg.resume == "never", overwrite=cfg.overwrite)
            self.write_run_files()
            if found is not None:
                self.load(found)
            return self.run()

    def run(self) -> dict[str, float]:
        """From ``on_train_start`` to ``on_train_end``, which runs whatever happens; return the last metrics."""
        ctx, cfg = self.ctx, self.ctx.config.trainer
        last: dict[str, float] = {}
        try:
            ctx.plugins.broadcast("on_train_start", ctx=ctx)
            if self.pipeline is not None:
                self.pipeline.start()
            # Everything built so far (modules, models, servers) lives as long as the run: out of the cyclic
            # collector's sight, a full collection no longer walks it and stalls every thread (agents, gateway,
            # policy server) for 100+ ms. Measured: 7% less time per step in the default recipe.
            gc.collect()
            gc.freeze()
            log.info("step plan\n%s", self.plan.describe())
            if "validate" in ctx.slots and cfg.val_before_train and ctx.step == 0:
                last = self.validate()
                self.log(last, step=0)
                if cfg.val_only:
                    return last
            progress = tqdm(total=self.total_steps, initial=ctx.step, desc="Training",
                            disable=not cfg.progress, dynamic_ncols=True)
            while ctx.step < self.total_steps:
                self.stop.check()
                ctx.step += 1
                if self.pipeline is None:
                    tasks = self.sampler.next_batch()
                    ctx.epoch = self.sampler.epoch
                else:
                    tasks, ctx.epoch = self.pipeline.batch(ctx.step)
                ctx.plugins.broadcast("on_step_start", ctx=ctx, step=ctx.step)
                last = self.train_step(tasks)
                is_last = ctx.step == self.total_steps
                if "validate" in ctx.slots and cfg.test_freq > 0 and (is_last or ctx.step % cfg.test_freq == 0):
                    last.update(self.validate())
                last.update({"training/global_step": ctx.step, "training/epoch": ctx.epoch})
                ctx.plugins.broadcast("on_step_end", ctx=ctx, step=ctx.step, metrics=last)
                # Logged before the checkpoint: a checkpoint of step s always has step s's records.
                self.log(last, step=ctx.step)
                if cfg.save_freq > 0 and (is_last or ctx.step % cfg.save_freq == 0):
                    self.save_checkpoint()
                progress.update(1)
            progress.close()
        finally:
            gc.unfreeze()  # collectable again once the run is over (a process may train again)
            self.end_plugins()
        return last

    def validate(self) -> dict[str, float]:
        """Run the ``validate`` slot; what hooks report on the side lands under ``val/``."""
        ctx, step_metrics = self.ctx, self.ctx.step_metrics
        ctx.step_metrics = side = {}
        metrics: dict[str, float] = {}
        try:
            with timer("timing_s/validate", metrics):
                metrics.update(ctx.call("validate", tasks=self.val_tasks))
        finally:
            ctx.step_metrics = step_metrics
        metrics.update({f"val/{key}": value for key, value in side.items()})
        return metrics

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.ctx.plugins.broadcast("log_metrics", ctx=self.ctx, metrics=metrics, step=step)

    def end_plugins(self) -> None:
        """``on_train_end`` of every plugin runs, even when one of them raises."""
        errors = []
        for name, fn in self.ctx.plugins.implementations("on_train_end"):
            try:
                call(fn, {"ctx": self.ctx})
            except Exception as exc:
                errors.append(f"{name}: {exc!r}")
        if errors:
            log.error("on_train_end failed in: %s", "; ".join(errors))

    # ------------------------------------------------------- run dir, checkpoints

    def write_run_files(self) -> None:
        """Write the resolved recipe and the active plugin set into the run directory."""
        where = self.ctx.run_dir
        (where / "config.yaml").write_text(to_yaml(resolved(self.ctx.config)))
        (where / checkpoint.MANIFEST).write_text(json.dumps(self.ctx.plugins.manifest(), indent=2))

    def save_checkpoint(self) -> Path:
        ctx = self.ctx
        state = {"sampler": self.sampler.state_dict(), "loop_rng": self.rng.bit_generator.state,
                 "kl_coef": self.kl_ctrl.value, "run_id": ctx.run_id}
        if self.pipeline is not None:  # the batches queued for the next steps: trained after a resume
            state[ASYNC_STATE] = self.pipeline.state_dict()
        return checkpoint.save(ctx.run_dir, ctx.step, state, ctx.plugins.manifest(),
                               lambda path: ctx.plugins.broadcast("save_checkpoint", ctx=ctx, path=path))

    def load(self, path: Path) -> None:
        """Restore the core's state and every plugin's from the checkpoint at ``path``."""
        state = checkpoint.load(path)
        self.ctx.step = state["step"]
        self.sampler.load_state_dict(state["sampler"])
        self.ctx.epoch = self.sampler.epoch
        self.rng.bit_generator.state = state["loop_rng"]
        self.kl_ctrl.value = state["kl_coef"]
        carried = state.get(ASYNC_STATE, {}).get("batches", [])
        if carried and self.pipeline is None:
            raise ValueError(f"checkpoint {path} carries the queued batches of {len(carried)} steps of asynchronous "
                             f"training; resume it with trainer.async.max_staleness >= 1")
        if self.pipeline is not None and ASYNC_STATE in state:
            self.pipeline.load_state_dict(state[ASYNC_STATE])
        self.ctx.plugins.broadcast("load_checkpoint", ctx=self.ctx, path=str(path))
        log.info("resumed from %s at step %d", path, self.ctx.step)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch so a run is reproducible from its recipe."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
