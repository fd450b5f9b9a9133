"""Spans written in batches by a thread of their own: the SQLite store's writer and the store client's uploader.

:meth:`SpanBatcher.put` queues spans and returns (it blocks beyond
``max_pending`` queued spans, so memory stays bounded when the writer falls
behind). The thread takes every span waiting, up to ``batch_size``, and hands
them to ``write`` at once: under load a write carries hundreds of spans, when
idle a span is written at once. :meth:`SpanBatcher.flush` returns once every
span put before it is written. :meth:`SpanBatcher.carry` lets a caller take
the spans waiting and send them with a request of its own (after every other
span put before, if the request must follow them).

A failed write loses its batch alone: ``lost(spans, error)`` is told (the
store fails the attempts those spans belong to, and logs), and the next
batch is written as if nothing happened, so a store that was full and has
room again is written to again. No error outlives its batch. A batch refused
for what a span holds (an error of the types ``refusals``: a span that
conflicts with one written, of an ended attempt) is written again span by
span, so that only the refused spans are lost.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("agl_core.rollout.span_batcher")
T = TypeVar("T")
"""What is queued: a span, or a span with what its write needs (the store client's lease token)."""
R = TypeVar("R")


class SpanBatcher(threading.Thread, Generic[T]):
    """Calls ``write(spans)`` on this thread with the spans :meth:`put` queued, in batches of up to ``batch_size``."""

    def __init__(self, write: Callable[[list[T]], None], lost: Callable[[list[T], BaseException], None], *,
                 name: str, batch_size: int, max_pending: int, refusals: tuple[type[BaseException], ...] = ()):
        super().__init__(name=name, daemon=True)
        self.write, self.lost, self.batch_size, self.refusals = write, lost, batch_size, refusals
        self.pending: queue.Queue[T | None] = queue.Queue(maxsize=max_pending)
        self.done = threading.Condition()
        self.added = self.written = 0

    def put(self, spans: Sequence[T]) -> None:
        """Queue ``spans``."""
        with self.done:
            self.added += len(spans)
        for span in spans:
            self.pending.put(span)

    def flush(self) -> None:
        """Return once every span put so far is written (or lost, and ``lost`` told)."""
        with self.done:
            target = self.added
        self._wait_written(target)

    def _wait_written(self, target: int) -> None:
        with self.done:
            while self.written < target:
                self.done.wait(1.0)

    def carry(self, send: Callable[[list[T]], R], *, after_the_rest: bool = False) -> R:
        """``send(spans)`` on the caller's thread with the spans waiting now (up to ``batch_size``; maybe none),
        so that they ride on a request the caller makes anyway.

        They count as written once ``send`` returns. If it raises, they are queued again for this thread
        (so a write must be idempotent) and the error propagates. With ``after_the_rest``, ``send`` is called
        once every other span put before is written (or lost): what the request says then follows them all.
        """
        with self.done:
            target = self.added
        spans: list[T] = []
        while len(spans) < self.batch_size:
            try:
                span = self.pending.get_nowait()
            except queue.Empty:
                break
            if span is None:  # stop's mark stays behind every span
                self.pending.put(None)
                break
            spans.append(span)
        if after_the_rest:
            self._wait_written(target - len(spans))
        try:
            result = send(spans)
        except BaseException:
            for span in spans:
                self.pending.put(span)
            raise
        if spans:
            with self.done:
                self.written += len(spans)
                self.done.notify_all()
        return result

    def stop(self, timeout_s: float | None = None) -> None:
        """Write what is queued, then end the thread (waiting up to ``timeout_s``)."""
        if self.is_alive():
            self.pending.put(None)  # after every queued span: they are written first
            self.join(timeout_s)

    def _write(self, spans: list[T]) -> None:
        try:
            self.write(spans)
        except self.refusals if len(spans) > 1 else () as exc:  # which span? each alone says
            log.info("%s: a batch of %d spans was refused (%s); writing them one by one", self.name, len(spans), exc)
            for span in spans:
                self._write([span])
        except Exception as exc:  # noqa: BLE001 - this batch's attempts fail; the next batch is written
            try:
                self.lost(spans, exc)
            except Exception:  # noqa: BLE001 - the thread must go on writing whatever the report does
                log.exception("%s could not report %d lost spans", self.name, len(spans))

    def run(self) -> None:
        while True:
            batch = [self.pending.get()]
            while len(batch) < self.batch_size and batch[-1] is not None:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            spans = [span for span in batch if span is not None]
            if spans:
                self._write(spans)
            with self.done:
                self.written += len(spans)
                self.done.notify_all()
            if batch[-1] is None:
                return
