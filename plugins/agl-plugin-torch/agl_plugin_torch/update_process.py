"""The backend's training in a process of its own, for asynchronous training on a CPU.

In the trainer's process the update's Python (the glue around a small
model's kernels) shares the interpreter lock with the rollout plane's (agents,
gateway, store, policy server): overlapping them, as asynchronous training
means to, only takes turns on that lock (docs/async-figures.md). Here the
log-prob passes and the updates run in a spawned process, on the very same
weights: the actor's and the critic's tensors are moved to shared memory
before the process starts, so the optimizer's in-place steps are what the
trainer's process reads when it syncs the serving copy or saves a checkpoint.
Only a step's columns and settings, its metrics and (for a checkpoint) the
optimizers' states cross the pipe.

The process holds a :class:`~agl_plugin_torch.backend.Backend` of its own
(no engine, no server) over the shared models, with its own optimizers; the
trainer's process calls its training methods by name (:meth:`UpdateProcess.call`).

It runs at a lower scheduling priority (``update_process_nice``): the update
is hidden behind generation as long as it ends before the next batch is
played, while every moment the rollout plane waits for a core lengthens the
step. The plane leaves cores idle between its calls, and the update takes
those.
"""

from __future__ import annotations

import os
import pickle
import traceback
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

from agl_plugin_torch.settings import TorchConfig

JOIN_S = 10.0


class UpdateProcessError(RuntimeError):
    """The update process failed a call, or died."""


class UpdateProcess:
    """A spawned process that runs a backend's training methods over its shared models."""

    def __init__(self, parts: dict[str, Any], optimizer_states: dict[str, Any]):
        context = torch.multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve, args=(child, parts, optimizer_states),
                                        name="agl-torch-update", daemon=True)
        self._process.start()
        child.close()
        # Not waited for here: the process imports torch and builds its backend (seconds on a small CPU)
        # while the first batch plays; the first call waits for it (docs/async-figures.md).
        self._started = False

    @property
    def pid(self) -> int:
        """The process's id."""
        return self._process.pid

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` of the process's backend; its error (with the process's traceback) is raised here."""
        try:
            message = ForkingPickler.dumps((method, args))  # what Connection.send does, to name what fails
        except (pickle.PicklingError, AttributeError, TypeError) as exc:
            raise UpdateProcessError(f"cannot send {method!r} to the torch update process: {exc} (a policy loss "
                                     f"must be a module-level function; or set plugins.torch.update_process: "
                                     f"false)") from exc
        if not self._started:
            self._reply(method)  # the process's report that it started (or why it could not)
            self._started = True
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
        if not ok:
            raise UpdateProcessError(f"the torch update process failed in {method!r}:\n{value}")
        return value

    def _died(self, method: str) -> UpdateProcessError:
        self._process.join(1.0)
        return UpdateProcessError(f"the torch update process died during {method!r} "
                                  f"(exit code {self._process.exitcode})")

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


def serve(conn: Connection, parts: dict[str, Any], optimizer_states: dict[str, Any]) -> None:
    """The process: build the backend over the shared models, then answer calls until told to stop or orphaned."""
    from agl_plugin_torch.backend import Backend  # here: the backend module imports this one

    try:
        config: TorchConfig = parts["config"]
        if config.update_process_nice and hasattr(os, "nice"):
            os.nice(config.update_process_nice)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        backend = Backend.for_training(**parts, generator=torch.Generator())
        backend.load_optimizer_states(optimizer_states)
        conn.send((True, None))
    except BaseException:
        conn.send((False, "while starting:\n" + traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the trainer's process is gone (killed, say): nothing left to train for
            return
        if message is None:
            return
        method, args = message
        try:
            reply = (True, getattr(backend, method)(*args))
        except BaseException:  # the caller raises it, with this traceback; the process serves on
            reply = (False, traceback.format_exc())
        try:
            conn.send(reply)
        except OSError:  # the trainer's process ended while this call ran
            return
