"""The backend's training in a process of its own, for asynchronous training on a CPU.

In the trainer's process the update's Python (the glue around a small
model's kernels) shares the interpreter lock with the rollout plane's (agents,
gateway, store, policy server): overlapping them, as asynchronous training
means to, only takes turns on that lock. Here the
log-prob passes and the updates run in a process of their own, on the very same
weights: the actor's and the critic's tensors are moved to shared memory
before the process starts, so the optimizer's in-place steps are what the
trainer's process reads when it syncs the serving copy or saves a checkpoint.
Only a step's columns and settings, its metrics and (for a checkpoint) the
optimizers' states cross the pipe.

The process holds a :class:`~agl_plugin_torch.backend.Backend` of its own
(no engine, no server) over the shared models, with its own optimizers; the
trainer's process calls its training methods by name (a
:class:`~agl_plugin_torch.worker_process.WorkerProcess`).

It runs at a lower scheduling priority (``update_process_nice``): the update
is hidden behind generation as long as it ends before the next batch is
played, while every moment the rollout plane waits for a core lengthens the
step. The plane leaves cores idle between its calls, and the update takes
those.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.worker_process import WorkerProcess

SEND_HINT = " (a policy loss must be a module-level function; or set plugins.torch.update_process: false)"


def start(make_backend: Callable[..., Any], parts: dict[str, Any], optimizer_states: dict[str, Any]) -> WorkerProcess:
    """Spawn the update process over ``parts`` (a backend's config, source, shared models, tokenizer).

    ``make_backend(**parts, generator=...)`` builds the process's backend
    (``Backend.for_training``: passed in, so this module stands below the
    backend that uses it).

    Not waited for: the process imports torch and builds its backend
    (seconds on a small CPU) while the first batch plays; the first call
    waits for it.
    """
    return WorkerProcess("the torch update process", "agl-torch-update", build, make_backend, parts,
                         optimizer_states, send_hint=SEND_HINT)


def build(make_backend: Callable[..., Any], parts: dict[str, Any], optimizer_states: dict[str, Any]):
    """In the process: the backend over the shared models, with the optimizers' states loaded."""
    config: TorchConfig = parts["config"]
    if config.update_process_nice and hasattr(os, "nice"):
        os.nice(config.update_process_nice)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    backend = make_backend(**parts, generator=torch.Generator())
    backend.load_optimizer_states(optimizer_states)
    return backend, None
