"""The gateway's side of a weight sync: new calls wait, calls in flight finish, the weights change, calls resume.

A policy server whose weights change under a call would answer it with a mix
of two policies, recorded as one. Around a sync the trainer holds the
gateway's :class:`CallGate` closed (:meth:`CallGate.paused`): a call that
arrives meanwhile waits at the gate (it neither fails nor is forwarded), the
calls already forwarded finish under the old weights and are recorded with
their version, then the backend swaps the weights, and the gate opens again.

The gate is shared by the gateway's event loop (calls) and the trainer's
thread (syncs): its state is guarded by a lock, and a waiting call is woken
on its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

log = logging.getLogger("agl_core.gateway")


@dataclass(frozen=True)
class Drained:
    """How a pause went: whether every call in flight finished in time, how long that took, how many were left."""

    drained: bool
    wait_s: float
    still_in_flight: int


class CallGate:
    """Counts the calls being forwarded and holds new ones while paused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._paused = False
        self._in_flight = 0
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    @property
    def in_flight(self) -> int:
        """Calls forwarded and not yet answered."""
        with self._lock:
            return self._in_flight

    @property
    def waiting(self) -> int:
        """Calls held at the closed gate."""
        with self._lock:
            return sum(not future.done() for _, future in self._waiters)

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Hold the call while the gate is closed, then count it in flight until the block ends."""
        while True:
            with self._lock:
                if not self._paused:
                    self._in_flight += 1
                    break
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiters.append((loop, future))
            await future
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._idle.notify_all()

    def pause(self, drain_timeout_s: float) -> Drained:
        """Close the gate and wait up to ``drain_timeout_s`` for the calls in flight to end."""
        start = time.monotonic()
        with self._lock:
            self._paused = True
            drained = self._idle.wait_for(lambda: self._in_flight == 0, timeout=drain_timeout_s)
            left = self._in_flight
        if not drained:
            log.warning("weight sync: %d model calls still in flight after %g s; the weights change under them",
                        left, drain_timeout_s)
        return Drained(drained, time.monotonic() - start, left)

    def resume(self) -> None:
        """Open the gate: the calls held meanwhile go on."""
        with self._lock:
            self._paused = False
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # a loop closed meanwhile has no call left to wake
                loop.call_soon_threadsafe(_wake, future)

    @contextlib.contextmanager
    def paused(self, drain_timeout_s: float) -> Iterator[Drained]:
        """The gate closed and drained for the block (the weight swap), open again after it, whatever happens."""
        try:
            yield self.pause(drain_timeout_s)
        finally:
            self.resume()


def _wake(future: asyncio.Future) -> None:
    if not future.done():  # a call whose client went away was cancelled
        future.set_result(None)
