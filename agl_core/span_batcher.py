"""Spans written in batches by a thread of their own: the SQLite store's writer and the store client's uploader.

:meth:`SpanBatcher.put` queues spans and returns (it blocks beyond
``max_pending`` queued spans, so memory stays bounded when the writer falls
behind). The thread takes every span waiting, up to ``batch_size``, and hands
them to ``write`` at once: under load a write carries hundreds of spans, when
idle a span is written at once. :meth:`SpanBatcher.flush` returns once every
span put before it is written. :meth:`SpanBatcher.carry` lets a caller take
the spans waiting and send them with a request of its own.

The first failed write sticks: spans queued after it are dropped and every
later ``put`` and ``flush`` raises a RuntimeError with ``describe(error)``, so
nothing is lost silently and the thread prints nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from agl_core.data import Span

T = TypeVar("T")


class SpanBatcher(threading.Thread):
    """Calls ``write(spans)`` on this thread with the spans :meth:`put` queued, in batches of up to ``batch_size``."""

    def __init__(self, write: Callable[[list[Span]], None], describe: Callable[[BaseException], str], *,
                 name: str, batch_size: int, max_pending: int):
        super().__init__(name=name, daemon=True)
        self.write, self.describe, self.batch_size = write, describe, batch_size
        self.pending: queue.Queue[Span | None] = queue.Queue(maxsize=max_pending)
        self.done = threading.Condition()
        self.added = self.written = 0
        self.error: BaseException | None = None

    def put(self, spans: Sequence[Span]) -> None:
        """Queue ``spans``; raises the first failed write's error."""
        self._raise_error()
        with self.done:
            self.added += len(spans)
        for span in spans:
            self.pending.put(span)

    def flush(self) -> None:
        """Return once every span put so far is written; raises the first failed write's error."""
        with self.done:
            target = self.added
            while self.written < target and self.error is None:
                self.done.wait(1.0)
        self._raise_error()

    def carry(self, send: Callable[[list[Span]], T]) -> T:
        """``send(spans)`` on the caller's thread with the spans waiting now (up to ``batch_size``; maybe none),
        so that they ride on a request the caller makes anyway.

        They count as written once ``send`` returns. If it raises, they are queued again for this thread
        (so a write must be idempotent) and the error propagates. After a failed write nothing is taken.
        """
        spans: list[Span] = []
        while self.error is None and len(spans) < self.batch_size:
            try:
                span = self.pending.get_nowait()
            except queue.Empty:
                break
            if span is None:  # stop's mark stays behind every span
                self.pending.put(None)
                break
            spans.append(span)
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

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RuntimeError(self.describe(self.error)) from self.error

    def run(self) -> None:
        while True:
            batch = [self.pending.get()]
            while len(batch) < self.batch_size and batch[-1] is not None:
                try:
                    batch.append(self.pending.get_nowait())
                except queue.Empty:
                    break
            spans = [span for span in batch if span is not None]
            if spans and self.error is None:
                try:
                    self.write(spans)
                except BaseException as exc:  # surfaced by every later put/flush instead of a silent loss
                    self.error = exc
            with self.done:
                self.written += len(spans)
                self.done.notify_all()
            if batch[-1] is None:
                return
