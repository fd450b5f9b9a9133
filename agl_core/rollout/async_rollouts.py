"""Asynchronous training: the next steps' rollouts are collected while the backend computes and updates.

With ``trainer.async.max_staleness = k >= 1`` the trainer no longer asks the
``collect_rollouts`` slot for a step's rollouts and waits. :class:`AsyncRollouts`
queues the batches of steps ``t .. t + k`` in the run's store when step ``t``
starts, so the runners play the next steps' games while the backend computes
log-probs and updates; step ``t`` then waits only for its own batch. Every
batch is queued while weights of version ``>= t - 1`` serve, so a rollout
trained at step ``t + k`` is at most ``k`` updates stale
(:mod:`agl_core.rollout.staleness`); the bound is still checked when a batch is taken
(a group over it is dropped whole and counted, never trained).

After the actor's update the new weights reach the policy endpoint
(:meth:`AsyncRollouts.sync_weights`): the gateway holds new calls and lets
those in flight finish under the old weights, the backend swaps (the
``weight_sync`` callable it put in ``ctx.state``), the gateway resumes. A
backend that swaps between two of its generation batches and reports the
version in each answer (the embedded one) says so
(:data:`SYNCS_BETWEEN_CALLS`), and the gateway is not held: calls in the
batch being generated finish under the old weights, calls waiting for the
next batch get the new ones, each recorded with its version.

The batches queued and not yet trained are part of a checkpoint
(:meth:`state_dict`); a resumed run takes a group whose rollouts all
succeeded in the store before the stop, and queues a group again (new
samples of its task) when any of its rollouts is missing (an in-memory store
after a kill), unfinished or failed: no task of a carried-over batch is lost,
no rollout is trained twice in the run's lineage of weights.

The rollout plane is whichever fills ``collect_rollouts`` (:func:`plane_of`):
the local runner (store, gateway and agent threads in the trainer's process;
its gateway pauses around a sync), or runners elsewhere through a store and a
gateway service (``remote_runners``, agl-plugin-ray): the sync then tells the
gateway service the new version without pausing it, and each span takes the
version the policy server reports in its answer (the embedded backend reports
the version of the weights that made every answer).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ContextManager

from agl_core.builtin import local_runner, remote_runners
from agl_core.config import AsyncConfig
from agl_core.context import TrainContext
from agl_core.data import Rollout, Task
from agl_core.gateway.client import set_policy
from agl_core.gateway.weight_sync import Drained
from agl_core.plugins import PluginError
from agl_core.rollout.runner import enqueue_samples, rollout_metrics, wait_all
from agl_core.rollout.staleness import within_bound
from agl_core.rollout.store import SUCCEEDED, TERMINAL, Store
from agl_core.rollout.tasks import TaskSampler

log = logging.getLogger("agl_core.async")

WEIGHT_SYNC = "weight_sync"
"""Key in ``ctx.state`` of the backend's ``sync(version)``: afterwards the policy endpoint serves the trainer's
weights of update ``version``. A backend that supports asynchronous training sets it in ``on_train_start``."""

SYNCS_BETWEEN_CALLS = "weight_sync_between_calls"
"""Key in ``ctx.state``, set True by a backend whose ``sync`` swaps the weights between two generation batches of
its policy server, and whose every answer reports the version that made it (``weight_version``): a call is then
never served by two versions, so the gateway need not hold calls around a sync (all 32 agents waiting for the
slowest call in flight: ~0.1 s of every step on the default recipe)."""

STATE_KEY = "async"
"""Key of :meth:`AsyncRollouts.state_dict` in the core's checkpoint state."""


@dataclass
class Plane:
    """What the pipeline needs of the run's rollout plane.

    ``set_version(v)``: the gateway records ``v`` on calls whose policy server
    reports no version. ``paused(timeout)``: the gateway holds new calls and
    drains those in flight for the block (None: a gateway service, not paused).
    """

    store: Store
    set_version: Callable[[int], None]
    paused: Callable[[float], ContextManager[Drained]] | None
    max_attempts: int
    agent_name: str | None = None


def plane_of(ctx: TrainContext) -> Plane:
    """The rollout plane of the plugin that fills ``collect_rollouts``; PluginError when it has none to offer.

    Supported: ``local_runner``; ``remote_runners``; and a plugin whose
    ``ctx.state[<its name>]`` holds ``store``, ``gateway_url`` and
    ``gateway_token`` (agl-plugin-ray's runtime): runners elsewhere leasing from
    that store and calling that gateway service.
    """
    owner = ctx.slots.get("collect_rollouts", (None, None))[0]
    if owner == local_runner.NAME:
        rt = local_runner.runtime(ctx)
        rt.gateway.upstreams.set(local_runner.policy_urls(ctx))

        def set_local(version: int) -> None:
            rt.gateway.weight_version = version

        return Plane(rt.store, set_local, rt.gateway.calls.paused, rt.runner.max_attempts, rt.runner.agent_name)
    if owner == remote_runners.NAME:
        cfg = ctx.plugin_config(owner)
        store, url, token = ctx.state[owner], cfg.gateway_url, remote_runners.gateway_token(cfg)
    elif all(hasattr(ctx.state.get(owner), key) for key in ("store", "gateway_url", "gateway_token")):
        held = ctx.state[owner]
        store, url, token = held.store, held.gateway_url, held.gateway_token
    else:
        raise PluginError(f"trainer.async.max_staleness={ctx.config.trainer.async_.max_staleness} needs a rollout "
                          f"plane the trainer can queue the next steps' rollouts in (local_runner, remote_runners, "
                          f"agl-plugin-ray), but collect_rollouts is filled by plugin {owner!r}; set "
                          f"trainer.async.max_staleness=0 to train synchronously")

    def set_remote(version: int) -> None:
        set_policy(url, urls=local_runner.policy_urls(ctx), weight_version=version,
                   sampling=local_runner.gateway_sampling(ctx), seed=local_runner.gateway_seed(ctx), token=token)

    return Plane(store, set_remote, None, ctx.config.rollout.max_attempts)


@dataclass
class Group:
    """The ``rollout.n`` rollouts of one task in one step: GRPO's group, taken or dropped whole.

    No ``rollout_ids`` yet: a group deferred until its step starts (``trainer.async.prefetch_share``).
    """

    task: Task
    rollout_ids: list[str]


@dataclass
class Pending:
    """A step's batch, queued and not yet trained."""

    step: int
    epoch: int
    groups: list[Group]


class AsyncRollouts:
    """The queued batches of the next steps, taken step by step within the staleness bound."""

    def __init__(self, ctx: TrainContext, sampler: TaskSampler, config: AsyncConfig, total_steps: int):
        self.ctx, self.sampler, self.config, self.total_steps = ctx, sampler, config, total_steps
        self.pending: dict[int, Pending] = {}
        self._resumed: list[dict[str, Any]] = []  # batches of a checkpoint, checked against the store at start
        self._requeued_groups = 0  # reported with the next step taken
        self._runner_idle_s = 0.0  # likewise
        self.plane: Plane | None = None  # at start

    @property
    def max_staleness(self) -> int:
        return self.config.max_staleness

    # ------------------------------------------------------------ start

    def start(self) -> None:
        """Check the run can train asynchronously; point the gateway at the policy; settle a checkpoint's batches.

        Called after ``on_train_start``, when the backend and the rollout plane are up.
        """
        ctx = self.ctx
        self.plane = plane_of(ctx)
        if WEIGHT_SYNC not in ctx.state:
            backend = ctx.slots.get("update_actor", (None, None))[0]
            raise PluginError(f"trainer.async.max_staleness={self.max_staleness}: the backend (plugin {backend!r}, "
                              f"which fills update_actor) cannot serve one version of the weights while it trains "
                              f"the next (it put no ctx.state[{WEIGHT_SYNC!r}]); set trainer.async.max_staleness=0")
        self.plane.set_version(ctx.step)  # the updates the served weights have had
        for batch in self._resumed:
            self._restore(batch)
        self._resumed = []

    # ------------------------------------------------------------ a step

    def batch(self, step: int) -> tuple[list[Task], int]:
        """Step ``step``'s tasks and epoch, once its batch and (a share of) those of steps ``step + 1 .. step + k``
        are queued.

        A later step's batch is queued with only ``prefetch_share`` of its
        groups; the others are queued when that step starts, after the
        weight sync before it, and first: the runners play them with the
        newest weights while the trainer waits for them.
        """
        if step not in self.pending:
            self.pending[step] = self._draw(step, share=1.0)
        batch = self.pending[step]
        deferred = [i for i, group in enumerate(batch.groups) if not group.rollout_ids]
        if deferred:
            queued = self._enqueue(step, [batch.groups[i].task for i in deferred])
            for i, group in zip(deferred, queued):
                batch.groups[i] = group
        for ahead in range(step + 1, min(step + self.max_staleness, self.total_steps) + 1):
            if ahead not in self.pending:
                self.pending[ahead] = self._draw(ahead, share=self.config.prefetch_share)
        return [group.task for group in batch.groups], batch.epoch

    def _draw(self, step: int, share: float) -> Pending:
        """The next batch of the sampler for ``step``, with ``share`` of its groups (at least one) queued now."""
        tasks = self.sampler.next_batch()
        now = max(1, math.ceil(share * len(tasks)))
        groups = self._enqueue(step, tasks[:now]) + [Group(task, []) for task in tasks[now:]]
        return Pending(step, self.sampler.epoch, groups)

    def take(self, step: int) -> list[Rollout]:
        """Wait for step ``step``'s batch; return the rollouts of its groups within the bound, in task order.

        Reports the ``rollout/…`` metrics of the batch and ``async/…``:
        staleness, rollouts dropped over the bound, the seconds the trainer
        waited (``async/backend_idle_s``) and the seconds the runners had no
        work of this run before it was queued (``async/runner_idle_s``).
        """
        ctx, store = self.ctx, self.plane.store
        batch = self.pending.pop(step)
        ids = [rollout_id for group in batch.groups for rollout_id in group.rollout_ids]
        start = time.monotonic()
        wait_all(store, ids)
        waited = time.monotonic() - start
        rollouts = store.get_rollouts(ids)
        store.release(ids)
        by_id = {r.rollout_id: r for r in rollouts}
        groups = [[by_id[i] for i in group.rollout_ids if i in by_id] for group in batch.groups]
        taken = within_bound(groups, step, self.max_staleness)
        ctx.step_metrics.update(rollout_metrics(rollouts))
        ctx.step_metrics.update(taken.metrics())
        ctx.step_metrics["async/backend_idle_s"] = waited
        ctx.step_metrics["async/runner_idle_s"], self._runner_idle_s = self._runner_idle_s, 0.0
        if self._requeued_groups:
            ctx.step_metrics["async/n_groups_requeued"] = float(self._requeued_groups)
            self._requeued_groups = 0
        if taken.n_stale_dropped:
            log.warning("step %d: %d rollouts (%d groups) were served by weights more than "
                        "trainer.async.max_staleness=%d updates old; dropped", step, taken.n_stale_dropped,
                        taken.n_groups_dropped, self.max_staleness)
        return taken.rollouts

    def sync_weights(self, version: int) -> dict[str, float]:
        """Make the policy endpoint serve the trainer's weights of update ``version``; return ``async/…`` metrics.

        The gateway holds new calls and drains those in flight (up to
        ``trainer.async.drain_timeout_s``), the backend swaps, the gateway
        resumes: no call fails, and each call is recorded with the version
        that served it. The gateway is not paused when the backend swaps
        between calls itself (:data:`SYNCS_BETWEEN_CALLS`), nor is a gateway
        service (see the module's docstring).
        """
        plane, sync = self.plane, self.ctx.state[WEIGHT_SYNC]
        start = time.monotonic()
        hold = plane.paused is not None and not self.ctx.state.get(SYNCS_BETWEEN_CALLS)
        pause = plane.paused(self.config.drain_timeout_s) if hold else contextlib.nullcontext()
        with pause as drained:
            sync(version)
            plane.set_version(version)
        metrics = {"async/weight_sync_s": time.monotonic() - start}
        if drained is not None:
            metrics.update({"async/weight_sync_drain_s": drained.wait_s,
                            "async/weight_sync_undrained": float(drained.still_in_flight)})
        return metrics

    # ------------------------------------------------------------ queueing

    def _enqueue(self, step: int, tasks: list[Task]) -> list[Group]:
        """Queue ``rollout.n`` rollouts of each task for ``step``, as the runners' plugin would for that step."""
        ctx, plane = self.ctx, self.plane
        self._runner_idle_s += self._runners_idle_for()
        n = ctx.config.rollout.n
        metadata = {"mode": "train", "step": step, "run_id": ctx.run_id}
        if plane.agent_name is not None:
            metadata = {"agent_name": plane.agent_name, **metadata}
        ids = enqueue_samples(plane.store, tasks, n, metadata=metadata, id_prefix=f"train-{step}",
                              max_attempts=plane.max_attempts)
        return [Group(task, ids[i * n:(i + 1) * n]) for i, task in enumerate(tasks)]

    def _runners_idle_for(self) -> float:
        """Seconds since the last queued rollout of this run ended, when all have (the runners had nothing to do)."""
        store = self.plane.store
        ids = [i for batch in self.pending.values() for group in batch.groups for i in group.rollout_ids]
        if not ids or len(store.wait(ids, timeout_s=0)) < len(ids):
            return 0.0
        wanted = set(ids)
        ends = [r.end_time for r in store.query(sorted(TERMINAL)) if r.rollout_id in wanted and r.end_time]
        return max(0.0, time.time() - max(ends)) if ends else 0.0

    # ------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """The batches queued and not yet trained: steps, epochs, tasks and rollout ids."""
        return {"batches": [{"step": b.step, "epoch": b.epoch,
                             "groups": [{"task": g.task.model_dump(mode="json"), "rollout_ids": g.rollout_ids}
                                        for g in b.groups]}
                            for b in sorted(self.pending.values(), key=lambda b: b.step)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Batches of a checkpoint; at :meth:`start` each group is taken from the store or queued again."""
        self._resumed = list(state["batches"])

    def _restore(self, batch: dict[str, Any]) -> None:
        store = self.plane.store
        groups, requeued = [], 0
        for saved in batch["groups"]:
            group = Group(Task.model_validate(saved["task"]), list(saved["rollout_ids"]))
            if not group.rollout_ids:  # deferred: queued when its step starts
                groups.append(group)
                continue
            found = store.get_rollouts(group.rollout_ids)
            if len(found) == len(group.rollout_ids) and all(r.status == SUCCEEDED for r in found):
                groups.append(group)
                continue
            store.release(group.rollout_ids)
            groups.extend(self._enqueue(batch["step"], [group.task]))
            requeued += 1
        self.pending[batch["step"]] = Pending(batch["step"], batch["epoch"], groups)
        self._requeued_groups += requeued
        log.info("resumed step %d's batch: %d groups from the store, %d queued again", batch["step"],
                 len(groups) - requeued, requeued)

