"""Stopping a run on SIGINT or SIGTERM: asked for at any moment, done between steps.

A signal handler that raises runs between any two bytecodes of the main
thread, so an exception raised there can land inside a plugin's or a
library's critical section (half-way through a ``Condition.notify`` of
TensorBoard's writer queue, say) and leave it broken: the run's
``on_train_end`` then hangs on it. So the first signal only records the
request and the loop raises :class:`Interrupted` where it is between steps;
a second signal raises at once, for a user who will not wait for the step.
"""

from __future__ import annotations

import os
import signal


class Interrupted(KeyboardInterrupt):
    """A signal asked the run to stop; raised in the main thread like Ctrl-C's KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def raise_interrupted(signum: int, frame) -> None:
    """A signal handler that stops at once: for before a run has steps to end between."""
    raise Interrupted(signum)


class StopRequest:
    """Whether a signal asked the run to stop (``signum``), and the handler that records it."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def install(self) -> None:
        """Make SIGINT and SIGTERM ask for a stop (main thread only, as every ``signal.signal``)."""
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum: int, frame) -> None:
        if self.signum is not None:
            raise_interrupted(signum, frame)
        self.signum = signum
        # os.write, not print: a print here may re-enter a print the main thread was in the middle of.
        os.write(2, f"agl: {signal.Signals(signum).name}: stopping after the running step "
                    f"(send it again to stop at once)\n".encode())

    def check(self) -> None:
        """Raise :class:`Interrupted` if a stop was asked for: called by the loop between steps."""
        if self.signum is not None:
            raise Interrupted(self.signum)
