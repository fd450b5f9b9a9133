"""The rollout store protocol: the queue of rollouts, their attempts, and the spans they record.

A rollout moves through ``queuing → running → succeeded | failed | timed_out``.
A worker takes a queued rollout with :meth:`Store.dequeue`, which starts a new
*attempt* (ids ``"1"``, ``"2"``, …) under a lease of ``lease_s`` seconds; the
worker (or the runner on its behalf) renews the lease with
:meth:`Store.heartbeat`. The attempt carries a *lease token*
(:attr:`Attempt.lease`, unguessable): only its holder acts on the attempt.
``heartbeat``, ``finish``, ``admit`` and span writes name it, and a call
that names a running attempt with another token raises :class:`LeaseError`
(the store service answers 409), so a runner acts only on what it holds.
When a lease runs out the worker is presumed lost: the rollout goes back to
the front of the queue while it has attempts left (``max_attempts`` counts
all attempts), else it ends ``failed``. An attempt
that ends by itself (:meth:`Store.finish`) is final, whatever its status.

Spans (model calls, rewards, annotations) are written with
:meth:`Store.add_spans` under ids from :meth:`Store.next_sequence_id` (or,
for a model call, :meth:`Store.admit`: the check that the attempt runs and
its ids in one request, which a remote store answers in one round trip). A
span is accepted only for the running attempt, under its lease token
(``add_spans(spans, leases={(rollout_id, attempt_id): token})``): spans of an
unknown or ended attempt raise :class:`LeaseError`, and so does a span whose
key (rollout, attempt, sequence id) is already held with other content (the
same span written again is idempotent). Every span is checked with
:func:`agl_core.http.recordable.check_span` when it is added, so a span a store
could not write back faithfully fails its own call, never a writer thread.
A span accepted and then lost (a full disk) fails its own attempt: its
``finish`` ends it ``failed`` with :data:`SPANS_LOST` in the error. A
finished rollout is read back with the spans of its last attempt only. The
consumer calls :meth:`Store.release` once it has the rollouts, so that a store
never holds what nobody will read again.

Stores are registered by name through the ``register_stores`` hook
(``register(name, factory)``, ``factory(ctx) -> Store``) and chosen with the
recipe key ``rollout.store``. Every method is thread-safe.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # agl_core.data imports torch; `import agl_core` stays light without it
    from agl_core.data import Rollout, Span, Task

QUEUING, RUNNING = "queuing", "running"
SUCCEEDED, FAILED, TIMED_OUT = "succeeded", "failed", "timed_out"
TERMINAL = frozenset({SUCCEEDED, FAILED, TIMED_OUT})
"""Statuses a rollout never leaves."""


@dataclass(frozen=True)
class NewRollout:
    """A rollout to enqueue: which task, which sample of it, how many attempts it may use.

    ``ahead``: queued ahead of every rollout already queued (validation games,
    so that they wait for no training game queued for later steps).
    """

    rollout_id: str
    task: Task
    sample_index: int = 0
    max_attempts: int = 1
    metadata: dict[str, Any] = field(default_factory=dict)
    ahead: bool = False


@dataclass(frozen=True)
class Attempt:
    """One attempt at a rollout, as handed to a worker by :meth:`Store.dequeue`.

    ``lease`` is the attempt's lease token: only the worker that dequeued it knows it."""

    rollout_id: str
    attempt_id: str
    task: Task
    sample_index: int
    metadata: dict[str, Any]
    lease: str = ""


class LeaseError(Exception):
    """A call on an attempt that the caller does not hold: a wrong lease token, an unknown or ended attempt
    (for spans), or a span that conflicts with one already held under its sequence id. The store service
    answers it 409."""


SPANS_LOST = "spans not recorded"
"""How the error of an attempt that ended ``failed`` because some of its accepted spans could not be written starts."""
Leases = Mapping[tuple[str, str], str]
"""Lease tokens by (rollout id, attempt id): what a span write carries."""


def new_lease() -> str:
    """A fresh lease token (128 random bits)."""
    return secrets.token_urlsafe(16)


def check_lease(rollout_id: str, attempt_id: str, held: str, given: str | None) -> None:
    """LeaseError unless ``given`` is ``held``, the lease token of the running attempt (compared in constant time)."""
    if given is None or not hmac.compare_digest(held.encode(), given.encode()):
        raise LeaseError(f"attempt {attempt_id!r} of rollout {rollout_id!r} is leased under another token"
                         + (" (none was given: pass the Attempt.lease that dequeue returned)" if given is None else ""))


def ended_error(span: Span, rollout_status: str) -> str:
    """The LeaseError of a span written for an attempt that is not the running one."""
    return (f"span {span.sequence_id} of rollout {span.rollout_id!r} is for attempt {span.attempt_id!r}, which is "
            f"not running (the rollout is {rollout_status}): spans are recorded for the running attempt only")


def conflict_error(span: Span) -> str:
    """The LeaseError of a span whose key is held with other content."""
    return (f"rollout {span.rollout_id!r} attempt {span.attempt_id!r} already holds another span under sequence id "
            f"{span.sequence_id}: the first written stays (writing the same span again is no error)")


def lost_spans_error(count: int, error: str) -> str:
    """The error of an attempt that ended failed because ``count`` of its accepted spans could not be written."""
    return f"{SPANS_LOST}: {count} span(s) of this attempt could not be written ({error})"


@dataclass(frozen=True)
class AttemptState:
    """What :meth:`Store.attempt_state` knows of an attempt: is it the one running now?"""

    rollout_status: str
    current: bool
    """True when this is the rollout's latest attempt and the rollout is running."""
    metadata: dict[str, Any]


@runtime_checkable
class Store(Protocol):
    """Queue, attempts, leases and spans of rollouts. See the module docstring for the lifecycle."""

    def enqueue(self, rollouts: Sequence[NewRollout]) -> None:
        """Queue new rollouts (status ``queuing``), in order: behind those queued before, or ahead of all of them
        when their ``ahead`` is set. A rollout id already known is an error."""

    def dequeue(self, worker_id: str, lease_s: float, wait_s: float = 0.0) -> Attempt | None:
        """Start an attempt at the oldest queued rollout, waiting up to ``wait_s`` for one; None if none came.

        Expired leases are requeued first, so an idle worker picks up what a lost one left.
        """

    def heartbeat(self, rollout_id: str, attempt_id: str, lease_s: float, *, lease: str | None = None) -> bool:
        """Extend the attempt's lease to ``lease_s`` from now; False if it is no longer the running attempt,
        LeaseError if it runs under another lease token than ``lease``."""

    def finish(self, rollout_id: str, attempt_id: str, status: str,
               final_reward: float | None = None, error: str | None = None, *, lease: str | None = None) -> bool:
        """End the running attempt with a terminal ``status``; False (and no change) if it is not running,
        LeaseError if it runs under another lease token than ``lease``. An attempt some of whose accepted
        spans were lost ends ``failed`` (:func:`lost_spans_error`) whatever ``status`` says."""

    def cancel(self, rollout_ids: Sequence[str] | None, reason: str) -> int:
        """End the given (or, with None, every) unfinished rollouts as ``failed``; return how many."""

    def requeue_expired(self) -> int:
        """Requeue (or fail, when out of attempts) running rollouts whose lease ran out; return how many."""

    def attempt_state(self, rollout_id: str, attempt_id: str) -> AttemptState | None:
        """Whether ``attempt_id`` is the running attempt of ``rollout_id``; None for an unknown rollout."""

    def admit(self, rollout_id: str, attempt_id: str, n: int, *,
              lease: str | None = None) -> tuple[AttemptState | None, list[int]]:
        """:meth:`attempt_state`, and ``n`` sequence ids (as :meth:`next_sequence_id`) when the attempt is current
        and ``lease`` is its lease token (LeaseError when it is current under another token).

        The gateway admits each model call so (one id per choice): the ids are
        ``[]`` for an attempt that is not the running one, and the state None
        for an unknown rollout. A store may raise KeyError for a rollout
        released meanwhile. The gateway calls it on a thread of its own, unless
        the store's class sets ``admits_at_once = True`` (its ``admit`` never
        waits: no I/O, locks held only for updates in memory), when a hop to a
        thread would cost more than the call.
        """

    def next_sequence_id(self, rollout_id: str) -> int:
        """The next span sequence id of the rollout (0, 1, …): the order of its events.

        A store may raise KeyError for a rollout it does not hold (never queued, or released).
        """

    def add_spans(self, spans: Sequence[Span], *, leases: Leases | None = None) -> None:
        """Record spans of running attempts, each under its attempt's token in ``leases``. A store may write them
        in batches; :meth:`flush` and every read see them.

        Checked before anything is written, all or nothing: ValueError
        (:class:`~agl_core.http.recordable.NotRecordable`) naming the field of a
        span no reader could read back; LeaseError for a span of an ended
        attempt, without its lease token, or conflicting with a span held
        under its key; a store may raise KeyError for spans of a rollout it
        does not hold (the gateway drops the spans of a call that outlived
        its rollout).
        """

    def flush(self) -> None:
        """Return once every span added so far is durable (as durable as the store gets)."""

    def wait(self, rollout_ids: Sequence[str], timeout_s: float) -> set[str]:
        """Block until every rollout in ``rollout_ids`` is terminal, or ``timeout_s`` passed; return the terminal ones."""

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        """The rollouts (with the spans of their last attempt, by sequence id), in order; unknown ids are skipped."""

    def query(self, statuses: Sequence[str] | None = None) -> list[Rollout]:
        """Rollouts with one of ``statuses`` (all with None), without spans, oldest first."""

    def release(self, rollout_ids: Sequence[str]) -> None:
        """Forget consumed rollouts: nothing of them stays in this process's memory."""

    def close(self) -> None:
        """Flush and release every resource (threads, connections). The store is unusable afterwards."""


def lease_expired_error(attempt_id: str | None, worker_id: str | None) -> str:
    """The error a store records when an attempt's lease runs out."""
    return f"attempt {attempt_id} was lost: worker {worker_id} stopped renewing its lease"
