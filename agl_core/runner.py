"""The local runner: agent workers (threads) in the trainer's process, fed from the store.

:meth:`LocalRunner.run` queues ``samples`` rollouts per task and supervises
them until every one has ended: it renews the leases of running attempts,
ends an attempt that outlives ``timeout_s`` as ``timed_out``, and lets the
store requeue attempts whose worker was lost. A worker stuck in an agent that
timed out is retired and replaced (a Python thread cannot be killed), so a
hung agent costs a thread, never the step.

Agents may be sync or async functions; an async agent runs on its worker's
own event loop and is cancelled when it times out.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from agl_core.agents import LLM, RolloutScope, agent_name, as_reward, rollout_scope
from agl_core.data import Rollout, Task
from agl_core.store import FAILED, SUCCEEDED, TIMED_OUT, Attempt, NewRollout, Store

log = logging.getLogger("agl_core.runner")

MAX_ERROR_CHARS = 4000
IDLE_POLL_S = 0.2
"""How long an idle worker waits on the store before checking whether it should stop."""


@dataclass
class _Running:
    """An attempt a worker is running, as the supervisor sees it."""

    attempt: Attempt
    worker: _Worker
    deadline: float
    cancel: Callable[[], None] | None = None  # set for async agents


@dataclass
class _Worker:
    name: str
    thread: threading.Thread | None = None
    retired: bool = False


@dataclass
class RunResult:
    """The rollouts of one :meth:`LocalRunner.run`, in task order, and their metrics."""

    rollouts: list[Rollout]
    metrics: dict[str, float] = field(default_factory=dict)


class LocalRunner:
    """Runs ``agent`` on rollouts from ``store`` with ``n_workers`` threads.

    ``llm_for(rollout_id, attempt_id)`` builds the :class:`~agl_core.agents.LLM`
    an attempt gets (its base URL points at the gateway).
    """

    def __init__(self, store: Store, agent: Callable, llm_for: Callable[[str, str], LLM], *, n_workers: int = 8,
                 timeout_s: float = 600.0, lease_s: float = 30.0, max_attempts: int = 2):
        self.store, self.agent, self.llm_for = store, agent, llm_for
        self.n_workers, self.timeout_s, self.lease_s, self.max_attempts = n_workers, timeout_s, lease_s, max_attempts
        self.agent_name = agent_name(agent)
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
            getattr(agent, "__call__", None))
        self._running: dict[tuple[str, str], _Running] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._workers: list[_Worker] = []
        self._names = itertools.count()

    # ------------------------------------------------------------ workers

    def start(self) -> LocalRunner:
        """Start the workers (they wait for queued rollouts)."""
        for _ in range(self.n_workers):
            self._spawn_worker()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the workers to stop and wait up to ``timeout_s`` for the ones not stuck in an agent."""
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))

    def _spawn_worker(self) -> None:
        self._workers = [w for w in self._workers if w.thread.is_alive()]  # forget retired workers that exited
        worker = _Worker(f"agl-runner-{next(self._names)}")
        worker.thread = threading.Thread(target=self._work, args=(worker,), name=worker.name, daemon=True)
        self._workers.append(worker)
        worker.thread.start()

    def _work(self, worker: _Worker) -> None:
        loop = asyncio.new_event_loop() if self.is_async else None
        try:
            while not self._stopping.is_set() and not worker.retired:
                attempt = self.store.dequeue(worker.name, self.lease_s, wait_s=IDLE_POLL_S)
                if attempt is None:
                    continue
                running = _Running(attempt, worker, time.monotonic() + self.timeout_s)
                with self._lock:
                    self._running[attempt.rollout_id, attempt.attempt_id] = running
                status, reward, error = self._run_agent(attempt, running, loop)
                with self._lock:
                    still_ours = self._running.pop((attempt.rollout_id, attempt.attempt_id), None) is not None
                if still_ours:  # else the supervisor ended it (timed out) and retired this worker
                    self.store.finish(attempt.rollout_id, attempt.attempt_id, status, reward, error)
        except Exception:  # a store failure: the lease runs out and the rollout is requeued elsewhere
            log.exception("runner worker %s stopped", worker.name)
        finally:
            if loop is not None:
                loop.close()

    def _run_agent(self, attempt: Attempt, running: _Running,
                   loop: asyncio.AbstractEventLoop | None) -> tuple[str, float | None, str | None]:
        """(status, final reward, error) of one attempt; an exception of the agent is a failure, never a crash."""
        llm = self.llm_for(attempt.rollout_id, attempt.attempt_id)
        scope = RolloutScope(attempt.rollout_id, attempt.attempt_id, self.store, self.agent_name)
        try:
            with rollout_scope(scope):
                if loop is None:
                    returned = self.agent(attempt.task, llm)
                else:
                    task = loop.create_task(self.agent(attempt.task, llm))
                    running.cancel = lambda: loop.call_soon_threadsafe(task.cancel)
                    returned = loop.run_until_complete(task)
            reward = as_reward(returned, f"the reward returned by agent {self.agent_name!r}")
        except BaseException as exc:  # noqa: BLE001 - the agent's failure is data, recorded with its text
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return FAILED, None, traceback.format_exc()[-MAX_ERROR_CHARS:]
        return SUCCEEDED, reward if reward is not None else scope.last_reward, None

    # ------------------------------------------------------------ supervision

    def run(self, tasks: list[Task], samples: int = 1, metadata: dict[str, Any] | None = None,
            progress: bool = False, id_prefix: str = "rollout") -> RunResult:
        """Run ``samples`` rollouts of each task; return them all once each has ended (in any status).

        ``metadata`` is stored with every rollout (the agent name, the task id
        and the sample index are added).
        Never waits past every attempt's timeout: a rollout that cannot end
        by itself is ended by the supervisor.
        """
        metadata = {"agent_name": self.agent_name, **(metadata or {})}
        new = [NewRollout(f"{id_prefix}-{uuid.uuid4().hex[:12]}", task, sample, self.max_attempts,
                          {**metadata, "task_id": task.id, "sample_index": sample})
               for task in tasks for sample in range(samples)]
        ids = [r.rollout_id for r in new]
        self.store.enqueue(new)
        bar = tqdm(total=len(ids), desc="rollouts", disable=not progress, leave=False, dynamic_ncols=True)
        next_heartbeat = time.monotonic() + self.lease_s / 3
        try:
            while True:
                done = self.store.wait(ids, timeout_s=min(0.1, self.lease_s / 3))
                bar.update(len(done) - bar.n)
                if len(done) == len(ids):
                    break
                self._end_overdue()
                if time.monotonic() >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self.lease_s / 3
        finally:
            bar.close()
        rollouts = self.store.get_rollouts(ids)
        self.store.release(ids)
        return RunResult(rollouts, rollout_metrics(rollouts))

    def _end_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [(key, r) for key, r in self._running.items() if r.deadline <= now]
            for key, _ in overdue:
                del self._running[key]
        for (rollout_id, attempt_id), running in overdue:
            self.store.finish(rollout_id, attempt_id, TIMED_OUT,
                              error=f"the agent did not finish within rollout.timeout_s={self.timeout_s:g}")
            running.worker.retired = True
            if running.cancel is not None:
                running.cancel()
            if not self._stopping.is_set():
                self._spawn_worker()
            log.warning("rollout %s timed out; worker %s retired and replaced", rollout_id, running.worker.name)

    def _heartbeat(self) -> None:
        with self._lock:
            keys = list(self._running)
        for rollout_id, attempt_id in keys:
            self.store.heartbeat(rollout_id, attempt_id, self.lease_s)


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """``rollout/…`` metrics of a step: counts by outcome, retries, and latency percentiles (seconds)."""
    metrics = {
        "rollout/n_rollouts": float(len(rollouts)),
        "rollout/n_succeeded": float(sum(r.status == SUCCEEDED for r in rollouts)),
        "rollout/n_failed": float(sum(r.status == FAILED for r in rollouts)),
        "rollout/n_timed_out": float(sum(r.status == TIMED_OUT for r in rollouts)),
        "rollout/n_retried": float(sum(r.attempts > 1 for r in rollouts)),
    }
    latencies = [r.end_time - r.start_time for r in rollouts if r.start_time is not None and r.end_time is not None]
    if latencies:
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        metrics.update({"rollout/latency_s/p50": float(p50), "rollout/latency_s/p90": float(p90),
                        "rollout/latency_s/p99": float(p99), "rollout/latency_s/max": float(max(latencies))})
    return metrics
