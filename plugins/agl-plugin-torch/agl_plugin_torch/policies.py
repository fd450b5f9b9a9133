"""Several policies on one actor: named adapters, each row computed with its own, each trained on its own rows.

An actor transform that puts several named adapters on the actor (agl-plugin-lora
with a recipe ``policies`` section) declares which adapter serves each policy
in the actor's :data:`POLICY_ADAPTERS` attribute: ``{policy: adapter name}``,
:data:`BASE` for a policy that is the base model itself. The backend then

- generates a batch whose requests name different policies in one forward
  per token, each row through its own adapter (:func:`adapters_per_row`,
  the batched per-row LoRA kernel of :mod:`agl_plugin_torch.per_row_lora`):
  the engine never waits to group them;
- computes the old log-probs of a batch of several policies' rows the same way;
- updates each trainable adapter on its own rows with its own optimizer and
  schedule (:class:`PolicyOptimizers`), the PPO and KL pieces of the loss
  computed on that policy's rows alone; its metrics are ``policy/<name>/…``.

Updates, and the adapter layers the kernel does not cover (embedding LoRA,
``modules_to_save`` copies), compute peft's own way: peft's ``adapter_names``
forward argument is passed to every such layer by a forward pre-hook for the
duration of a block (:func:`peft_adapters_per_row`), as peft's own
``PeftModel`` does for ``generate(adapter_names=...)``. The model stays the
transformers model the rest of the backend holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import numpy as np
import torch

from agl_core.data import Batch
from agl_core.policies import BASE_ADAPTER as BASE, POLICY_ADAPTERS, metric_key

from agl_plugin_torch.per_row_lora import rows_through_adapters


def policy_adapters(model: torch.nn.Module) -> dict[str, str] | None:
    """``{policy: adapter}`` of an actor that serves several policies; None for a one-policy actor."""
    return getattr(model, POLICY_ADAPTERS, None)


def adapter_of(model: torch.nn.Module, policy: str | None) -> str | None:
    """The adapter that serves ``policy`` (None: the actor as it is); KeyError naming the policies when unknown."""
    adapters = policy_adapters(model)
    if adapters is None or policy is None:
        return None
    if policy not in adapters:
        raise KeyError(f"model {policy!r} names no policy of this endpoint; the policies are {', '.join(adapters)}")
    return adapters[policy]


def _adapter_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import AuxiliaryTrainingWrapper  # modules_to_save copies

    return [m for m in model.modules() if isinstance(m, (LoraLayer, AuxiliaryTrainingWrapper))]


def _inject(module, args, kwargs, adapters):
    if isinstance(adapters, str):  # one adapter for every row of whatever batch comes
        x = args[0] if args else next(iter(kwargs.values()))
        kwargs["adapter_names"] = [adapters] * x.shape[0]
    else:
        kwargs["adapter_names"] = adapters
    return args, kwargs


@contextmanager
def peft_adapters_per_row(model: torch.nn.Module, adapters: Sequence[str] | str,
                          layers: Sequence[torch.nn.Module] | None = None) -> Iterator[None]:
    """peft's mixed-adapter batch: every forward of ``layers`` (default: every adapter layer) in the block computes
    row i with ``adapters[i]`` (a single name: every row), looping over the adapters the batch names."""
    adapters = adapters if isinstance(adapters, str) else list(adapters)
    handles = [layer.register_forward_pre_hook(partial(_inject, adapters=adapters), with_kwargs=True)
               for layer in (_adapter_layers(model) if layers is None else layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def adapters_per_row(model: torch.nn.Module, adapters: Sequence[str] | str | None) -> Iterator[None]:
    """Every forward of ``model`` in the block computes row i with adapter ``adapters[i]`` (:data:`BASE`: none).

    A list of names (a batch of several policies' rows, to generate or score)
    runs the batched per-row kernel (:func:`agl_plugin_torch.per_row_lora.rows_through_adapters`)
    where it applies and peft's mixed batch on the other adapter layers. A
    single name (one policy's update, with gradients) applies to every row,
    peft's way. None leaves the model as it is.
    """
    if adapters is None:
        yield
    elif isinstance(adapters, str):
        with peft_adapters_per_row(model, adapters):
            yield
    else:
        adapters = list(adapters)
        with rows_through_adapters(model, adapters, BASE) as covered, \
                peft_adapters_per_row(model, adapters, [m for m in _adapter_layers(model) if m not in covered]):
            yield


def adapters_of_rows(model: torch.nn.Module, policies: Sequence[str]) -> list[str]:
    """The adapter of each row's policy."""
    return [adapter_of(model, policy) for policy in policies]


def adapter_parameters(model: torch.nn.Module, adapter: str) -> list[torch.nn.Parameter]:
    """The parameters of one named adapter (its LoRA matrices and its copies of ``modules_to_save``)."""
    marks = (f".{adapter}.", )
    return [p for n, p in model.named_parameters()
            if ("lora_" in n or ".modules_to_save." in n) and any(mark in n for mark in marks)]


class PolicyOptimizers:
    """One optimizer and schedule per trainable policy, each over its adapter's parameters alone."""

    def __init__(self, model: torch.nn.Module, lrs: dict[str, float | None], config) -> None:
        from agl_plugin_torch.training import make_optimizer

        self.optims: dict[str, tuple[torch.optim.Optimizer, Any]] = {}
        for policy, lr in lrs.items():
            params = adapter_parameters(model, adapter_of(model, policy))
            if not params:
                raise RuntimeError(f"policy {policy!r} is trainable but its adapter has no parameter on the actor")
            self.optims[policy] = make_optimizer(params, config if lr is None else config.model_copy(update={"lr": lr}))

    def state_dict(self) -> dict[str, Any]:
        return {p: {"optim": o.state_dict(), "sched": s.state_dict()} for p, (o, s) in self.optims.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.keys() != self.optims.keys():
            raise RuntimeError(f"the checkpoint holds optimizers of policies {sorted(state)}, this run trains "
                               f"{sorted(self.optims)}")
        for policy, (optim, sched) in self.optims.items():
            optim.load_state_dict(state[policy]["optim"])
            sched.load_state_dict(state[policy]["sched"])


def rows_of(policies: np.ndarray, policy: str) -> np.ndarray:
    return np.flatnonzero(np.asarray(policies) == policy)


def policy_data_metrics(batch: Batch, policy: str) -> dict[str, float]:
    """``policy/<name>/…`` of one policy's rows: rows, tokens, reward, advantages, and KL to the reference when known."""
    mask = batch["response_mask"].bool()
    out = {"rows": float(len(batch)), "tokens": float(mask.sum())}
    if "token_level_rewards" in batch or "token_level_scores" in batch:
        scores = batch["token_level_rewards"] if "token_level_rewards" in batch else batch["token_level_scores"]
        out["reward/mean"] = float(scores.sum(-1).mean())
    if "advantages" in batch and mask.any():
        adv = batch["advantages"][mask]
        out["advantages/mean"], out["advantages/max"], out["advantages/min"] = (float(adv.mean()), float(adv.max()),
                                                                                float(adv.min()))
    if "ref_log_prob" in batch and "old_log_probs" in batch and mask.any():
        out["kl"] = float((batch["old_log_probs"] - batch["ref_log_prob"])[mask].mean())
    return {metric_key(policy, k): v for k, v in out.items()}


def policy_entropy(batch: Batch) -> dict[str, float]:
    """``policy/<name>/entropy``: the mean entropy of each policy's response tokens under the actor."""
    out = {}
    for policy in dict.fromkeys(batch["policy"]):
        rows = rows_of(batch["policy"], policy)
        mask = batch["response_mask"][rows].bool()
        if mask.any():
            out[metric_key(policy, "entropy")] = float(batch["entropys"][rows][mask].mean())
    return out


def update_policies(model: torch.nn.Module, optimizers: PolicyOptimizers, batch: Batch, policies: np.ndarray,
                    algorithm, policy_loss, config) -> dict[str, float]:
    """PPO updates of each trainable policy's adapter on its own rows; metrics per policy and their means.

    Rows of policies that do not train (frozen, base, or not selected) are
    never in ``batch`` when the aggregator follows ``trainer.agent_match``;
    any that are get no update.
    """
    from agl_plugin_torch.training import update_actor

    metrics: dict[str, float] = {}
    means: dict[str, list[float]] = {}
    for policy, (optim, sched) in optimizers.optims.items():
        rows = rows_of(policies, policy)
        if len(rows) == 0:
            continue
        mine = batch[rows]
        with adapters_per_row(model, adapter_of(model, policy)):
            updated = update_actor(model, optim, sched, mine, algorithm, policy_loss, config)
        for key, value in updated.items():
            metrics[metric_key(policy, key.removeprefix("actor/"))] = value
            means.setdefault(key, []).append(value)
    metrics.update({key: float(np.mean(values)) for key, values in means.items()})
    return metrics
