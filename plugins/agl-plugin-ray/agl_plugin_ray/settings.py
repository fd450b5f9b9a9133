"""The recipe section ``plugins.ray``: which cluster, how many runner actors where, and which services."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_ACTORS = 2


class RayConfig(BaseModel):
    """Settings of the Ray plugin; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        None, description="the Ray cluster to join ('auto', 'HOST:PORT', 'ray://HOST:PORT'); None: the Ray this "
                          "process is already connected to, else a local Ray started (and stopped) by the plugin")
    local_num_cpus: float | None = Field(
        None, gt=0, description="logical CPUs of the local Ray the plugin starts (None: the machine's cores, or "
                                "more when the actors ask for more)")
    actors: int | None = Field(
        None, ge=1, description=f"runner actors in all, spread over the nodes (default {DEFAULT_ACTORS} unless "
                                "actors_per_node is set)")
    actors_per_node: int | None = Field(
        None, ge=1, description="runner actors on every alive node (instead of actors)")
    num_cpus: float = Field(
        1.0, ge=0, description="CPUs Ray reserves for each actor (fractions allowed)")
    runtime_env: dict[str, Any] | None = Field(
        None, description="Ray runtime_env of each actor (env_vars, pip, working_dir, py_modules, …)")
    workers: int = Field(8, ge=1, description="agent workers (threads) of each actor")
    start_timeout_s: float = Field(
        120.0, gt=0, description="time allowed for a service to print its URL and for every actor to be placed "
                                 "and ready; beyond it the run stops with what is missing")
    store_url: str | None = Field(
        None, description="a running store service (agl serve store); None: the plugin starts one on this node, "
                          "on <run_dir>/rollouts.sqlite")
    store_token: str | None = Field(None, description="bearer token of store_url (default: $AGL_STORE_TOKEN)")
    gateway_url: str | None = Field(
        None, description="a running gateway service (agl serve gateway) recording into store_url; None: the "
                          "plugin starts one on this node")
    gateway_token: str | None = Field(None, description="bearer token of gateway_url (default: $AGL_GATEWAY_TOKEN)")
    gateway_admin_token: str | None = Field(
        None, description="admin token of gateway_url, which the trainer sets the policy with and agents never see "
                          "(default: $AGL_GATEWAY_ADMIN_TOKEN; a gateway the plugin starts gets a fresh one)")
    services_host: str = Field(
        "127.0.0.1", description="address the services the plugin starts bind; a cluster of several machines "
                                 "needs one its nodes reach (e.g. 0.0.0.0). Off loopback they require a token: "
                                 "the plugin makes one when store_token / gateway_token is not set")

    @model_validator(mode="after")
    def _one_way_to_count_actors(self) -> RayConfig:
        if self.actors is not None and self.actors_per_node is not None:
            raise ValueError("plugins.ray.actors and plugins.ray.actors_per_node both set: give one (actors in "
                             "all, spread over the nodes, or actors on every node)")
        if self.gateway_url is not None and self.store_url is None:
            raise ValueError("plugins.ray.gateway_url is set but plugins.ray.store_url is not: a running gateway "
                             "records into a running store, name it too")
        return self
