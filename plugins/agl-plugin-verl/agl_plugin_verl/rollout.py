"""verl's rollout servers (vLLM, SGLang) of the actor's worker group, as the run's policy endpoints.

verl's hybrid engine runs one OpenAI-compatible server per rollout replica
inside the actor's processes. The servers sleep (KV cache released, and the
weights too unless they are a LoRA adapter's) while the actor trains, and
wake before agents call them, with the actor's current weights: a wake syncs
them when the actor changed since they were synced, or when the sleep
discarded them; otherwise it only wakes. :class:`RolloutServers` keeps that
cycle: ``endpoints()`` wakes them and returns their URLs for the gateway,
``sleep()`` aborts what the servers still generate (a straggler's call the
rollout already gave up on) and puts them back to sleep before the next
training computation, ``shutdown()`` stops their Ray actors, which outlive
the worker groups when Ray was started by someone else.

How servers are started and woken differs by verl version: 0.7 wakes its
replicas directly; 0.8 and later sync weights through a
``CheckpointEngineManager`` (``update_weights`` also wakes the replicas).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig
from packaging.version import Version

from agl_plugin_verl.compat import is_verl_0_7

log = logging.getLogger("agl_plugin_verl")


def _nothing() -> None:
    return None


@dataclass
class RolloutServers:
    """The run's rollout servers: addresses and their transitions.

    ``_sync(weights_version)`` loads the actor's weights into the sleeping
    servers and wakes them; ``_wake()`` wakes them with the weights they
    kept (used only when ``keeps_weights`` says sleeping keeps them);
    ``_abort()`` stops every request in flight and ``_resume()`` lets
    requests in again; ``actors`` are the Ray actors ``shutdown()`` kills.
    """

    addresses: list[str]
    _sync: Callable[[int], None]
    _sleep: Callable[[], None]
    awake: bool = False
    weights_version: int | None = None
    _wake: Callable[[], None] | None = None
    keeps_weights: bool = False
    _abort: Callable[[], None] = _nothing
    _resume: Callable[[], None] = _nothing
    actors: list[Any] = field(default_factory=list)
    syncs: int = 0  # weight syncs so far

    def endpoints(self, weights_version: int) -> list[str]:
        """Base URLs (``http://host:port/v1``) of servers awake with the actor's weights of ``weights_version``."""
        if self.awake and self.weights_version != weights_version:
            self.sleep()  # verl loads new weights only into sleeping servers
        if not self.awake:
            if self.weights_version == weights_version and self.keeps_weights and self._wake is not None:
                self._wake()  # the weights they slept with are the actor's: no sync
            else:
                self._sync(weights_version)
                self.syncs += 1
            self._resume()
            self.awake, self.weights_version = True, weights_version
        return [f"http://{address}/v1" for address in self.addresses]

    def sleep(self) -> None:
        """Abort what is still generating, then release the servers' GPU memory for training (no-op when asleep)."""
        if self.awake:
            self._abort()
            self._sleep()
            self.awake = False

    def shutdown(self) -> None:
        """Kill the servers' Ray actors (and their router's); the rollout servers cannot be used after."""
        import ray

        actors, self.actors, self.awake = self.actors, [], False
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - one gone actor must not keep the others alive
                log.warning("could not stop a rollout server actor: %s", exc)


def sleep_keeps_weights(cfg: DictConfig) -> bool:
    """Whether verl's hybrid servers keep their weights asleep (vLLM sleep level 1), verl 0.9.1's rule.

    They do when the weights that change are a LoRA adapter's (the adapter is
    applied, not merged) or an MTP drafter rolls out; a full model sleeps at
    level 2, its weights discarded, so every wake must sync them.
    """
    model, rollout = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout
    lora = model.get("lora") or {}
    adapter = (model.get("lora_rank", 0) or 0) > 0 or (lora.get("rank", 0) or 0) > 0
    mtp = rollout.get("mtp") or {}
    return (adapter and not lora.get("merge", False)) or bool(mtp.get("enable") and mtp.get("enable_rollout"))


def _server_actors(replicas, *more) -> list[Any]:
    return [server for replica in replicas for server in getattr(replica, "servers", ())] + \
        [actor for actor in more if actor is not None]


def _run_all(coroutines) -> None:
    async def run_all():
        await asyncio.gather(*coroutines)

    asyncio.run(run_all())


def _start_replicas(cfg: DictConfig, actor) -> RolloutServers:
    """verl 0.7: one replica per rollout world, hybrid with the actor group (``AgentLoopManager`` without its agents)."""
    from verl.workers.rollout.replica import get_rollout_replica_class

    rollout = cfg.actor_rollout_ref.rollout
    replica_world = (rollout.tensor_model_parallel_size * rollout.data_parallel_size
                     * rollout.pipeline_model_parallel_size)
    replicas = [get_rollout_replica_class(rollout.name)(replica_rank=rank, config=rollout,
                                                        model_config=cfg.actor_rollout_ref.model,
                                                        gpus_per_node=cfg.trainer.n_gpus_per_node)
                for rank in range(actor.world_size // replica_world)]
    _run_all([replica.init_hybrid(actor) for replica in replicas])
    servers = RolloutServers([replica._server_address for replica in replicas],
                             lambda version: _run_all([replica.wake_up() for replica in replicas]),
                             lambda: _run_all([replica.sleep() for replica in replicas]), awake=True,
                             actors=_server_actors(replicas))
    servers.sleep()
    return servers


def _start_llm_servers(cfg: DictConfig, actor, pool) -> RolloutServers:
    """verl 0.8+: ``LLMServerManager`` replicas and the ``CheckpointEngineManager`` that syncs their weights."""
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerManager

    manager = LLMServerManager.create(config=cfg, worker_group=actor, rollout_resource_pool=pool)
    sync = CheckpointEngineManager(config=omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout.checkpoint_engine),
                                   actor_wg=actor, replicas=manager.get_replicas())
    servers = RolloutServers(list(manager.get_addresses()), lambda version: sync.update_weights(version),
                             sync.sleep_replicas, awake=True, _wake=sync.wake_up_replicas,
                             keeps_weights=sleep_keeps_weights(cfg),
                             _abort=getattr(sync, "abort_replicas", _nothing),
                             _resume=getattr(sync, "resume_generation_replicas", _nothing),
                             actors=_server_actors(manager.get_replicas(),
                                                   getattr(manager, "global_load_balancer", None)))
    servers.sleep()
    return servers


def start(cfg: DictConfig, actor, pool, version: Version) -> RolloutServers:
    """Start the rollout servers of ``actor`` (asleep), the way the installed verl's trainer does."""
    if is_verl_0_7(version):
        return _start_replicas(cfg, actor)
    return _start_llm_servers(cfg, actor, pool)
