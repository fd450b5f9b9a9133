"""A process of its own that holds one object and runs its methods by name: the backend's update and serving processes.

On a CPU the trainer's process shares one interpreter lock between the
rollout plane's Python (agents, gateway, store) and whatever else runs there;
a small model's kernels are short, so work in that process mostly waits for
the lock. The embedded backend moves its heavy
parts into processes of their own: the update (:mod:`agl_plugin_torch.update_process`)
and the policy endpoint (:mod:`agl_plugin_torch.serving_process`). Both share
the weights with the trainer's process through shared memory, and only
calls, their arguments and their answers cross the pipe.

``build(*args)`` runs in the new process and returns ``(obj, report)``:
the object whose methods :meth:`WorkerProcess.call` runs, and what the
process reports once it started (:meth:`WorkerProcess.started`). When the
process is told to stop, ``obj.close()`` runs, if it has one. What the
process logs is handed to the trainer's process's loggers of the same names,
so it lands where the run's own log does.
"""

from __future__ import annotations

import logging
import logging.handlers
import multiprocessing.forkserver
import os
import pickle
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch.multiprocessing

JOIN_S = 10.0

CONTEXT = torch.multiprocessing.get_context("forkserver")
"""Processes are forked from a fork server: a fresh single-threaded process that imports torch, transformers and
the backend once, when the first process starts. A fork of the trainer's process would copy its threads' locks in
whatever state they are; a spawned process would import all of it again, seconds on a small CPU, at every start
(a test session starts hundreds)."""
CONTEXT.set_forkserver_preload(["torch", "transformers", "agl_plugin_torch.backend"])


def start_fork_server() -> None:
    """Start the fork server now, without waiting for it (it starts on a worker's first start otherwise).

    Its imports of torch, transformers and the backend (~3.5 s of a core)
    then run while the trainer's process makes its model, instead of after.
    """
    multiprocessing.forkserver.ensure_running()


class WorkerProcessError(RuntimeError):
    """A worker process failed a call, could not start, or died."""


class WorkerProcess:
    """A process of its own running ``build(*args)``'s object.

    ``what`` names it in errors ("the torch update process"); ``send_hint``
    follows the error of an argument that cannot be sent to it.
    """

    def __init__(self, what: str, name: str, build: Callable[..., tuple[Any, Any]], *args: Any, send_hint: str = ""):
        self.what, self.send_hint = what, send_hint
        self._conn, child = CONTEXT.Pipe()
        logs = CONTEXT.Queue()
        self._logs = logging.handlers.QueueListener(logs, _ToOwnLogger())
        self._logs.start()
        self._process = CONTEXT.Process(target=serve, args=(child, dict(os.environ), logs,
                                                            logging.getLogger().level, build, args),
                                        name=name, daemon=True)
        self._process.start()
        child.close()
        self._started, self._report = False, None

    @property
    def pid(self) -> int:
        """The process's id."""
        return self._process.pid

    def started(self, method: str = "start") -> Any:
        """Wait until the process has built its object; what it reported then. Raises if it could not start.

        ``method`` is the call that waits, named in the error.
        """
        if not self._started:
            self._report = self._reply(method)
            self._started = True
        return self._report

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of the process's object; its error (with the process's traceback) is raised here."""
        try:
            message = ForkingPickler.dumps((method, args))  # what Connection.send does, to name what fails
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise WorkerProcessError(f"cannot send {method!r} to {self.what}: {exc}{self.send_hint}") from exc
        self.started(method)
        try:
            self._conn.send_bytes(message)
        except OSError as exc:
            raise self._died(method) from exc
        return self._reply(method)

    def _reply(self, method: str) -> Any:
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._died(method) from exc
        if ok:
            return value
        if isinstance(value, BaseException):  # an error the caller knows how to report (a port in use, …)
            raise value
        raise WorkerProcessError(f"{self.what} failed in {method!r}:\n{value}")

    def _died(self, method: str) -> WorkerProcessError:
        self._process.join(1.0)
        return WorkerProcessError(f"{self.what} died during {method!r} (exit code {self._process.exitcode})")

    def stop(self) -> None:
        """Ask the process to end; kill it if it has not within a few seconds."""
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._process.join(JOIN_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()
        self._logs.stop()


class _ToOwnLogger(logging.Handler):
    """Hands a record from the process to this process's logger of its name (its level and handlers decide)."""

    def handle(self, record: logging.LogRecord) -> bool:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
        return True


class StartError(Exception):
    """Raised by a ``build`` for a reason the trainer reports as is (a bad setting): sent back as the exception."""


def serve(conn: Connection, environ: dict[str, str], logs: Any, log_level: int, build: Callable[..., tuple[Any, Any]],
          args: tuple) -> None:
    """The process: build the object, report, then answer calls until told to stop or orphaned."""
    # A fork of the fork server inherits its environment, which may be older than the trainer's (a spawned
    # process would get the trainer's): settings read from the environment ($AGL_POLICY_TOKEN, …) are the trainer's.
    os.environ.clear()
    os.environ.update(environ)
    # Ctrl-C in a terminal signals the whole process group: the trainer's process stops the run between
    # steps (agl_core.stop) and then this process, which must serve until then.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root = logging.getLogger()
    root.handlers[:] = [logging.handlers.QueueHandler(logs)]
    root.setLevel(log_level)
    try:
        obj, report = build(*args)
        conn.send((True, report))
    except StartError as exc:
        conn.send((False, exc.__cause__ or exc))
        return
    except BaseException:
        conn.send((False, "while starting:\n" + traceback.format_exc()))
        return
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the trainer's process is gone (killed, say): nothing left to do
                return
            if message is None:
                return
            method, args = message
            try:
                reply = (True, getattr(obj, method)(*args))
            except BaseException:  # the caller raises it, with this traceback; the process serves on
                reply = (False, traceback.format_exc())
            try:
                conn.send(reply)
            except OSError:  # the trainer's process ended while this call ran
                return
    finally:
        close = getattr(obj, "close", None)
        if close is not None:
            close()
