"""The plugin ``ray``: ``collect_rollouts`` with runner actors on a Ray cluster.

At ``on_train_start`` it joins the cluster (or starts a local Ray), starts the
store and gateway services on this node unless the recipe names running ones,
and creates the runner actors, which live for the whole run. Each step is the
``remote_runners`` step: the trainer points the gateway at the policy servers,
enqueues the step's rollouts in the store and waits for them; the actors do
the rest. ``on_train_end`` kills the actors and stops what the plugin started.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.builtin.remote_runners import collect_step
from agl_core.gateway.client import ADMIN_TOKEN_ENV as GATEWAY_ADMIN_TOKEN_ENV
from agl_core.gateway.client import TOKEN_ENV as GATEWAY_TOKEN_ENV
from agl_core.gateway.client import check_gateway
from agl_core.http.rules import POLICY_TOKEN_ENV, is_loopback, token_from
from agl_core.plugins import PluginError
from agl_core.rollout.runner import cancel_abandoned
from agl_core.rollout.store_client import TOKEN_ENV as STORE_TOKEN_ENV
from agl_core.rollout.store_client import HttpStore
from agl_plugin_ray import services
from agl_plugin_ray.settings import DEFAULT_ACTORS, RayConfig

if TYPE_CHECKING:  # imported when a run starts: importing ray takes a second, `agl plugins` should not pay it
    from agl_plugin_ray.actors import RunnerActors

AGL_HOOK_API = HOOK_API_VERSION
NAME = "ray"
STORE_FILE = "rollouts.sqlite"
UNSPECIFIED_HOSTS = frozenset({"0.0.0.0", "::"})  # as urlsplit gives them (no brackets)


@dataclass
class RayRuntime:
    """What the plugin keeps for a run; ``close`` undoes what the start did, last first."""

    store: HttpStore
    gateway_url: str
    gateway_token: str | None
    gateway_admin_token: str | None
    actors: RunnerActors
    cleanup: contextlib.ExitStack

    def close(self) -> None:
        self.cleanup.close()


@hookimpl
def plugin_config_schema():
    return RayConfig


def owns_rollouts(ctx) -> bool:
    return ctx.slots.get("collect_rollouts", (None, None))[0] == NAME


@hookimpl
def on_train_start(ctx):
    if owns_rollouts(ctx):
        ctx.state[NAME] = start_runtime(ctx)


@hookimpl
def collect_rollouts(ctx, tasks, mode):
    rt: RayRuntime = ctx.state[NAME]
    rollouts = collect_step(ctx, rt.store, rt.gateway_url, rt.gateway_admin_token, tasks, mode)
    if mode == "train":
        ctx.step_metrics.update(rt.actors.health())
    return rollouts


@hookimpl
def on_train_end(ctx):
    rt = ctx.state.pop(NAME, None)
    if rt is not None:
        rt.close()


def start_runtime(ctx) -> RayRuntime:
    """Join Ray, start the services the recipe does not name, create the actors and wait until each is ready."""
    import ray

    from agl_plugin_ray.actors import RunnerActors, RunnerSpec

    cfg: RayConfig = ctx.plugin_config(NAME)
    rollout = ctx.config.rollout
    if rollout.agent is None:
        raise PluginError("the ray plugin runs the agent named by rollout.agent, which is not set "
                          "(e.g. rollout.agent=my_package.my_agent:agent)")
    with contextlib.ExitStack() as cleanup:
        if connect(cfg):
            cleanup.callback(ray.shutdown)
        store_url, store_token = cfg.store_url, token(cfg.store_token, STORE_TOKEN_ENV, cfg)
        if store_url is None:
            store_url = start_service(cleanup, ctx, cfg, "store", ["--db", str(ctx.run_dir / STORE_FILE)],
                                      {STORE_TOKEN_ENV: store_token})
        gateway_url, gateway_token = cfg.gateway_url, token(cfg.gateway_token, GATEWAY_TOKEN_ENV, cfg)
        admin_token = token_from(cfg.gateway_admin_token, GATEWAY_ADMIN_TOKEN_ENV)
        if gateway_url is None:
            admin_token = admin_token or secrets.token_urlsafe(32)  # the trainer's alone: agents never see it
            gateway_url = start_service(cleanup, ctx, cfg, "gateway", ["--store", store_url, *gateway_flags(ctx)],
                                        {STORE_TOKEN_ENV: store_token, GATEWAY_TOKEN_ENV: gateway_token,
                                         GATEWAY_ADMIN_TOKEN_ENV: admin_token,
                                         POLICY_TOKEN_ENV: rollout.gateway.upstream_token})
        check_gateway(gateway_url, gateway_token, cfg.start_timeout_s)  # a wrong URL or token fails here
        store = HttpStore(store_url, token=store_token, connect_timeout_s=cfg.start_timeout_s)
        cleanup.callback(store.close)
        # Rollouts left unfinished by an earlier trainer (a resumed run's store) have no one waiting for them.
        cancel_abandoned(store, ctx.run_id)
        spec = RunnerSpec(store_url, store_token, gateway_url, gateway_token, rollout.agent, cfg.workers,
                          rollout.model, rollout.timeout_s, rollout.lease_s)
        actors = RunnerActors(cfg, spec)
        cleanup.callback(actors.kill)
        actors.wait_ready(cfg.start_timeout_s)
        return RayRuntime(store, gateway_url, gateway_token, admin_token, actors, cleanup.pop_all())


def gateway_flags(ctx) -> list[str]:
    """``--config KEY=VALUE`` of the ``rollout.gateway`` settings but where it listens (the plugin's to choose) and
    the tokens (passed in the environment, never on a command line others can read); ``--max-connections``."""
    gateway = ctx.config.rollout.gateway
    settings = gateway.model_dump(exclude={"host", "port", "token", "admin_token", "upstream_token", "max_connections"},
                                  exclude_none=True)
    return [*(flag for key, value in settings.items() for flag in ("--config", f"{key}={value}")),
            "--max-connections", str(gateway.max_connections)]


def connect(cfg: RayConfig) -> bool:
    """Join ``cfg.address``, or start a local Ray when there is none; True when this call did ``ray.init``.

    A process already connected to Ray (a backend on Ray did it) keeps its
    connection, which the plugin then never shuts down.
    """
    import ray

    if ray.is_initialized():
        return False
    if cfg.address is not None:
        ray.init(address=cfg.address)
        return True
    per_node = cfg.actors_per_node or cfg.actors or DEFAULT_ACTORS
    # "local": a new Ray of our own, never one named by a leftover /tmp/ray/ray_current_cluster
    ray.init(address="local", include_dashboard=False,
             num_cpus=cfg.local_num_cpus or max(os.cpu_count() or 1, math.ceil(per_node * cfg.num_cpus)))
    return True


def token(configured: str | None, env: str, cfg: RayConfig) -> str | None:
    """A service's token: the recipe's, else the environment's, else (off loopback only) a fresh one."""
    chosen = configured or os.environ.get(env) or None
    if chosen is None and not is_loopback(cfg.services_host):
        chosen = secrets.token_urlsafe(32)  # the server rules: off loopback only with a token
    return chosen


def start_service(cleanup: contextlib.ExitStack, ctx, cfg: RayConfig, name: str, args: list[str],
                  tokens: dict[str, str | None]) -> str:
    """Start ``agl serve NAME ARGS`` on this node (stopped by ``cleanup``); return the URL other nodes use."""
    env = {key: value for key, value in tokens.items() if value is not None}
    service = services.start(name, [name, *args, "--host", cfg.services_host], ctx.run_dir / f"{name}.log",
                             env, cfg.start_timeout_s)
    cleanup.callback(service.stop)
    return advertised(service.url)


def advertised(url: str) -> str:
    """``url`` with an unspecified bind address (0.0.0.0, ::) replaced by this node's address."""
    import ray

    parts = urlsplit(url)
    if parts.hostname not in UNSPECIFIED_HOSTS:
        return url
    return urlunsplit(parts._replace(netloc=f"{ray.util.get_node_ip_address()}:{parts.port}"))
