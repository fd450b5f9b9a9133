"""LoRA on the embedded backend (agl-plugin-torch): its actor adapted in place, its optimizer over the adapter.

The torch backend keeps its state in ``ctx.state["torch"]`` and makes it on
first use. The adapter is put on its actor before anything trains or loads
weights into it: in ``load_checkpoint`` when a run resumes (the backend's
checkpoint then holds an adapter, which only an adapted actor can take) and
in ``on_train_start`` otherwise. Because the actor stays the same object, the
policy endpoint serves the adapted weights and the backend's own checkpoints
save the adapter, with no change to the backend.
"""

from __future__ import annotations

import torch

from agl_core.data import Batch

from agl_plugin_torch.backend import Backend
from agl_plugin_torch.training import make_optimizer

from agl_plugin_lora.adapter import adapter_disabled, add_adapter, has_adapter, trainable_parameters
from agl_plugin_lora.settings import LoraSettings


def adapt(backend: Backend, settings: LoraSettings) -> bool:
    """Put the adapter on the backend's actor and train only the adapter; False when it was already there.

    The backend made its optimizer over every weight of the actor; it is
    replaced by one over the adapter's weights, with the same settings, before
    any step was taken (so there is no optimizer state to carry over).
    """
    if has_adapter(backend.actor):
        return False
    with backend.lock:  # the engine may be generating with the actor
        add_adapter(backend.actor, settings)
    backend.actor_optim, backend.actor_sched = make_optimizer(trainable_parameters(backend.actor),
                                                              backend.config.actor)
    return True


def reference_logprobs(backend: Backend, batch: Batch) -> torch.Tensor:
    """Response log-probs of ``batch`` under the base model: the actor with its adapter disabled.

    Held under the backend's lock: while the adapter is off, the endpoint must
    not generate with the shared actor.
    """
    with backend.lock, adapter_disabled(backend.actor) as base:
        return backend.logprobs(base, batch, with_entropy=False)[0]
