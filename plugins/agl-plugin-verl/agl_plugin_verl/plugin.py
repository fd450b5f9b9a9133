"""The hook implementations of the ``verl`` plugin: verl's worker groups fill the compute slots of the loop.

Start-up (``on_train_start``) checks the verl version, builds verl's config
(``config.py``), installs agl_core's components into verl's registries,
starts the worker groups (``workers.py``) and the rollout servers
(``rollout.py``), restores a checkpoint, and sets ``ctx.world_size`` to the
actor's data-parallel size. Each compute slot is one call of ``calls.py``.
The run's objects live in ``ctx.state["verl"]``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import ConfigError
from agl_core.lazy_import import LazyModule
from agl_core.plugins import PluginError

from agl_plugin_verl.compat import is_verl_0_7, verl_version
from agl_plugin_verl.config import LORA, VerlSection, build_verl_config

if TYPE_CHECKING:
    import torch

    from agl_plugin_verl import calls
else:  # imports torch: loaded when a compute slot first runs, so importing the plugin (`agl plugins`) stays cheap
    calls = LazyModule("agl_plugin_verl.calls", globals())

AGL_HOOK_API = HOOK_API_VERSION
NAME = "verl"
REF_SLOT = "compute_ref_logprob"
CHECKPOINT_DIR = "verl"
"""Sub-directory of an agl_core checkpoint where verl's checkpoint managers write (``actor/``, ``critic/``)."""

log = logging.getLogger("agl_plugin_verl")


@dataclass
class VerlRun:
    """What the plugin holds during a run."""

    config: Any                 # verl's resolved DictConfig
    version: Any                # the installed verl's packaging Version
    groups: Any                 # workers.WorkerGroups
    servers: Any | None = None  # rollout.RolloutServers; None on CPU workers (no rollout engine)
    weights_version: int = 0    # actor updates so far: rollout servers resync when it moves


@dataclass
class VerlState:
    """``ctx.state["verl"]``: a checkpoint to restore (``load_checkpoint`` runs before the workers exist), the run,
    and whether this plugin started Ray (then it stops it, also when start-up failed half-way)."""

    resume_from: Path | None = None
    run: VerlRun | None = None
    started_ray: bool = False


def state_of(ctx) -> VerlState:
    return ctx.state.setdefault(NAME, VerlState())


def run_of(ctx) -> VerlRun:
    run = state_of(ctx).run
    if run is None:
        raise PluginError("the verl workers are not started: on_train_start of plugin 'verl' did not run")
    return run


def _owns(ctx, hook: str) -> bool:
    return ctx.slots.get(hook, (None, None))[0] == NAME


def check_lora_reference(ctx) -> None:
    """Refuse the reference slot for verl itself while plugin ``lora`` is active: verl can give no separate reference.

    With LoRA (``actor_rollout_ref.model.lora_rank > 0``, translated from
    ``plugins.lora``) verl takes the reference from the actor with its adapter
    disabled and builds no reference model, whatever else the recipe says, so
    a recipe that names ``verl`` for the slot asks for something it cannot
    have. Run before the workers are built; agl-plugin-lora calls it too, so
    the refusal does not depend on which plugin's ``on_train_start`` runs first.
    """
    if LORA in ctx.config.plugin_config and _owns(ctx, REF_SLOT):
        raise PluginError(
            f"plugins.slots.{REF_SLOT}={NAME} asks for a separate reference model, but LoRA is active "
            f"(plugin {LORA!r}) and verl takes the reference from the actor with its adapter disabled whenever "
            f"actor_rollout_ref.model.lora_rank > 0: a separate reference cannot be had with LoRA on verl; "
            f"set plugins.slots.{REF_SLOT}={LORA}, or drop plugin {LORA!r} to fine-tune in full against a "
            f"reference model")


def check_policies(ctx) -> None:
    """Refuse a ``policies`` section verl cannot serve, before Ray or any worker starts.

    verl holds one LoRA adapter: its engine wraps the actor with one peft
    adapter and its vLLM rollout is built with ``max_loras: 1``, applying that
    adapter to every request of its own generate path. So more than one
    trainable adapter is refused naming that limit, and so is one trainable
    adapter beside frozen or base roles: verl would serve their calls with the
    trained adapter, not apart. One policy is a plain LoRA run: ``plugins.lora``
    without a ``policies`` section (whose adapter keys verl's translation would not read).
    """
    policies = ctx.config.policies
    if not policies:
        return
    trains = [name for name, spec in policies.items() if spec.trains]
    if len(trains) > 1:
        raise PluginError(f"the policies section has {len(trains)} trainable adapters ({', '.join(trains)}), but "
                          f"verl trains and serves one LoRA adapter (its actor carries one peft adapter and its "
                          f"vLLM rollout runs with max_loras=1): train several policies on the embedded backend "
                          f"(plugins: [torch, lora]), or one policy here with plugins.lora")
    raise PluginError(f"the policies section has {len(policies)} {'policies' if len(policies) > 1 else 'policy'} "
                      f"({', '.join(policies)}), but verl serves one LoRA adapter to every call (max_loras=1): "
                      f"frozen and base roles cannot be served apart from a trained one, and one policy is "
                      f"plugins.lora's adapter; use the embedded backend (plugins: [torch, lora]) for several "
                      f"policies, or drop the policies section for one LoRA policy")


def reference_logprobs(ctx, batch) -> torch.Tensor:
    """Reference log-probs of ``batch`` from verl's workers, as verl's ``RayPPOTrainer._compute_ref_log_prob``.

    With LoRA on the actor (verl's ``ref_in_actor``) the actor worker group
    computes them with its adapter disabled (``no_lora_adapter``), and verl
    builds no reference model; otherwise the reference worker group does. The
    reference slot of this plugin and of agl-plugin-lora on this backend both
    call this.
    """
    run = run_of(ctx)
    groups = run.groups
    group = groups.actor if groups.layout.ref_in_actor else groups.ref
    if group is None:
        raise PluginError(f"verl built no reference model: plugin {NAME!r} did not fill the slot {REF_SLOT!r} "
                          f"when its workers started, and the actor carries no LoRA adapter")
    return calls.compute_ref_log_prob(group, batch, run.config.actor_rollout_ref.rollout.temperature,
                                      groups.layout.ref_in_actor)


def _check_batch_sizes(recipe, cfg) -> int:
    """The data-parallel size; a PPO mini-batch that does not split evenly over it is a start-up error."""
    world = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if recipe.algorithm.ppo_mini_batch_size % world:
        raise ConfigError(
            f"algorithm.ppo_mini_batch_size={recipe.algorithm.ppo_mini_batch_size} rows do not split over the "
            f"{world} verl worker processes (plugins.verl trainer.n_gpus_per_node={cfg.trainer.n_gpus_per_node} "
            f"x trainer.nnodes={cfg.trainer.nnodes}); make it a multiple of {world}")
    return world


def _start_ray(cfg) -> bool:
    """Start a local Ray as verl's ``run_ppo`` does, unless one is running; True when this call started it."""
    import ray
    from omegaconf import OmegaConf

    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if ray.is_initialized():
        return False
    kwargs = OmegaConf.to_container(cfg.ray_kwargs.get("ray_init", {}), resolve=True) or {}
    # verl 0.9 reads the config (Megatron and profiler environment variables); 0.7 and 0.8 take no argument.
    env = get_ppo_ray_runtime_env(cfg) if inspect.signature(get_ppo_ray_runtime_env).parameters \
        else get_ppo_ray_runtime_env()
    kwargs["runtime_env"] = OmegaConf.to_container(OmegaConf.merge(env, kwargs.get("runtime_env") or {}),
                                                   resolve=True)
    ray.init(**kwargs)
    return True


# ----------------------------------------------------------------------------- set-up


@hookimpl
def plugin_config_schema():
    return VerlSection


@hookimpl
def register_estimators(register):
    verl_version()  # refuse an unsupported verl before importing it
    from agl_plugin_verl.bridge import verl_estimators

    for name, fn in verl_estimators().items():
        register(name, fn)


@hookimpl
def register_policy_losses(register):
    verl_version()
    from agl_plugin_verl.bridge import verl_policy_losses

    for name, fn in verl_policy_losses().items():
        register(name, fn)


def refuse_async(ctx) -> None:
    """PluginError for ``trainer.async.max_staleness >= 1``, naming what verl 0.9 lacks for it here."""
    k = ctx.config.trainer.async_.max_staleness
    if k:
        raise PluginError(
            f"trainer.async.max_staleness={k}: the verl plugin cannot train asynchronously. It drives verl's hybrid "
            f"engine, where the actor and the vLLM rollout share the same GPUs and the weights are handed over in "
            f"place, so the rollout servers cannot serve while the actor trains. verl 0.9's own asynchronous "
            f"trainers (verl.experimental.one_step_off_policy, verl.experimental.fully_async_policy) need separate "
            f"rollout and trainer resource pools and their weight-sync between them, which this plugin does not "
            f"build. Set trainer.async.max_staleness=0, or train asynchronously with the embedded backend "
            f"(agl-plugin-torch).")


def check_served_model_name(recipe, cfg) -> None:
    """ConfigError unless ``rollout.model`` is the name verl's rollout servers serve the model under (its path).

    vLLM answers only to that name: with another, every agent's call is
    refused with 404, every rollout fails and every step is skipped. CPU
    workers serve nothing, so any name passes there.
    """
    from agl_plugin_verl.workers import CPU

    served = cfg.actor_rollout_ref.model.path
    if cfg.trainer.device != CPU and recipe.rollout.model != served:
        raise ConfigError(f"rollout.model is {recipe.rollout.model!r}, but verl's rollout servers (vLLM) serve the "
                          f"model as {served!r} (plugins.verl.actor_rollout_ref.model.path) and refuse every other "
                          f"name: set rollout.model: {served}")


@hookimpl
def on_train_start(ctx):
    version = verl_version()  # before importing anything of verl, or reading the context
    refuse_async(ctx)
    from agl_plugin_verl import rollout, workers
    from agl_plugin_verl.bridge import Registrations, install

    cfg = build_verl_config(ctx.config, ctx.plugin_config(NAME))
    check_served_model_name(ctx.config, cfg)
    world = _check_batch_sizes(ctx.config, cfg)
    check_lora_reference(ctx)
    check_policies(ctx)
    registrations = Registrations.from_components(ctx.components)
    install(registrations)  # the driver's registry too: verl code run here looks names up
    state = state_of(ctx)
    state.started_ray = _start_ray(cfg)
    # A reference model only when this plugin fills the slot (with LoRA from plugin 'lora' that slot is lora's,
    # which calls reference_logprobs: the actor with its adapter disabled, no reference model).
    groups = workers.build(cfg, needs_ref=_owns(ctx, REF_SLOT),
                           needs_critic=_owns(ctx, "compute_values") or _owns(ctx, "update_critic"),
                           registrations=registrations, verl_0_7=is_verl_0_7(version))
    state.run = VerlRun(cfg, version, groups)
    if state.resume_from is not None:
        _load(state.run, state.resume_from)
    if cfg.trainer.device != workers.CPU:
        state.run.servers = rollout.start(cfg, groups.actor, groups.pool, version)
    ctx.world_size = groups.dp_size
    if groups.dp_size != world:
        log.warning("verl reports data-parallel size %d on %d processes", groups.dp_size, world)


@hookimpl
def on_train_end(ctx):
    import ray

    state = state_of(ctx)
    run, state.run = state.run, None
    if run is not None:
        try:
            if run.servers is not None:  # their actors outlive the worker groups when Ray is someone else's
                run.servers.shutdown()
        finally:
            run.groups.shutdown()
    if state.started_ray:
        state.started_ray = False
        ray.shutdown()


# ----------------------------------------------------------------------------- the step


@hookimpl
def policy_endpoints(ctx):
    run = run_of(ctx)
    if run.servers is None:
        raise PluginError("plugin 'verl' with trainer.device=cpu runs verl's workers without a rollout engine, "
                          "so it serves no policy endpoint; collect rollouts with another plugin "
                          "(plugins.slots.policy_endpoints) or run on a GPU")
    return run.servers.endpoints(run.weights_version)


def _sleep_servers(run: VerlRun) -> None:
    # Training needs the GPU memory the rollout servers hold; they wake again in policy_endpoints.
    if run.servers is not None:
        run.servers.sleep()


@hookimpl
def compute_old_logprob(ctx, batch):
    run = run_of(ctx)
    _sleep_servers(run)
    temperature = run.config.actor_rollout_ref.rollout.temperature
    batch["old_log_probs"], batch["entropys"], metrics = calls.compute_log_prob(run.groups.actor, batch, temperature)
    ctx.step_metrics.update(metrics)
    return batch


@hookimpl
def compute_ref_logprob(ctx, batch):
    batch["ref_log_prob"] = reference_logprobs(ctx, batch)
    return batch


@hookimpl
def compute_values(ctx, batch):
    batch["values"] = calls.compute_values(run_of(ctx).groups.critic, batch)
    return batch


@hookimpl
def update_critic(ctx, batch):
    run = run_of(ctx)
    return calls.update_critic(run.groups.critic, batch, run.config, ctx.config.algorithm.ppo_mini_batch_size)


@hookimpl
def update_actor(ctx, batch):
    run = run_of(ctx)
    _sleep_servers(run)
    metrics = calls.update_actor(run.groups.actor, batch, run.config, ctx.config.algorithm.ppo_mini_batch_size)
    run.weights_version += 1
    return metrics


# ----------------------------------------------------------------------------- checkpoints


def _role_dirs(path: Path) -> tuple[str, str]:
    root = Path(path) / CHECKPOINT_DIR
    return str(root / "actor"), str(root / "critic")


@hookimpl
def save_checkpoint(ctx, path):
    """verl's checkpoint managers write the actor (and critic) under ``<path>/verl/``; agl_core keeps the rest."""
    run = run_of(ctx)
    actor_dir, critic_dir = _role_dirs(path)
    # agl_core decides which checkpoints to keep: verl's own retention is off (max_ckpt_to_keep=None).
    run.groups.actor.save_checkpoint(actor_dir, None, ctx.step, None)
    if run.groups.critic is not None:
        run.groups.critic.save_checkpoint(critic_dir, None, ctx.step, None)


def _load(run: VerlRun, path: Path) -> None:
    actor_dir, critic_dir = _role_dirs(path)
    run.groups.actor.load_checkpoint(actor_dir, None, False)
    if run.groups.critic is not None:
        run.groups.critic.load_checkpoint(critic_dir, None, False)
    log.info("verl workers restored from %s", path)


@hookimpl
def load_checkpoint(ctx, path):
    """Restore the workers from ``<path>/verl/``; before ``on_train_start`` (the usual case) it is done there."""
    state = state_of(ctx)
    state.resume_from = Path(path)
    if state.run is not None:
        _load(state.run, state.resume_from)
