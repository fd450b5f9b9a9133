"""The hook implementations of the ``torch`` plugin: every compute slot of the step, and the policy endpoint.

Rollouts are collected by the rollout plane (the local runner): its gateway
forwards the agents' model calls to :meth:`policy_endpoints`, this plugin's
OpenAI-compatible server over the actor's current weights.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.http.rules import POLICY_TOKEN_ENV, policy_token
from agl_core.lazy_import import LazyModule
from agl_core.plugins import PluginError
from agl_core.rollout.async_rollouts import SYNCS_BETWEEN_CALLS, WEIGHT_SYNC

from agl_plugin_torch.settings import LOSS_COLUMNS, NAME, TorchConfig

if TYPE_CHECKING:
    import torch

    from agl_plugin_torch import backend as torch_backend, worker_process
    from agl_plugin_torch import policies as policy_rows
    from agl_plugin_torch.backend import ActorTransform, Backend
else:  # torch and transformers: imported when a hook first runs, so importing the plugin (`agl plugins`) stays cheap
    torch_backend = LazyModule("agl_plugin_torch.backend", globals(), "torch_backend")
    worker_process = LazyModule("agl_plugin_torch.worker_process", globals())
    torch = LazyModule("torch", globals())
    policy_rows = LazyModule("agl_plugin_torch.policies", globals(), "policy_rows")

log = logging.getLogger("agl_plugin_torch")

FORWARD_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses"]
ROW_INPUTS = FORWARD_INPUTS + ["response_mask"]


TRANSFORM_KIND = "actor_transform"
DEFAULT_TRANSFORM_ORDER = 100


def actor_transforms(ctx) -> list[ActorTransform]:
    """The ``actor_transform`` components of the active plugins, bound to ``ctx``, by ``order`` then name.

    A plugin registers one with the ``register_actor_transforms`` hook:
    ``register(name, fn, order=100)``, ``fn(actor, ctx) -> actor``.
    """
    components = [ctx.components.get(TRANSFORM_KIND, name) for name in ctx.components.names(TRANSFORM_KIND)]
    components.sort(key=lambda c: (c.options.get("order", DEFAULT_TRANSFORM_ORDER), c.name))
    return [functools.partial(_apply, c, ctx) for c in components]


def _apply(component, ctx, actor):
    log.info("actor transform %r (plugin %s)", component.name, component.plugin)
    return component.obj(actor=actor, ctx=ctx)


def backend_of(ctx) -> Backend:
    """The run's backend, made on first use (``load_checkpoint`` comes before ``on_train_start``).

    The actor transforms other plugins registered are applied when it is made,
    so they never depend on the order in which plugins' hooks run.
    """
    if NAME not in ctx.state:
        config: TorchConfig = ctx.plugin_config(NAME)
        if config.starts_processes(asynchronous=bool(ctx.config.trainer.async_.max_staleness)):
            # Before this process imports transformers and makes the model: the endpoint serves ~2 s sooner.
            worker_process.start_fork_server()
        estimator = ctx.components.get("estimator", ctx.config.algorithm.estimator)
        backend = torch_backend.create(config, ctx.run_dir, ctx.config.trainer.seed,
                                       with_critic=estimator.options.get("needs_critic", False),
                                       transforms=actor_transforms(ctx))
        if ctx.config.policies:
            backend.policy_optims = policy_optimizers(ctx, backend)
        ctx.state[NAME] = backend
    return ctx.state[NAME]


class TorchBackend:
    AGL_HOOK_API = HOOK_API_VERSION

    @hookimpl
    def plugin_config_schema(self):
        return TorchConfig

    @hookimpl
    def on_train_start(self, ctx):
        backend = backend_of(ctx)
        served = policy_token(backend.config.serving.token)
        sent = policy_token(ctx.config.rollout.gateway.upstream_token)
        if served is not None and served != sent:
            raise PluginError("plugins.torch.serving.token is not the token the gateway sends its policy servers "
                              "(rollout.gateway.upstream_token): every model call would be refused with 401; set "
                              f"both to the same token, or set only ${POLICY_TOKEN_ENV}")
        if ctx.config.trainer.async_.max_staleness:
            # Asynchronous training: the engine serves a copy while the actor trains; the loop syncs it.
            backend.serve_a_copy()
            ctx.state[WEIGHT_SYNC] = backend.sync_weights
            ctx.state[SYNCS_BETWEEN_CALLS] = True  # under the engine's lock, which a generation batch holds
            if backend.config.updates_in_a_process(asynchronous=True):
                backend.train_in_a_process()
        backend.start_serving(ctx.config.rollout.model)
        ctx.tokenizer = backend.tokenizer  # for plugins that show text (the samples plugin)
        n_params = sum(p.numel() for p in backend.actor.parameters())
        log.info("policy %s (%.2fM parameters, %s) served at %s", backend.source, n_params / 1e6,
                 backend.actor.dtype, backend.url)

    @hookimpl
    def on_step_start(self, ctx, step):
        backend = backend_of(ctx)
        backend.busy_at_step_start = backend.generated_cpu_s()
        backend.generated_at_step_start = backend.generated()
        if backend.actor.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(backend.actor.device)

    @hookimpl
    def on_train_end(self, ctx):
        backend = ctx.state.get(NAME)
        if backend is not None:
            backend.stop_serving()

    @hookimpl
    def policy_endpoints(self, ctx):
        return [backend_of(ctx).url]

    @hookimpl
    def compute_old_logprob(self, ctx, batch):
        backend = backend_of(ctx)
        log_probs, entropy = backend.run("old_logprobs", columns(backend, batch, FORWARD_INPUTS),
                                         row_adapters(backend, batch))
        batch["old_log_probs"], batch["entropys"] = log_probs, entropy
        if "policy" in batch:  # the loop reports the batch's entropy and drops the column before the update
            ctx.step_metrics.update(policy_rows.policy_entropy(batch))
        if backend.endpoint is not None:
            # The model's own share of the rollouts (timing_s/gen also holds agents, HTTP, gateway, store).
            ctx.step_metrics["perf/gen_engine_cpu_s"] = backend.generated_cpu_s() - backend.busy_at_step_start
            (tokens, wall_s), (tokens_0, wall_0) = backend.generated(), backend.generated_at_step_start
            ctx.step_metrics["perf/gen_engine_tokens"] = float(tokens - tokens_0)
            ctx.step_metrics["perf/gen_engine_wall_s"] = wall_s - wall_0
        if "rollout_log_probs" in batch:
            ctx.step_metrics.update(rollout_logprob_diff(log_probs, batch["rollout_log_probs"],
                                                         batch["response_mask"]))
        return batch

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        backend = backend_of(ctx)
        batch["ref_log_prob"] = backend.run("ref_logprobs", columns(backend, batch, FORWARD_INPUTS))
        return batch

    @hookimpl
    def compute_values(self, ctx, batch):
        backend = backend_of(ctx)
        batch["values"] = backend.run("values", columns(backend, batch, FORWARD_INPUTS))
        return batch

    @hookimpl
    def update_actor(self, ctx, batch):
        backend, algorithm = backend_of(ctx), ctx.config.algorithm
        policy_loss = ctx.components.get("policy_loss", algorithm.policy_loss.name).obj
        keys = ROW_INPUTS + ["old_log_probs", "advantages"] + (["ref_log_prob"] if algorithm.policy_loss.use_kl_loss
                                                                else [])
        keys += [key for key in LOSS_COLUMNS if key in batch]
        if backend.policy_optims is not None:
            metrics = {}
            for policy in dict.fromkeys(batch["policy"]):
                metrics.update(policy_rows.policy_data_metrics(batch[policy_rows.rows_of(batch["policy"], policy)],
                                                               policy))
            metrics.update(backend.run("update_policies", columns(backend, batch, keys), batch["policy"], algorithm,
                                       policy_loss))
        else:
            metrics = backend.run("update_actor", columns(backend, batch, keys), algorithm, policy_loss)
        backend.set_weight_version(ctx.step)  # the endpoint now serves this step's weights
        if backend.actor.device.type == "cuda":  # verl's names: the step's peak, generation included
            metrics["perf/max_memory_allocated_gb"] = torch.cuda.max_memory_allocated(backend.actor.device) / 2**30
            metrics["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved(backend.actor.device) / 2**30
        return metrics

    @hookimpl
    def update_critic(self, ctx, batch):
        backend = backend_of(ctx)
        return backend.run("update_critic", columns(backend, batch, ROW_INPUTS + ["values", "returns"]),
                           ctx.config.algorithm)

    @hookimpl
    def save_checkpoint(self, ctx, path):
        backend = backend_of(ctx)
        with backend.lock:
            backend.save(Path(path))

    @hookimpl
    def load_checkpoint(self, ctx, path):
        backend_of(ctx).load(Path(path))

    @hookimpl
    def export_model(self, path, out):
        """A fully fine-tuned actor is a plain Hugging Face model: its directory is copied (merged or not)."""
        exported = torch_backend.export_actor(Path(path), Path(out))
        return None if exported is None else str(exported)


def policy_optimizers(ctx, backend: Backend):
    """One optimizer per policy that trains (agl_core.policies), over its adapter; a clear error without adapters."""
    from agl_core.policies import training_policies

    if policy_rows.policy_adapters(backend.actor) is None:
        raise PluginError("the recipe has a policies section but no actor transform put the policies' adapters on "
                          "the actor: enable the lora plugin (plugins: [torch, lora])")
    if ctx.config.trainer.async_.max_staleness:
        raise PluginError("several policies (the policies section) train synchronously on the torch backend: "
                          "set trainer.async.max_staleness=0")
    trains = training_policies(ctx.config.policies, ctx.config.trainer.agent_match)
    return policy_rows.PolicyOptimizers(backend.actor, {name: ctx.config.policies[name].lr for name in trains},
                                        backend.config.actor)


def row_adapters(backend: Backend, batch):
    """The adapter of each row's policy (the ``policy`` column), or None for an actor of one policy."""
    if "policy" not in batch or policy_rows.policy_adapters(backend.actor) is None:
        return None
    return policy_rows.adapters_of_rows(backend.actor, batch["policy"])


def columns(backend: Backend, batch, keys: list[str]):
    """The ``keys`` columns of ``batch`` on the actor's device: what a training method needs, and all it is sent."""
    return torch_backend.on_device(batch, keys, backend.actor.device)


def rollout_logprob_diff(log_probs, rollout_log_probs, response_mask) -> dict[str, float]:
    """``training/rollout_logprob_diff/{mean,max}``: |trainer - server| log-prob over the model's tokens."""
    diff = (log_probs - rollout_log_probs).abs()[response_mask.bool()]
    if diff.numel() == 0:
        return {}
    return {"training/rollout_logprob_diff/mean": diff.mean().item(),
            "training/rollout_logprob_diff/max": diff.max().item()}


plugin = TorchBackend()
