"""Actor and critic updates: PPO over mini-batches and epochs, with gradient accumulation over micro-batches.

Each mini-batch is one optimizer step. A mini-batch split into micro-batches
gets the gradient of the whole mini-batch's loss: each micro-batch's loss is
weighted by its share of what the aggregation mode averages over (tokens for
``token-mean``, non-empty rows for the ``seq-mean-*`` modes). The losses are
the core's (:mod:`agl_core.algorithms.losses`) and the policy loss is the one
the recipe names among the registered ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from agl_core.algorithms.losses import agg_loss, kl_penalty, value_loss
from agl_core.config import AlgorithmConfig
from agl_core.data import Batch

from agl_plugin_torch.forward import response_logprobs, response_values
from agl_plugin_torch.settings import LOSS_COLUMNS, CriticConfig, OptimConfig

PolicyLoss = Callable[..., tuple[torch.Tensor, dict[str, float]]]


def make_optimizer(params, config: OptimConfig) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW and its schedule: linear warm-up over ``warmup_steps`` optimizer steps, then constant."""
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    warmup = config.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup)
                                                  if warmup else 1.0)
    return optimizer, scheduler


def mini_batches(batch: Batch, size: int) -> list[Batch]:
    """The batch cut into consecutive mini-batches of ``size`` rows (the loop already shuffled it)."""
    return batch.chunk(max(1, len(batch) // size))


def micro_batches(batch: Batch, size: int | None) -> Iterator[Batch]:
    """Consecutive slices of at most ``size`` rows (the whole batch when None)."""
    size = size or len(batch)
    for start in range(0, len(batch), size):
        yield batch[start:start + size]


def share(mask: torch.Tensor, total_mask: torch.Tensor, loss_agg_mode: str) -> float:
    """The weight of a micro-batch's loss (``mask``) in its mini-batch's loss (``total_mask``)."""
    if loss_agg_mode == "token-sum":
        return 1.0
    if loss_agg_mode == "token-mean":
        return float(mask.sum() / total_mask.sum().clamp(min=1))
    return float((mask.sum(-1) > 0).sum() / (total_mask.sum(-1) > 0).sum().clamp(min=1))


MicroLoss = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]
"""``(micro-batch, its response mask as float) -> (loss, metrics)``: one micro-batch's part of an update."""


def ppo_updates(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, batch: Batch, algorithm: AlgorithmConfig,
                micro_batch_size: int | None, grad_clip: float, micro_loss: MicroLoss,
                prefix: str) -> dict[str, float]:
    """``ppo_epochs`` passes over the batch's mini-batches, one optimizer step each; metrics averaged.

    Each micro-batch's loss is weighted by its :func:`share` of the
    mini-batch before ``backward``, so the accumulated gradient is the whole
    mini-batch's. The gradient norm (before clipping) is reported as
    ``{prefix}/grad_norm``; a step whose norm is not finite is skipped and
    counted in ``{prefix}/skipped_steps``. ``{prefix}/lr`` is the rate after
    the last step.
    """
    mode = algorithm.policy_loss.loss_agg_mode
    totals: dict[str, list[float]] = {}
    skipped = 0
    model.train()
    try:
        for _ in range(algorithm.ppo_epochs):
            for mini in mini_batches(batch, algorithm.ppo_mini_batch_size):
                optimizer.zero_grad(set_to_none=True)
                for micro in micro_batches(mini, micro_batch_size):
                    mask = micro["response_mask"].float()
                    loss, metrics = micro_loss(micro, mask)
                    (loss * share(mask, mini["response_mask"], mode)).backward()
                    for key, value in metrics.items():
                        totals.setdefault(key, []).append(value)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                totals.setdefault(f"{prefix}/grad_norm", []).append(float(grad_norm))
                if torch.isfinite(grad_norm):
                    optimizer.step()
                    scheduler.step()
                else:
                    skipped += 1
    finally:
        optimizer.zero_grad(set_to_none=True)
        model.eval()
    out = {key: float(np.mean(values)) for key, values in totals.items()}
    out[f"{prefix}/lr"] = optimizer.param_groups[0]["lr"]
    out[f"{prefix}/skipped_steps"] = float(skipped)
    return out


def update_actor(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler, batch: Batch, algorithm: AlgorithmConfig,
                 policy_loss: PolicyLoss, config: OptimConfig) -> dict[str, float]:
    """PPO epochs of the policy loss (:func:`ppo_updates`), with the entropy bonus and KL loss when asked.

    Metrics: ``actor/pg_loss`` and the policy loss's own (``actor/pg_clipfrac``,
    ``actor/ppo_kl``, …), ``actor/kl_loss`` with the KL loss,
    ``actor/entropy_loss`` with an entropy bonus, ``actor/grad_norm``,
    ``actor/lr`` and ``actor/skipped_steps``.
    """
    loss_cfg = algorithm.policy_loss
    mode = loss_cfg.loss_agg_mode

    def micro_loss(micro: Batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        log_prob, entropy = response_logprobs(model, micro["input_ids"], micro["attention_mask"],
                                              micro["position_ids"], micro["responses"],
                                              with_entropy=loss_cfg.entropy_coeff != 0)
        # Only a run that makes these columns passes them: any registered loss serves the others.
        weighted = {key: micro[key] for key in LOSS_COLUMNS if key in micro}
        pg_loss, metrics = policy_loss(micro["old_log_probs"], log_prob, micro["advantages"], mask, loss_cfg,
                                       **weighted)
        metrics = {"actor/pg_loss": pg_loss.item(), **{f"actor/{k}": float(v) for k, v in metrics.items()}}
        loss = pg_loss
        if entropy is not None:
            entropy_term = agg_loss(entropy, mask, mode)
            loss = loss - loss_cfg.entropy_coeff * entropy_term
            metrics["actor/entropy_loss"] = entropy_term.item()
        if loss_cfg.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, micro["ref_log_prob"], loss_cfg.kl_loss_type), mask, mode)
            loss = loss + loss_cfg.kl_loss_coef * kl
            metrics["actor/kl_loss"] = kl.item()
        return loss, metrics

    return ppo_updates(model, optimizer, scheduler, batch, algorithm, config.micro_batch_size, config.grad_clip,
                       micro_loss, "actor")


def update_critic(critic: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  scheduler: torch.optim.lr_scheduler.LRScheduler, batch: Batch, algorithm: AlgorithmConfig,
                  config: CriticConfig) -> dict[str, float]:
    """Epochs of the clipped value loss on the actor's schedule (:func:`ppo_updates`).

    Metrics: ``critic/vf_loss``, ``critic/vf_clipfrac``, ``critic/vpred_mean``,
    ``critic/grad_norm``, ``critic/lr``, ``critic/skipped_steps``.
    """
    mode = algorithm.policy_loss.loss_agg_mode

    def micro_loss(micro: Batch, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        vpreds = response_values(critic, micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                                 micro["responses"].shape[1])
        loss, clipfrac = value_loss(vpreds, micro["returns"], micro["values"], mask, config.cliprange_value, mode)
        return loss, {"critic/vf_loss": loss.item(), "critic/vf_clipfrac": float(clipfrac),
                      "critic/vpred_mean": float(agg_loss(vpreds.detach(), mask, mode))}

    return ppo_updates(critic, optimizer, scheduler, batch, algorithm, config.micro_batch_size, config.grad_clip,
                       micro_loss, "critic")
