"""Built-in plugin ``local_runner``: the default ``collect_rollouts``, agents run as threads of the trainer.

For a run it opens the store named by ``rollout.store``, serves the gateway on
``rollout.gateway.host:port`` and starts ``rollout.n_workers`` agent workers;
each step it points the gateway at the servers of the ``policy_endpoints``
slot, runs the agent on every task (``rollout.n`` samples each in train
mode) and returns the rollouts once all have ended, reporting ``rollout/…``
metrics. A backend that fills ``collect_rollouts`` itself takes precedence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.plugins import PluginError
from agl_core.rollout.agents import LLM, load_agent
from agl_core.rollout.runner import LocalRunner, cancel_abandoned
from agl_core.rollout.store import Store

if TYPE_CHECKING:  # the gateway's server (Starlette, uvicorn) is imported when a run starts one
    from agl_core.gateway import Gateway
    from agl_core.http.server import ServerThread

AGL_HOOK_API = HOOK_API_VERSION
NAME = "local_runner"


@dataclass
class LocalRuntime:
    """What the local runner keeps for a run: the store, the gateway and its server, the workers."""

    store: Store
    gateway: Gateway
    server: ServerThread
    runner: LocalRunner

    def close(self) -> None:
        try:
            self.runner.stop()
            self.server.stop()
        finally:
            self.store.close()


def runtime(ctx) -> LocalRuntime:
    """The run's runtime, started on first use."""
    if NAME not in ctx.state:
        ctx.state[NAME] = start_runtime(ctx)
    return ctx.state[NAME]


def start_runtime(ctx) -> LocalRuntime:
    cfg = ctx.config.rollout
    if cfg.agent is None:
        raise PluginError("the local runner runs the agent named by rollout.agent, which is not set "
                          "(e.g. rollout.agent=my_package.my_agent:agent)")
    from agl_core.gateway import Gateway

    agent = load_agent(cfg.agent)
    store = ctx.components.get("store", cfg.store).obj(ctx)
    # Rollouts left unfinished in a persistent store by an earlier process have no one waiting for them.
    cancel_abandoned(store, ctx.run_id)
    try:
        gateway = Gateway(store, cfg.gateway, gateway_sampling(ctx), seed=gateway_seed(ctx),
                          policies=list(ctx.config.policies))
        server = gateway.serve()
    except BaseException:
        store.close()
        raise
    api_key = gateway.token or "agl"  # the openai client insists on a key; the gateway ignores it without a token

    def llm_for(rollout_id: str, attempt_id: str, lease: str) -> LLM:
        return LLM(Gateway.base_url(server.url, rollout_id, attempt_id, lease), cfg.model, api_key,
                   dict(gateway.sampling))

    runner = LocalRunner(store, agent, llm_for, n_workers=cfg.n_workers, timeout_s=cfg.timeout_s,
                         lease_s=cfg.lease_s, max_attempts=cfg.max_attempts).start()
    return LocalRuntime(store, gateway, server, runner)


def owns_rollouts(ctx) -> bool:
    return ctx.slots.get("collect_rollouts", (None, None))[0] == NAME


@hookimpl
def on_train_start(ctx):
    if owns_rollouts(ctx):
        runtime(ctx)  # start now: a bad agent, store or port is a start-up error, not a first-step one


@hookimpl
def collect_rollouts(ctx, tasks, mode):
    rt = runtime(ctx)
    rt.gateway.upstreams.set(policy_urls(ctx))
    rt.gateway.weight_version = weight_version(ctx, mode)
    result = rt.runner.run(tasks, **collect_options(ctx, mode))
    if mode == "train":
        ctx.step_metrics.update(result.metrics)
    return result.rollouts


@hookimpl
def on_train_end(ctx):
    rt = ctx.state.pop(NAME, None)
    if rt is not None:
        rt.close()


# ------------------------------------------------------------ what a step asks of whichever gateway and runners


def policy_urls(ctx) -> list[str]:
    """The policy servers' URLs from the ``policy_endpoints`` slot; PluginError when it has none."""
    urls = ctx.call("policy_endpoints")
    if not urls:
        owner = ctx.slots["policy_endpoints"][0]
        raise PluginError(f"the policy_endpoints slot (plugin {owner!r}) returned no server URL: "
                          "the agents would have no model to call")
    return urls


def weight_version(ctx, mode: str) -> int:
    """The weight version a step's spans record (unless the policy server reports its own)."""
    # The weights of step s's rollouts have had s - 1 updates; validation after step s sees s.
    return ctx.step - 1 if mode == "train" else ctx.step


def collect_options(ctx, mode: str) -> dict:
    """The step's arguments of :func:`agl_core.rollout.runner.collect`: ``rollout.n`` samples per task in training
    (1 in validation), the metadata call seeds derive from, rollout ids naming the step. Validation games are
    queued ahead: in asynchronous training the next step's games are already queued, and the trainer waits for
    the validation."""
    return {"samples": ctx.config.rollout.n if mode == "train" else 1,
            "metadata": {"mode": mode, "step": ctx.step, "run_id": ctx.run_id},
            "id_prefix": f"{mode}-{ctx.step}", "progress": ctx.config.trainer.progress, "ahead": mode == "val"}


def gateway_sampling(ctx) -> dict:
    """``rollout.sampling`` for the gateway; ``max_tokens`` defaults to ``data.max_response_length``."""
    sampling = ctx.config.rollout.sampling.model_dump()
    if sampling["max_tokens"] is None:
        sampling["max_tokens"] = ctx.config.data.max_response_length
    return sampling


def gateway_seed(ctx) -> int | None:
    """The run seed the gateway derives call seeds from (``rollout.seed_calls``), else None."""
    return ctx.config.trainer.seed if ctx.config.rollout.seed_calls else None
