"""verl's rollout servers (vLLM, SGLang) of the actor's worker group, as the run's policy endpoints.

verl's hybrid engine runs one OpenAI-compatible server per rollout replica
inside the actor's processes. The servers sleep (weights and KV cache
released) while the actor trains, and wake with the actor's current weights
before agents call them. :class:`RolloutServers` keeps that cycle:
``endpoints()`` wakes them (syncing weights first when the actor changed)
and returns their URLs for the gateway, ``sleep()`` puts them back before
the next training computation.

How servers are started and woken differs by verl version: 0.7 wakes its
replicas directly; 0.8 and later sync weights through a
``CheckpointEngineManager`` (``update_weights`` also wakes the replicas).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from omegaconf import DictConfig
from packaging.version import Version

from agl_plugin_verl.compat import is_verl_0_7


@dataclass
class RolloutServers:
    """The run's rollout servers: addresses and the two transitions (``wake(weights_version)``, ``sleep()``)."""

    addresses: list[str]
    _wake: Callable[[int], None]
    _sleep: Callable[[], None]
    awake: bool = False
    weights_version: int | None = None

    def endpoints(self, weights_version: int) -> list[str]:
        """Base URLs (``http://host:port/v1``) of servers awake with the actor's weights of ``weights_version``."""
        if self.awake and self.weights_version != weights_version:
            self.sleep()  # verl loads new weights only into sleeping servers
        if not self.awake:
            self._wake(weights_version)
            self.awake, self.weights_version = True, weights_version
        return [f"http://{address}/v1" for address in self.addresses]

    def sleep(self) -> None:
        """Release the servers' GPU memory for training (no-op when asleep)."""
        if self.awake:
            self._sleep()
            self.awake = False


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
                             lambda: _run_all([replica.sleep() for replica in replicas]), awake=True)
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
                             sync.sleep_replicas, awake=True)
    servers.sleep()
    return servers


def start(cfg: DictConfig, actor, pool, version: Version) -> RolloutServers:
    """Start the rollout servers of ``actor`` (asleep), the way the installed verl's trainer does."""
    if is_verl_0_7(version):
        return _start_replicas(cfg, actor)
    return _start_llm_servers(cfg, actor, pool)
