"""verl's worker groups for a run, built the way verl's own trainer builds them.

One Ray resource pool (``trainer.n_gpus_per_node`` processes on each of
``trainer.nnodes`` nodes); on it, verl's colocated workers: the actor (with
the rollout engine and, when a reference policy is needed, the reference
model, as verl's trainer fuses them), and the critic when the estimator
needs one. ``trainer.device`` picks the worker classes: verl's engine
workers (``cuda``, ``npu``) or the CPU ones of ``cpu.py`` (``cpu``: tests,
CI). That choice is the only difference between the two; everything else
in this module is the same on both.

Every worker class here installs agl_core's estimators and policy losses
into verl's registries in its own process
(:class:`~agl_plugin_verl.bridge_worker.BridgeMixin`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import ray
from omegaconf import DictConfig

from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker

from agl_plugin_verl.bridge import Registrations
from agl_plugin_verl.bridge_worker import BridgeMixin

log = logging.getLogger("agl_plugin_verl")

CPU = "cpu"


class VerlActorRolloutRefWorker(BridgeMixin, ActorRolloutRefWorker):
    """verl's actor/rollout/reference engine worker (GPU), with the bridge installed."""

    def __init__(self, config, role, agl_registrations=None, **kwargs):
        self.install_bridge(agl_registrations)
        super().__init__(config, role, **kwargs)


class VerlCriticWorker(BridgeMixin, TrainingWorker):
    """verl's training worker as the critic (GPU), with the bridge installed."""

    def __init__(self, config, agl_registrations=None):
        self.install_bridge(agl_registrations)
        super().__init__(config)


def worker_classes(device: str) -> tuple[type, type]:
    """``(actor_rollout_ref, critic)`` worker classes for ``trainer.device``."""
    if device == CPU:
        from agl_plugin_verl.cpu import CpuActorRolloutRefWorker, CpuCriticWorker

        return CpuActorRolloutRefWorker, CpuCriticWorker
    return VerlActorRolloutRefWorker, VerlCriticWorker


@dataclass(frozen=True)
class Layout:
    """Which verl roles run, and where the reference log-probs come from.

    verl's trainer fuses the reference into the actor worker
    (``actor_rollout_ref``), or, with LoRA, takes the actor with its adapter
    disabled (``ref_in_actor``). The CPU workers have no rollout engine, so
    their actor role is ``actor`` and a reference, when needed, is verl's
    separate ``ref`` role, colocated in the same processes.
    """

    actor_role: str
    ref_role: str | None
    ref_in_actor: bool
    critic: bool


def layout(cfg: DictConfig, needs_ref: bool, needs_critic: bool) -> Layout:
    """The roles for ``cfg`` (verl's config) and what the recipe's algorithm needs."""
    model = cfg.actor_rollout_ref.model
    lora_rank = model.get("lora", {}).get("rank", 0) or model.get("lora_rank", 0)
    ref_in_actor = lora_rank > 0 or model.get("lora_adapter_path") is not None
    separate_ref = needs_ref and not ref_in_actor
    if cfg.trainer.device == CPU:
        return Layout("actor", "ref" if separate_ref else None, ref_in_actor, needs_critic)
    return Layout("actor_rollout_ref" if separate_ref else "actor_rollout", None, ref_in_actor, needs_critic)


@dataclass
class WorkerGroups:
    """The run's worker groups. ``ref`` is the group whose ``compute_ref_log_prob`` gives reference log-probs."""

    pool: Any
    actor: Any
    ref: Any | None
    critic: Any | None
    layout: Layout
    dp_size: int

    def shutdown(self) -> None:
        """Stop the worker processes and release their placement groups."""
        # Every role runs in the same colocated processes: the actor group holds them all.
        for worker in self.actor._workers:
            ray.kill(worker)
        for pg in self.pool.pgs or ():
            ray.util.remove_placement_group(pg)


def critic_training_config(cfg: DictConfig, verl_0_7: bool) -> tuple[Any, Any]:
    """``(critic config, TrainingWorkerConfig)`` of the critic, made from ``cfg.critic`` as verl's trainer makes them.

    verl 0.7 keeps the critic's engine settings under ``model.fsdp_config``;
    later versions under ``engine``.
    """
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorkerConfig

    critic = omega_conf_to_dataclass(cfg.critic)
    if verl_0_7:
        engine, model = critic.model.fsdp_config, critic.model_config
    else:
        engine, model = critic.engine, critic.model
    engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    return critic, TrainingWorkerConfig(model_type="value_model", model_config=model, engine_config=engine,
                                        optimizer_config=critic.optim, checkpoint_config=critic.checkpoint)


def build(cfg: DictConfig, *, needs_ref: bool, needs_critic: bool, registrations: Registrations,
          verl_0_7: bool) -> WorkerGroups:
    """Create the resource pool and the colocated worker groups, initialise their models.

    Mirrors ``RayPPOTrainer.init_workers``: one ``RayClassWithInitArgs`` per
    role, fused by ``create_colocated_worker_cls`` into one Ray actor per
    process, spawned into per-role groups; the critic gets verl's value
    loss; models are initialised critic first, actor last (so vLLM sizes its
    KV cache after the others have taken their memory).
    """
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls
    from verl.workers.utils.losses import value_loss

    device = cfg.trainer.device
    actor_cls, critic_cls = worker_classes(device)
    roles = layout(cfg, needs_ref, needs_critic)
    # On a CPU every process takes one whole core; verl's GPU default lets rollout servers share a GPU.
    pool = RayResourcePool(process_on_nodes=[cfg.trainer.n_gpus_per_node] * cfg.trainer.nnodes,
                           use_gpu=device != CPU, max_colocate_count=1 if device == CPU else 3,
                           name_prefix="global_pool")
    classes = {roles.actor_role: RayClassWithInitArgs(
        cls=ray.remote(actor_cls), config=cfg.actor_rollout_ref, role=roles.actor_role,
        distillation_config=cfg.get("distillation"), agl_registrations=registrations)}
    if roles.ref_role:
        classes[roles.ref_role] = RayClassWithInitArgs(cls=ray.remote(actor_cls), config=cfg.actor_rollout_ref,
                                                       role=roles.ref_role, agl_registrations=registrations)
    critic_config = None
    if roles.critic:
        critic_config, training_config = critic_training_config(cfg, verl_0_7)
        classes["critic"] = RayClassWithInitArgs(cls=ray.remote(critic_cls), config=training_config,
                                                 agl_registrations=registrations)
    fused = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=create_colocated_worker_cls(class_dict=classes),
                           device_name=device)
    groups = fused.spawn(prefix_set=classes.keys())
    critic = groups.get("critic")
    if critic is not None:
        critic.reset()
        critic.set_loss_fn(partial(value_loss, config=critic_config))
    ref = None
    if roles.ref_role:
        ref = groups[roles.ref_role]
        ref.init_model()
    actor = groups[roles.actor_role]
    actor.init_model()
    if needs_ref and ref is None:
        ref = actor  # fused reference, or the actor with its adapter disabled
    dp_size = max(actor._query_dispatch_info("actor")) + 1
    log.info("verl workers: %s on %d %s process(es), data-parallel size %d",
             ", ".join(classes), pool.world_size, device, dp_size)
    return WorkerGroups(pool, actor, ref, critic, roles, dp_size)
