"""The local runner: agent workers (threads) fed from a store, and the step's wait for their rollouts.

:class:`LocalRunner` runs agent workers and a supervisor thread: the
supervisor renews the leases of its running attempts and ends an attempt that
outlives ``timeout_s`` as ``timed_out``, each under the lease token the
store gave with the attempt (the agent's base URL carries it too, so its
calls are recorded for its own attempt only). A worker stuck in an agent that timed
out is retired and replaced (a Python thread cannot be killed), so a hung
agent costs a thread, never the step. The workers run in the trainer's
process (the ``local_runner`` plugin) or in a runner process anywhere
(:mod:`agl_core.rollout.runner_service`): they only need a store.

:func:`collect` is the trainer's side, whoever runs the workers: it queues
``samples`` rollouts per task and waits until every one has ended, requeuing
attempts whose worker was lost meanwhile.

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

from agl_core.data import Rollout, Task
from agl_core.rollout.agents import LLM, RolloutScope, agent_name, as_reward, rollout_scope
from agl_core.rollout.context_record import EXACT, REBUILT
from agl_core.rollout.store import (FAILED, QUEUING, RUNNING, SPANS_LOST, SUCCEEDED, TIMED_OUT, Attempt, NewRollout,
                                    Store)

log = logging.getLogger("agl_core.rollout.runner")
STALL_WARNING_S = 60.0
"""How long a step may wait without any of its rollouts ending before :func:`wait_all` warns."""

MAX_ERROR_CHARS = 4000
IDLE_POLL_S = 0.2
"""How long an idle worker waits on the store before checking whether it should stop."""
SUPERVISE_POLL_S = 0.1
"""How often the supervisor looks for overdue attempts (it renews leases every ``lease_s / 3``)."""
STORE_RETRY_S = 1.0
"""How long a worker waits before leasing again from a store that failed."""


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
    """The rollouts of one :func:`collect`, in task order, and their metrics."""

    rollouts: list[Rollout]
    metrics: dict[str, float] = field(default_factory=dict)


class LocalRunner:
    """Runs ``agent`` on rollouts from ``store`` with ``n_workers`` threads.

    ``llm_for(rollout_id, attempt_id, lease)`` builds the :class:`~agl_core.rollout.agents.LLM`
    an attempt gets (its base URL points at the gateway and carries the lease token). ``max_attempts`` is
    what :meth:`run` gives the rollouts it queues. ``timeout_setting`` names
    where ``timeout_s`` was set, for the error of a timed-out attempt.
    """

    def __init__(self, store: Store, agent: Callable, llm_for: Callable[[str, str, str], LLM], *, n_workers: int = 8,
                 timeout_s: float = 600.0, lease_s: float = 30.0, max_attempts: int = 2,
                 timeout_setting: str = "rollout.timeout_s"):
        self.store, self.agent, self.llm_for = store, agent, llm_for
        self.timeout_setting = timeout_setting
        self.n_workers, self.timeout_s, self.lease_s, self.max_attempts = n_workers, timeout_s, lease_s, max_attempts
        self.agent_name = agent_name(agent)
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(
            getattr(agent, "__call__", None))
        self._running: dict[tuple[str, str], _Running] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()  # no new leases
        self._stopped = threading.Event()  # no more supervision
        self._supervisor: threading.Thread | None = None
        self._workers: list[_Worker] = []
        self._names = itertools.count()

    # ------------------------------------------------------------ workers

    def start(self) -> LocalRunner:
        """Start the workers (they wait for queued rollouts) and their supervisor."""
        for _ in range(self.n_workers):
            self._spawn_worker()
        self._supervisor = threading.Thread(target=self._supervise, name="agl-runner-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop leasing; wait up to ``timeout_s`` for the running attempts to end, then stop supervising them.

        Their leases are renewed while they run; an attempt still running
        afterwards is no longer renewed, so the store requeues it as the
        attempt of a lost worker (or fails it, when it is out of attempts).
        """
        self._stopping.set()
        deadline = time.monotonic() + timeout_s
        for worker in self._workers:
            if worker.thread is not None:
                worker.thread.join(max(0.0, deadline - time.monotonic()))
        self._stopped.set()
        if self._supervisor is not None:
            self._supervisor.join()

    @property
    def n_running(self) -> int:
        """Attempts this runner's workers are running now."""
        with self._lock:
            return len(self._running)

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
                try:
                    attempt = self.store.dequeue(worker.name, self.lease_s, wait_s=IDLE_POLL_S)
                except Exception:  # noqa: BLE001 - a store that fails now may answer later: the worker stays
                    log.exception("runner worker %s cannot lease from the store; retrying in %g s",
                                  worker.name, STORE_RETRY_S)
                    self._stopping.wait(STORE_RETRY_S)
                    continue
                if attempt is None:
                    continue
                running = _Running(attempt, worker, time.monotonic() + self.timeout_s)
                with self._lock:
                    self._running[attempt.rollout_id, attempt.attempt_id] = running
                status, reward, error = self._run_agent(attempt, running, loop)
                with self._lock:
                    still_ours = self._running.pop((attempt.rollout_id, attempt.attempt_id), None) is not None
                if still_ours:  # else the supervisor ended it (timed out) and retired this worker
                    self._finish(attempt, status, reward, error)
        finally:
            if loop is not None:
                close_loop(loop)

    def _finish(self, attempt: Attempt, status: str, reward: float | None = None, error: str | None = None) -> None:
        try:
            self.store.finish(attempt.rollout_id, attempt.attempt_id, status, reward, error, lease=attempt.lease)
        except Exception:  # noqa: BLE001 - the lease runs out and the store requeues the rollout elsewhere
            log.exception("cannot record the end (%s) of attempt %s of rollout %s", status, attempt.attempt_id,
                          attempt.rollout_id)

    def _run_agent(self, attempt: Attempt, running: _Running,
                   loop: asyncio.AbstractEventLoop | None) -> tuple[str, float | None, str | None]:
        """(status, final reward, error) of one attempt; an exception of the agent is a failure, never a crash."""
        llm = self.llm_for(attempt.rollout_id, attempt.attempt_id, attempt.lease)
        scope = RolloutScope(attempt.rollout_id, attempt.attempt_id, self.store, self.agent_name, lease=attempt.lease)
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

    def _supervise(self) -> None:
        """Until :meth:`stop`: end overdue attempts at once, renew the leases of the others every ``lease_s / 3``."""
        next_heartbeat = time.monotonic() + self.lease_s / 3
        while not self._stopped.wait(min(SUPERVISE_POLL_S, self.lease_s / 3)):
            try:
                self._end_overdue()
                if time.monotonic() >= next_heartbeat:
                    self._heartbeat()
                    next_heartbeat = time.monotonic() + self.lease_s / 3
            except Exception:  # noqa: BLE001 - a store that fails now may answer at the next round
                log.exception("the runner's supervisor cannot reach the store")

    def _end_overdue(self) -> None:
        now = time.monotonic()
        with self._lock:
            overdue = [(key, r) for key, r in self._running.items() if r.deadline <= now]
            for key, _ in overdue:
                del self._running[key]
        for (rollout_id, attempt_id), running in overdue:
            self._finish(running.attempt, TIMED_OUT,
                         error=f"the agent did not finish within {self.timeout_setting}={self.timeout_s:g}")
            running.worker.retired = True
            if running.cancel is not None:
                running.cancel()
            if not self._stopping.is_set():
                self._spawn_worker()
            log.warning("rollout %s timed out; worker %s retired and replaced", rollout_id, running.worker.name)

    def _heartbeat(self) -> None:
        with self._lock:
            attempts = [running.attempt for running in self._running.values()]
        for attempt in attempts:
            self.store.heartbeat(attempt.rollout_id, attempt.attempt_id, self.lease_s, lease=attempt.lease)

    # ------------------------------------------------------------ one step

    def run(self, tasks: list[Task], samples: int = 1, metadata: dict[str, Any] | None = None,
            progress: bool = False, id_prefix: str = "rollout", ahead: bool = False) -> RunResult:
        """:func:`collect` of the tasks on this runner's store, with its agent's name and ``max_attempts``.

        Never waits past every attempt's timeout: a rollout that cannot end
        by itself is ended by the supervisor.
        """
        return collect(self.store, tasks, samples, metadata={"agent_name": self.agent_name, **(metadata or {})},
                       id_prefix=id_prefix, max_attempts=self.max_attempts, progress=progress, ahead=ahead)


def collect(store: Store, tasks: list[Task], samples: int = 1, *, metadata: dict[str, Any] | None = None,
            id_prefix: str = "rollout", max_attempts: int = 2, progress: bool = False,
            poll_s: float = 1.0, ahead: bool = False) -> RunResult:
    """Queue ``samples`` rollouts of each task in ``store``; return them all once each has ended (in any status).

    Whoever leases from ``store`` runs them: this process's workers or
    runners anywhere. ``metadata`` is stored with every rollout (the task id
    and the sample index are added). Every ``poll_s`` the store requeues the
    attempts whose lease ran out, so the rollouts of a lost runner go to
    another (or fail, when out of attempts) even if no runner is asking for
    work. The rollouts are released from the store once read. ``ahead``
    queues them ahead of those already queued (:class:`~agl_core.rollout.store.NewRollout`).
    """
    ids = enqueue_samples(store, tasks, samples, metadata=metadata, id_prefix=id_prefix, max_attempts=max_attempts,
                          ahead=ahead)
    bar = tqdm(total=len(ids), desc="rollouts", disable=not progress, leave=False, dynamic_ncols=True)
    try:
        wait_all(store, ids, poll_s, on_progress=lambda done: bar.update(done - bar.n))
    finally:
        bar.close()
    rollouts = store.get_rollouts(ids)
    store.release(ids)
    return RunResult(rollouts, rollout_metrics(rollouts))


def enqueue_samples(store: Store, tasks: list[Task], samples: int, *, metadata: dict[str, Any] | None = None,
                    id_prefix: str = "rollout", max_attempts: int = 2, ahead: bool = False) -> list[str]:
    """Queue ``samples`` rollouts of each task (task after task); return their ids in that order.

    Each rollout's metadata is ``metadata`` with its task id and sample index.
    """
    new = [NewRollout(f"{id_prefix}-{uuid.uuid4().hex[:12]}", task, sample, max_attempts,
                      {**(metadata or {}), "task_id": task.id, "sample_index": sample}, ahead)
           for task in tasks for sample in range(samples)]
    store.enqueue(new)
    return [r.rollout_id for r in new]


def wait_all(store: Store, rollout_ids: list[str], poll_s: float = 1.0,
             on_progress: Callable[[int], None] | None = None, stall_warning_s: float = STALL_WARNING_S) -> None:
    """Return once every rollout of ``rollout_ids`` has ended; every ``poll_s`` requeue the attempts of lost workers.

    ``on_progress`` is told how many have ended, after each poll. When none
    has ended for ``stall_warning_s``, a warning says so (runners elsewhere
    may be missing: nothing here would end their rollouts), and again after
    each further such stretch.
    """
    ended, since = 0, time.monotonic()
    while True:
        done = store.wait(rollout_ids, timeout_s=poll_s)
        if on_progress is not None:
            on_progress(len(done))
        if len(done) == len(rollout_ids):
            return
        if len(done) > ended:
            ended, since = len(done), time.monotonic()
        elif time.monotonic() - since >= stall_warning_s:
            log.warning("no rollout of this step has ended for %g s (%d of %d still to end): are runners leasing "
                        "from the store?", time.monotonic() - since, len(rollout_ids) - len(done), len(rollout_ids))
            since = time.monotonic()
        store.requeue_expired()


def cancel_abandoned(store: Store, run_id: str | None) -> int:
    """End as failed the unfinished rollouts an earlier trainer of run ``run_id`` queued; return how many.

    Nobody waits for them any more. Rollouts of other runs (a store service
    shared by several trainers) are left alone; those that carry no run id
    were queued before rollouts carried one and are ended too.
    """
    mine = [r.rollout_id for r in store.query([QUEUING, RUNNING]) if r.metadata.get("run_id") in (run_id, None)]
    return store.cancel(mine, "abandoned: the trainer that queued it stopped") if mine else 0


def context_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """How the gateway made the prompts of the step's chat calls (agl_core.gateway.contexts): ``exact`` (an
    earlier call's token ids continued) and ``rebuilt`` (sent as text though earlier calls exist); counts of calls."""
    counts = {EXACT: 0, REBUILT: 0}
    for rollout in rollouts:
        for span in rollout.spans:
            kind = span.attributes.get("context") if span.kind == "llm_call" else None
            if kind in counts:
                counts[kind] += 1
    return {"rollout/n_context_exact": float(counts[EXACT]), "rollout/n_context_rebuilt": float(counts[REBUILT])}


def rollout_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """``rollout/…`` metrics of a step: counts by outcome (``n_spans_lost``: failed because some of their spans
    could not be written), retries, and latency percentiles (seconds)."""
    metrics = {
        "rollout/n_rollouts": float(len(rollouts)),
        "rollout/n_succeeded": float(sum(r.status == SUCCEEDED for r in rollouts)),
        "rollout/n_failed": float(sum(r.status == FAILED for r in rollouts)),
        "rollout/n_timed_out": float(sum(r.status == TIMED_OUT for r in rollouts)),
        "rollout/n_spans_lost": float(sum(r.status == FAILED and (r.error or "").startswith(SPANS_LOST)
                                          for r in rollouts)),
        "rollout/n_retried": float(sum(r.attempts > 1 for r in rollouts)),
        **context_metrics(rollouts),
    }
    latencies = [r.end_time - r.start_time for r in rollouts if r.start_time is not None and r.end_time is not None]
    if latencies:
        p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
        metrics.update({"rollout/latency_s/p50": float(p50), "rollout/latency_s/p90": float(p90),
                        "rollout/latency_s/p99": float(p99), "rollout/latency_s/max": float(max(latencies))})
    return metrics


def close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Close a worker's event loop as ``asyncio.run`` closes its own.

    What the agents left behind (a task an SDK cancelled, the ``aclose`` of an async generator dropped
    mid-iteration) is cancelled and run to its end and the async generators are finalized first; a loop
    closed over them makes asyncio log "Task was destroyed but it is pending!" once for each.
    """
    try:
        loop.run_until_complete(asyncio.sleep(0))  # callbacks scheduled from other threads (a finalizer's) make their tasks
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()
