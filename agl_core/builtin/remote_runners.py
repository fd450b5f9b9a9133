"""Built-in plugin ``remote_runners``: ``collect_rollouts`` by runners elsewhere (``agl runner``, Ray actors).

Active only when a recipe enables it::

    rollout:
      agent: my_package.agents:solve   # what the runners run (agl runner --agent); the trainer does not import it
      store: http                      # the store service the runners lease from
    plugins:
      http_store: {url: "http://store-host:8300"}
      remote_runners: {gateway_url: "http://gateway-host:8400"}

The trainer runs no agent. Each step it points the gateway service
(``agl serve gateway``) at the servers of the ``policy_endpoints`` slot, with
the step's weight version, ``rollout.sampling`` and the run's call seed;
queues the tasks in the store (``rollout.n`` samples each in training,
``rollout.max_attempts`` attempts each) and returns the rollouts once all
have ended, with the same ``rollout/…`` metrics as the local runner. A runner
lost mid-rollout loses its lease and its rollouts go to another runner.
The runners' own flags set their attempts' timeout and lease. The trainer
does not load the agent, so the rollouts' metadata has no ``agent_name``: it
is on the spans the agents emit (rewards, annotations), not on model calls.

:func:`collect_step` is that step alone, for a plugin with its own store and
gateway (the Ray runners).
"""

from __future__ import annotations


from pydantic import Field

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.builtin.local_runner import collect_options, gateway_sampling, gateway_seed, policy_urls, weight_version
from agl_core.config import Section
from agl_core.data import Rollout, Task
from agl_core.gateway.client import ADMIN_TOKEN_ENV, TOKEN_ENV, check_gateway, set_policy
from agl_core.http.rules import token_from
from agl_core.plugins import PluginError
from agl_core.rollout.runner import cancel_abandoned, collect
from agl_core.rollout.store import Store

AGL_HOOK_API = HOOK_API_VERSION
AGL_OPT_IN = True  # an alternative to local_runner, which fills the same slot
NAME = "remote_runners"


class RemoteRunnersConfig(Section):
    gateway_url: str | None = Field(None, description="the gateway service the runners' agents call "
                                                      "(agl serve gateway prints it)")
    gateway_token: str | None = Field(None, description="the gateway's bearer token (default: $AGL_GATEWAY_TOKEN)")
    gateway_admin_token: str | None = Field(None, description="the gateway's admin token, which the trainer sets "
                                                              "the policy with (default: $AGL_GATEWAY_ADMIN_TOKEN)")
    connect_timeout_s: float = Field(60.0, ge=0, description="how long to retry a gateway that does not answer")


@hookimpl
def plugin_config_schema():
    return RemoteRunnersConfig


def owns_rollouts(ctx) -> bool:
    return ctx.slots.get("collect_rollouts", (None, None))[0] == NAME


@hookimpl
def on_train_start(ctx):
    if not owns_rollouts(ctx):
        return
    cfg = ctx.plugin_config(NAME)
    if cfg.gateway_url is None:
        raise PluginError("plugins.remote_runners.gateway_url is not set: name the gateway service the runners' "
                          "agents call (agl serve gateway prints its URL)")
    if "policy_endpoints" not in ctx.slots:
        raise PluginError("remote runners serve the agent named by rollout.agent, which is not set "
                          "(e.g. rollout.agent=my_package.my_agent:agent, as given to agl runner --agent)")
    # A wrong URL or token is a start-up error, not a first-step one.
    check_gateway(cfg.gateway_url, gateway_token(cfg), cfg.connect_timeout_s)
    store = ctx.components.get("store", ctx.config.rollout.store).obj(ctx)
    # Rollouts left unfinished by an earlier trainer have no one waiting for them.
    cancel_abandoned(store, ctx.run_id)
    ctx.state[NAME] = store


@hookimpl
def collect_rollouts(ctx, tasks, mode):
    cfg = ctx.plugin_config(NAME)
    return collect_step(ctx, ctx.state[NAME], cfg.gateway_url, token_from(cfg.gateway_admin_token, ADMIN_TOKEN_ENV),
                        tasks, mode)


@hookimpl
def on_train_end(ctx):
    store = ctx.state.pop(NAME, None)
    if store is not None:
        store.close()


def gateway_token(cfg: RemoteRunnersConfig) -> str | None:
    return token_from(cfg.gateway_token, TOKEN_ENV)


def collect_step(ctx, store: Store, gateway_url: str, admin_token: str | None, tasks: list[Task],
                 mode: str) -> list[Rollout]:
    """One step's rollouts by runners leasing from ``store`` and calling the gateway at ``gateway_url``.

    Points the gateway at the policy of this step (:func:`set_policy`, with the gateway's ``admin_token``), queues
    the tasks and waits for every rollout to end (:func:`agl_core.rollout.runner.collect`);
    in training, reports the ``rollout/…`` metrics in ``ctx.step_metrics``.
    """
    set_policy(gateway_url, urls=policy_urls(ctx), weight_version=weight_version(ctx, mode),
               sampling=gateway_sampling(ctx), seed=gateway_seed(ctx), token=admin_token)
    result = collect(store, tasks, max_attempts=ctx.config.rollout.max_attempts, **collect_options(ctx, mode))
    if mode == "train":
        ctx.step_metrics.update(result.metrics)
    return result.rollouts
