"""The driver side of each compute slot: a ``Batch`` in, verl's worker-group call, tensors out.

Each function is the body of the matching ``RayPPOTrainer`` method of verl
(``_compute_old_log_prob``, ``_compute_ref_log_prob``, ``_compute_values``,
``_update_actor``, ``_update_critic``) with agl_core's ``Batch`` at the ends:
the batch becomes a ``DataProto`` without copying a tensor, then verl's
TensorDict, then verl's no-padding layout (``left_right_2_no_padding``); the
workers' nested outputs come back through ``no_padding_2_padding``. Only
tensor columns travel to the workers (they read nothing else), so the
group ids and other NumPy columns are not pickled for every call.

The batch is already padded to a multiple of the data-parallel size by the
loop (log-probs, values) or cut to whole mini-batches (updates), as verl's
dispatch needs.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig

from agl_core.data import Batch


def _no_padding(batch: Batch, **meta: Any):
    """verl's no-padding TensorDict of ``batch``'s tensor columns, with ``meta`` as its non-tensor entries."""
    from verl.workers.utils.padding import left_right_2_no_padding

    data = Batch(tensors=batch.tensors).to_dataproto()
    data.meta_info.update(meta)
    return left_right_2_no_padding(data.to_tensordict())


def _padded(output, key: str, td) -> torch.Tensor:
    """A worker output column back in the batch's ``(rows, response_length)`` layout, float32."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(tu.get(output, key), td).float()


def _metrics(output) -> dict[str, Any]:
    from verl.utils import tensordict_utils as tu

    return tu.get(output, "metrics") or {}


def _reduced(metrics: dict[str, Any], prefix: str) -> dict[str, float]:
    """verl's per-mini-batch metric lists as one number each, named as verl's trainer logs them."""
    from verl.utils.metric import reduce_metrics
    from verl.utils.py_functional import rename_dict

    out = rename_dict(dict(metrics), prefix)
    mfu = out.pop(f"{prefix}mfu", None)
    if mfu is not None:
        out[f"perf/mfu/{prefix.rstrip('/')}"] = mfu
    return {key: float(value) for key, value in reduce_metrics(out).items()}


def compute_log_prob(actor, batch: Batch, temperature: float,
                     calculate_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """``(log_probs, entropy, metrics)`` of the responses under the current actor (``_compute_old_log_prob``)."""
    # global_token_num (tokens per row, as verl's trainer sets it) is what verl's workers compute MFU from.
    td = _no_padding(batch, temperature=temperature, calculate_entropy=calculate_entropy, compute_loss=False,
                     global_token_num=batch["attention_mask"].sum(-1).tolist())
    output = actor.compute_log_prob(td)
    entropy = _padded(output, "entropy", td) if calculate_entropy else None
    mfu = _metrics(output).get("mfu")
    metrics = {} if mfu is None else {"perf/mfu/actor_infer": float(mfu)}
    return _padded(output, "log_probs", td), entropy, metrics


def compute_ref_log_prob(ref, batch: Batch, temperature: float, ref_in_actor: bool) -> torch.Tensor:
    """Reference log-probs (``_compute_ref_log_prob``): the reference model, or the actor without its LoRA adapter."""
    meta = {"temperature": temperature, "calculate_entropy": False, "compute_loss": False}
    if ref_in_actor:
        td = _no_padding(batch, no_lora_adapter=True, **meta)
        output = ref.compute_log_prob(td)
    else:
        td = _no_padding(batch, **meta)
        output = ref.compute_ref_log_prob(td)
    return _padded(output, "log_probs", td)


def compute_values(critic, batch: Batch) -> torch.Tensor:
    """The critic's values of the response positions (``_compute_values``)."""
    td = _no_padding(batch, compute_loss=False)
    output = critic.infer_batch(td).get()
    return _padded(output, "values", td)


def update_actor(actor, batch: Batch, cfg: DictConfig, mini_batch_rows: int) -> dict[str, float]:
    """PPO epochs of the actor over the batch (``_update_actor``); verl's actor metrics.

    ``mini_batch_rows`` is agl_core's ``algorithm.ppo_mini_batch_size`` (rows),
    what verl's trainer computes as ``ppo_mini_batch_size * rollout.n``.
    """
    actor_cfg, rollout_cfg = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout
    td = _no_padding(
        batch, multi_turn=rollout_cfg.multi_turn.enable, temperature=rollout_cfg.temperature,
        calculate_entropy=bool(actor_cfg.get("calculate_entropy", False)) or actor_cfg.entropy_coeff != 0,
        distillation_use_topk=False, distillation_only=False,
        global_batch_size=mini_batch_rows, mini_batch_size=mini_batch_rows, epochs=actor_cfg.ppo_epochs,
        seed=actor_cfg.data_loader_seed, dataloader_kwargs={"shuffle": actor_cfg.shuffle}, compute_loss=True)
    return _reduced(_metrics(actor.update_actor(td)), "actor/")


def update_critic(critic, batch: Batch, cfg: DictConfig, mini_batch_rows: int) -> dict[str, float]:
    """Value-loss epochs of the critic over the batch (``_update_critic``); verl's critic metrics."""
    critic_cfg = cfg.critic
    td = _no_padding(batch, global_batch_size=mini_batch_rows, mini_batch_size=mini_batch_rows,
                     epochs=critic_cfg.ppo_epochs, seed=critic_cfg.data_loader_seed,
                     dataloader_kwargs={"shuffle": critic_cfg.shuffle})
    return _reduced(_metrics(critic.train_mini_batch(td).get()), "critic/")
