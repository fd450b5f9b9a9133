"""Runner actors: processes on the nodes of a Ray cluster, each running agent workers against the services.

An actor is created once for the run and restarted by Ray whenever its
process dies (``max_restarts=-1``): the attempts it was running lose their
leases and the store requeues them, and the restarted actor leases anew.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from agl_plugin_ray.settings import DEFAULT_ACTORS, RayConfig


@dataclass(frozen=True)
class RunnerSpec:
    """What every actor runs and where it reports: the services, the agent, its limits."""

    store_url: str
    store_token: str | None
    gateway_url: str
    gateway_token: str | None
    agent: str
    workers: int
    model: str
    timeout_s: float
    lease_s: float


@dataclass(frozen=True)
class ActorInfo:
    """Where an actor's current process runs."""

    node_id: str
    pid: int


class RunnerActor:
    """One runner process: ``spec.workers`` agent workers on a thread of the actor, until the process ends."""

    def __init__(self, spec: RunnerSpec):
        from agl_core.rollout.agents import load_agent
        from agl_core.rollout.runner_service import serve_runner
        from agl_core.rollout.store_client import HttpStore

        agent = load_agent(spec.agent)  # a bad agent fails the actor's creation, which the trainer waits for
        store = HttpStore(spec.store_url, token=spec.store_token)
        # Never stopped: when the process ends, the attempts it was running are left to their leases.
        threading.Thread(target=serve_runner, name="agl-ray-runner", daemon=True, args=(store, spec.gateway_url, agent),
                         kwargs={"stop": threading.Event(), "workers": spec.workers, "model": spec.model,
                                 "api_key": spec.gateway_token or "agl", "timeout_s": spec.timeout_s,
                                 "lease_s": spec.lease_s, "timeout_setting": "rollout.timeout_s"}).start()

    def info(self) -> ActorInfo:
        """Where this actor's process runs."""
        return ActorInfo(ray.get_runtime_context().get_node_id(), os.getpid())


def placements(cfg: RayConfig) -> list[dict]:
    """The Ray scheduling options of each actor: ``actors_per_node`` on every alive node, else ``actors`` spread."""
    if cfg.actors_per_node is None:
        return [{"scheduling_strategy": "SPREAD"}] * (cfg.actors or DEFAULT_ACTORS)
    nodes = [node["NodeID"] for node in ray.nodes() if node["Alive"]]
    # soft: an actor whose node is gone is restarted on another one rather than never
    return [{"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=True)}
            for node in nodes for _ in range(cfg.actors_per_node)]


class RunnerActors:
    """The run's actors: created and awaited at start, checked after each step, killed at the end."""

    def __init__(self, cfg: RayConfig, spec: RunnerSpec):
        remote = ray.remote(RunnerActor)
        self.handles = [
            remote.options(num_cpus=cfg.num_cpus, runtime_env=cfg.runtime_env, max_restarts=-1,
                           max_task_retries=0, **placement).remote(spec)
            for placement in placements(cfg)]
        self.pids: list[int | None] = [None] * len(self.handles)
        self.restarts = 0

    def wait_ready(self, timeout_s: float) -> None:
        """Return once every actor answers; RuntimeError naming the settings or the actor's error otherwise."""
        pending = [h.info.remote() for h in self.handles]
        _, missing = ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        if missing:
            raise RuntimeError(
                f"{len(missing)} of {len(self.handles)} Ray runner actors were not ready within "
                f"plugins.ray.start_timeout_s={timeout_s:g} s: the cluster may lack the CPUs they ask for "
                f"(plugins.ray.num_cpus per actor; cluster resources: {ray.cluster_resources()})")
        try:
            self.pids = [info.pid for info in ray.get(pending)]
        except ray.exceptions.RayActorError as exc:  # its creation failed: the agent, the runtime_env, ...
            raise RuntimeError(f"a Ray runner actor could not start: {exc}") from None

    def health(self, timeout_s: float = 1.0) -> dict[str, float]:
        """``ray/…`` metrics: actors that answered within ``timeout_s``, and restarts (new processes) seen so far."""
        refs = [h.info.remote() for h in self.handles]
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        alive = 0
        for i, ref in enumerate(refs):
            try:
                info = ray.get(ref, timeout=0)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                continue  # restarting, or not yet placed again
            alive += 1
            if self.pids[i] != info.pid:
                self.restarts += 1
                self.pids[i] = info.pid
        return {"ray/actors": float(len(self.handles)), "ray/actors_alive": float(alive),
                "ray/actor_restarts": float(self.restarts)}

    def kill(self) -> None:
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
