"""Built-in plugin ``memory_store``: the store ``memory``, held in this process's memory.

Fast and gone with the process: for tests and short runs. Use the ``sqlite``
store (agl-plugin-sqlite) to keep rollouts across a crash.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.data import Rollout, Span, Task
from agl_core.http.recordable import check_span
from agl_core.rollout.store import (FAILED, QUEUING, RUNNING, TERMINAL, Attempt, AttemptState, LeaseError, Leases,
                                    NewRollout, check_lease, conflict_error, ended_error, lease_expired_error,
                                    new_lease)

AGL_HOOK_API = HOOK_API_VERSION


@dataclass
class _Entry:
    task: Task
    sample_index: int
    max_attempts: int
    metadata: dict[str, Any]
    status: str = QUEUING
    attempts: int = 0
    worker_id: str | None = None
    lease_expires: float = 0.0
    final_reward: float | None = None
    error: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    lease: str = ""
    spans: list[Span] = field(default_factory=list)
    span_keys: dict[tuple[str | None, int], Span] = field(default_factory=dict)
    """Each span held by (attempt id, sequence id): a span written again is kept once, as in every store."""
    next_sequence_id: int = 0

    @property
    def attempt_id(self) -> str | None:
        return str(self.attempts) if self.attempts else None


class MemoryStore:
    """The :class:`~agl_core.rollout.store.Store` protocol on dicts, guarded by one condition variable."""

    admits_at_once = True  # see Store.admit

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._queue: deque[str] = deque()
        self._changed = threading.Condition()

    # ------------------------------------------------------------ queue and attempts

    def enqueue(self, rollouts: Sequence[NewRollout]) -> None:
        with self._changed:
            for new in rollouts:
                if new.rollout_id in self._entries:
                    raise ValueError(f"rollout {new.rollout_id!r} is already in the store")
            for new in rollouts:
                self._entries[new.rollout_id] = _Entry(new.task, new.sample_index, new.max_attempts,
                                                       dict(new.metadata))
            behind = [new.rollout_id for new in rollouts if not new.ahead]
            ahead = [new.rollout_id for new in rollouts if new.ahead]
            self._queue.extend(behind)
            self._queue.extendleft(reversed(ahead))
            self._changed.notify_all()

    def dequeue(self, worker_id: str, lease_s: float, wait_s: float = 0.0) -> Attempt | None:
        deadline = time.monotonic() + wait_s
        with self._changed:
            while True:
                self._requeue_expired_locked()
                if self._queue:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(self._until_next_expiry(left))
            rollout_id = self._queue.popleft()
            entry = self._entries[rollout_id]
            entry.status, entry.worker_id = RUNNING, worker_id
            entry.attempts += 1
            entry.start_time = time.time()
            entry.lease_expires = time.monotonic() + lease_s
            entry.lease = new_lease()
            return Attempt(rollout_id, entry.attempt_id, entry.task, entry.sample_index, dict(entry.metadata),
                           entry.lease)

    def heartbeat(self, rollout_id: str, attempt_id: str, lease_s: float, *, lease: str | None = None) -> bool:
        with self._changed:
            entry = self._running(rollout_id, attempt_id, lease)
            if entry is None:
                return False
            entry.lease_expires = time.monotonic() + lease_s
            return True

    def finish(self, rollout_id: str, attempt_id: str, status: str,
               final_reward: float | None = None, error: str | None = None, *, lease: str | None = None) -> bool:
        if status not in TERMINAL:
            raise ValueError(f"finish needs a terminal status ({', '.join(sorted(TERMINAL))}), got {status!r}")
        with self._changed:
            entry = self._running(rollout_id, attempt_id, lease)
            if entry is None:
                return False
            entry.status, entry.final_reward, entry.error = status, final_reward, error
            entry.end_time = time.time()
            self._changed.notify_all()
            return True

    def cancel(self, rollout_ids: Sequence[str] | None, reason: str) -> int:
        with self._changed:
            ids = list(self._entries) if rollout_ids is None else rollout_ids
            cancelled = 0
            for rollout_id in ids:
                entry = self._entries.get(rollout_id)
                if entry is None or entry.status in TERMINAL:
                    continue
                if entry.status == QUEUING:
                    self._queue.remove(rollout_id)
                entry.status, entry.error, entry.end_time = FAILED, reason, time.time()
                cancelled += 1
            self._changed.notify_all()
            return cancelled

    def requeue_expired(self) -> int:
        with self._changed:
            return self._requeue_expired_locked()

    def _requeue_expired_locked(self) -> int:
        now = time.monotonic()
        expired = [(rid, e) for rid, e in self._entries.items() if e.status == RUNNING and e.lease_expires < now]
        for rollout_id, entry in reversed(expired):  # reversed + appendleft keeps their order at the front
            entry.error = lease_expired_error(entry.attempt_id, entry.worker_id)
            if entry.attempts < entry.max_attempts:
                entry.status = QUEUING
                self._queue.appendleft(rollout_id)
            else:
                entry.status, entry.end_time = FAILED, time.time()
        if expired:
            self._changed.notify_all()
        return len(expired)

    def _until_next_expiry(self, left: float) -> float:
        # Nobody notifies when a lease runs out: waiters wake up for it themselves.
        leases = [e.lease_expires for e in self._entries.values() if e.status == RUNNING]
        return max(0.0, min([left, *(lease - time.monotonic() for lease in leases)])) + 1e-3

    def attempt_state(self, rollout_id: str, attempt_id: str) -> AttemptState | None:
        with self._changed:
            entry = self._entries.get(rollout_id)
            if entry is None:
                return None
            current = entry.status == RUNNING and entry.attempt_id == attempt_id
            return AttemptState(entry.status, current, entry.metadata)

    def admit(self, rollout_id: str, attempt_id: str, n: int, *,
              lease: str | None = None) -> tuple[AttemptState | None, list[int]]:
        with self._changed:
            state = self.attempt_state(rollout_id, attempt_id)
            if not (state and state.current):
                return state, []
            check_lease(rollout_id, attempt_id, self._entries[rollout_id].lease, lease)
            return state, [self.next_sequence_id(rollout_id) for _ in range(n)]

    def _running(self, rollout_id: str, attempt_id: str, lease: str | None) -> _Entry | None:
        """The entry of the running attempt; None when it is not running; LeaseError for another token."""
        entry = self._entries.get(rollout_id)
        if entry is None or entry.status != RUNNING or entry.attempt_id != attempt_id:
            return None
        check_lease(rollout_id, attempt_id, entry.lease, lease)
        return entry

    # ------------------------------------------------------------ spans

    def next_sequence_id(self, rollout_id: str) -> int:
        with self._changed:
            entry = self._entries.get(rollout_id)
            if entry is None:
                raise KeyError(f"unknown rollout {rollout_id!r}")
            entry.next_sequence_id += 1
            return entry.next_sequence_id - 1

    def add_spans(self, spans: Sequence[Span], *, leases: Leases | None = None) -> None:
        for span in spans:
            check_span(span)
        with self._changed:
            new = []
            for span in spans:
                entry = self._entries.get(span.rollout_id)
                if entry is None:
                    raise KeyError(f"span of unknown rollout {span.rollout_id!r}")
                held = entry.span_keys.get((span.attempt_id, span.sequence_id))
                if held is not None:
                    if held != span:
                        raise LeaseError(conflict_error(span))
                    continue
                if not _accepts(entry, span):
                    raise LeaseError(ended_error(span, entry.status))
                check_lease(span.rollout_id, span.attempt_id, entry.lease, (leases or {}).get(
                    (span.rollout_id, span.attempt_id)))
                new.append((entry, span))
            for entry, span in new:
                if (span.attempt_id, span.sequence_id) not in entry.span_keys:
                    entry.span_keys[span.attempt_id, span.sequence_id] = span
                    entry.spans.append(span)

    def flush(self) -> None:
        """Nothing to do: spans are in memory as soon as they are added."""

    # ------------------------------------------------------------ reading

    def wait(self, rollout_ids: Sequence[str], timeout_s: float) -> set[str]:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                self._requeue_expired_locked()
                done = {rid for rid in rollout_ids if (e := self._entries.get(rid)) and e.status in TERMINAL}
                left = deadline - time.monotonic()
                if len(done) == len(set(rollout_ids)) or left <= 0:
                    return done
                self._changed.wait(self._until_next_expiry(left))

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        with self._changed:
            return [self._rollout(rid, self._entries[rid], with_spans=True)
                    for rid in rollout_ids if rid in self._entries]

    def query(self, statuses: Sequence[str] | None = None) -> list[Rollout]:
        with self._changed:
            return [self._rollout(rid, e, with_spans=False) for rid, e in self._entries.items()
                    if statuses is None or e.status in statuses]

    @staticmethod
    def _rollout(rollout_id: str, entry: _Entry, with_spans: bool) -> Rollout:
        spans = []
        if with_spans:
            spans = sorted((s for s in entry.spans if s.attempt_id == entry.attempt_id),
                           key=lambda s: s.sequence_id)
        return Rollout(rollout_id=rollout_id, task_id=entry.task.id, sample_index=entry.sample_index,
                       status=entry.status, final_reward=entry.final_reward, spans=spans, error=entry.error,
                       metadata=dict(entry.metadata), attempt_id=entry.attempt_id, attempts=entry.attempts,
                       start_time=entry.start_time, end_time=entry.end_time)

    def release(self, rollout_ids: Sequence[str]) -> None:
        with self._changed:
            for rollout_id in rollout_ids:
                entry = self._entries.pop(rollout_id, None)
                if entry is not None and entry.status == QUEUING:
                    self._queue.remove(rollout_id)

    def close(self) -> None:
        with self._changed:
            self._entries.clear()
            self._queue.clear()


def _accepts(entry: _Entry, span: Span) -> bool:
    """Whether the entry takes ``span`` (lease aside): one of its latest attempt's, while it runs or, after it
    ended, under an id handed out before (a call admitted while it ran, whose answer came back after its end)."""
    return entry.attempt_id == span.attempt_id and (entry.status == RUNNING
                                                   or span.sequence_id < entry.next_sequence_id)


@hookimpl
def register_stores(register):
    register("memory", lambda ctx: MemoryStore())
