"""The hook contract of agl_core: every hook a plugin may implement.

A plugin is a module or object with functions named after these hooks and
marked with ``@agl_core.hookimpl``. The trainer loop (``agl_core/loop.py``)
calls them in the order of the reference trainer's step. Each hook has exactly
one *call kind*, written in its docstring and enforced by the plugin manager,
never left to registration order:

slot
    Exactly one active implementation is called. When several active plugins
    implement it, the recipe chooses with ``plugins.slots.<hook>: <plugin>``;
    a plugin of a third-party distribution takes precedence over a built-in
    one. No implementation when one is needed, or two third-party candidates
    and no choice, is an error at start-up that lists the candidates.
pipeline
    Every active implementation runs, in an order the recipe may state with
    ``plugins.order.<hook>: [a, b]`` (otherwise by the plugin's declared
    ``AGL_ORDER`` number, then name). Each takes the batch and returns the
    batch. The order is printed at start-up.
broadcast
    Every active implementation runs; results are collected per plugin.
    Implementations marked ``tryfirst`` run first, ``trylast`` last, the
    others in registration order (the plugins' names).

Wrappers. Calls go through pluggy's own caller, and each call the core makes
reaches exactly one implementation: the slot's, one stage of a pipeline, one
plugin's of a broadcast. Every active wrapper of the hook
(``@hookimpl(wrapper=True)``, or the old ``hookwrapper=True``) wraps each
such call; its ``result = yield`` is that implementation's return value
(hooks are ``firstresult`` specs), which the wrapper may replace by returning
another. So a timing or tracing plugin sees the slot's call, every stage and
every plugin's share of a broadcast. ``tryfirst``/``trylast`` order pipeline
stages (before ``AGL_ORDER``) and broadcast calls, and wrappers among
themselves; on a slot's implementation they are refused at load (the recipe
chooses the slot's plugin). ``AGL_TRACE_HOOKS=1`` logs every call.

What each hook returns is checked: a stage returning ``None``, an
``advantage`` without ``advantages`` of the responses' shape, … stop the run
with an error naming the plugin, the hook and what was expected; a wrapper
that replaced a good result with a bad one is named instead of the plugin.

Every hook is synchronous: an ``async def`` implementation is refused at load.
Arguments are passed by keyword; an implementation may accept any subset of a
hook's arguments, never one it does not declare.

``ctx`` is the :class:`agl_core.context.TrainContext` of the run: the validated
recipe, the run directory, the step counters and the components registered by
the active plugins. The hooks below name it by what it offers a hook
(:class:`HookContext`): the context is built from the plugin set that this
contract is loaded into, so the contract names no module above it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import pluggy

if TYPE_CHECKING:
    from pydantic import BaseModel

    from agl_core.data import Batch, Rollout, Task

PROJECT = "agl"
HOOK_API_VERSION = "1.3"
"""Version of this contract, the string ``"MAJOR.MINOR"``. A plugin declares the
version it was written against as ``AGL_HOOK_API``; the major numbers must match
and the plugin's minor number may not be newer than the core's. 1.1 added
``register_actor_transforms`` and ``export_model``; 1.2 added the ``settings``
argument of the ``register_*`` hooks; 1.3 added the ``ctx`` argument of
estimators and the per-call columns of the aggregators' rows (``turn_ids``,
``call_turns``, ``call_rewards``, ``call_reward_sources``, ``call_state_keys``, ``call_state_ids``)."""

hookspec = pluggy.HookspecMarker(PROJECT)

SLOT, PIPELINE, BROADCAST = "slot", "pipeline", "broadcast"


def _kind(kind: str) -> Callable[[Callable], Callable]:
    def mark(fn: Callable) -> Callable:
        fn.agl_kind = kind
        # Every call the core makes reaches one implementation (plugins.PluginSet.call), so a
        # wrapper's ``yield`` gives that implementation's own return value, not a list of one.
        return hookspec(firstresult=True)(fn)

    return mark


slot, pipeline, broadcast = _kind(SLOT), _kind(PIPELINE), _kind(BROADCAST)


class HookContext(Protocol):
    """What a hook reads of ``ctx``: the run's :class:`agl_core.context.TrainContext`, which documents each field.

    ``config`` is the validated recipe (:class:`agl_core.config.Recipe`),
    ``plugins`` the run's :class:`agl_core.plugins.PluginSet`, ``components``
    its :class:`agl_core.components.Components`.
    """

    config: Any
    plugins: Any
    components: Any
    run_dir: Path
    run_id: str | None
    step: int
    epoch: int
    world_size: int
    tokenizer: Any
    step_metrics: dict[str, float]
    state: dict[str, Any]
    slots: dict[str, tuple[str, Callable]]

    @property
    def purge_step(self) -> int: ...

    def plugin_config(self, name: str) -> BaseModel: ...

    def call(self, hook: str, **kwargs: Any) -> Any: ...


# --------------------------------------------------------------------------
# Plugin set-up
# --------------------------------------------------------------------------


@broadcast
def plugin_config_schema() -> type[BaseModel] | None:
    """Return the pydantic model of this plugin's recipe section.

    Kind: broadcast, asked of each plugin separately at start-up.
    The section lives at ``plugins.<plugin name>`` in the recipe. The core
    validates it with this model (unknown keys are errors; a missing required
    key is an error naming ``plugins.<name>.<key>``). Hooks read the result
    with ``ctx.plugin_config("<plugin name>")``; ``register_*`` hooks get it
    as their ``settings`` argument. Return ``None`` or do not
    implement the hook for a plugin without settings.
    """


@broadcast
def register_estimators(register: Callable[..., None], settings: BaseModel | None) -> None:
    """Register advantage estimators by name.

    Kind: broadcast, called once when the plugin set is built.
    Call ``register(name, fn, needs_critic=False)`` for each estimator.
    ``fn(batch, config) -> (advantages, returns)`` receives the step's
    :class:`~agl_core.data.Batch` and the validated ``algorithm`` section and
    returns two ``(rows, response_length)`` tensors; anything else stops the
    run with an error naming the estimator and its plugin. A name registered
    by two plugins is an error naming both.

    An estimator that declares a ``ctx`` parameter (``fn(batch, config,
    ctx=None)``, hook API 1.3) is also given the run's context: it may report
    metrics in ``ctx.step_metrics`` and read the recipe. Outside a run (verl's
    workers, a benchmark) it is called without one, so give ``ctx`` a default.
    Either way an estimator reads the step's data from the batch alone, never
    from state kept between steps: a resumed run computes what an
    uninterrupted one does. ``batch.meta["aggregator"]`` names the aggregator
    that made the rows (``transition``, ``trajectory``). Step-level
    estimators read the per-call columns (``turn_ids``, ``call_turns``,
    ``call_rewards``, ``call_reward_sources``, ``call_state_keys``,
    ``call_state_ids``: :data:`agl_core.data.CALL_COLUMNS`, docs/hooks.md).

    ``settings`` (every ``register_*`` hook has it) is this plugin's validated
    recipe section (the model of its ``plugin_config_schema``), or ``None``
    when the plugin takes no settings or the plugin set was loaded without a
    recipe (``agl plugins``, ``agl doctor`` alone). An estimator, loss or
    aggregator that needs its plugin's settings binds them here, e.g.
    ``register("drgrpo", functools.partial(drgrpo, clip=settings.clip))``.
    """


@broadcast
def register_policy_losses(register: Callable[..., None], settings: BaseModel | None) -> None:
    """Register policy losses by name (``algorithm.policy_loss.name``).

    Kind: broadcast, called once when the plugin set is built.
    Call ``register(name, fn)``; ``fn(old_log_prob, log_prob, advantages,
    response_mask, config) -> (loss, metrics)`` where ``config`` is the
    ``algorithm.policy_loss`` section. Backends look losses up with
    ``ctx.components.get("policy_loss", name)``.
    """


@broadcast
def register_aggregators(register: Callable[..., None], settings: BaseModel | None) -> None:
    """Register trace aggregators (rollouts → batch) by name.

    Kind: broadcast, called once when the plugin set is built.
    Call ``register(name, factory)``; the aggregator plugin picks the one the
    recipe names.
    """


@broadcast
def register_stores(register: Callable[..., None], settings: BaseModel | None) -> None:
    """Register rollout store adapters by name (``rollout.store``).

    Kind: broadcast, called once when the plugin set is built.
    Call ``register(name, factory)``; ``factory(ctx)`` returns an object of the
    core ``Store`` protocol.
    """


@broadcast
def register_actor_transforms(register: Callable[..., None], settings: BaseModel | None) -> None:
    """Register transforms of the actor model (adapters, quantization, …) by name.

    Kind: broadcast, called once when the plugin set is built.
    Call ``register(name, fn, order=100)``; ``fn(actor, ctx) -> actor``
    receives the actor as a backend that builds it in its own process (the
    embedded backend, agl-plugin-torch) has just made or loaded it from the
    initial weights, and returns the model to train: the same object changed
    in place, or another one. The backend applies every registered transform,
    by ascending ``order`` then name, before it loads a checkpoint into the
    actor and before it makes the actor's optimizer, which is built over the
    parameters that still require a gradient. So a transform never depends on
    the order of other hooks, and a resumed run transforms its actor exactly as
    the run that saved the checkpoint did. A backend that builds its actor
    elsewhere (verl's workers) does not call them; a plugin that needs one
    there checks it in ``on_train_start``.
    """


# --------------------------------------------------------------------------
# Training lifecycle
# --------------------------------------------------------------------------


@broadcast
def on_train_start(ctx: HookContext) -> None:
    """The run begins: build models, start servers, open files.

    Kind: broadcast, called once before validation and the first step, after a
    checkpoint (if any) was loaded. A backend that shards data over workers
    sets ``ctx.world_size`` here (padding and balancing use it).

    The run directory is this trainer's alone for the whole run (no other
    trainer runs on it), and ``ctx.step`` is the step the run resumes from: 0
    for a fresh start, the checkpoint's step after a resume. The run logs
    every step from ``ctx.purge_step`` on again (after the checkpoint's; all
    of them, step 0 included, from a fresh start), so a plugin that keeps
    per-step records of its own (a CSV, an event file, a remote run) drops its
    records of ``ctx.purge_step`` and later steps here: each step is then held
    exactly once, also after a process was killed past its last checkpoint.
    """


@broadcast
def on_train_end(ctx: HookContext) -> None:
    """The run ends (also after an error): flush, stop servers, release memory.

    Kind: broadcast, called once; every implementation runs even when an
    earlier one raised.
    """


@broadcast
def on_step_start(ctx: HookContext, step: int) -> None:
    """A training step begins. ``step`` counts from 1.

    Kind: broadcast. A backend wakes its rollout servers here if it sleeps them.
    """


@broadcast
def on_step_end(ctx: HookContext, step: int, metrics: dict[str, float]) -> None:
    """A training step finished; ``metrics`` is what will be logged for it.

    Kind: broadcast, called after validation of the step, before
    ``log_metrics`` and before the step's checkpoint is written (a checkpoint
    of step s comes after step s was logged). Implementations may add keys to
    ``metrics``.
    """


# --------------------------------------------------------------------------
# The step, in the order the loop calls it
# --------------------------------------------------------------------------


@slot
def policy_endpoints(ctx: HookContext) -> list[str]:
    """Return the base URLs of the OpenAI-compatible servers of the current policy.

    Kind: slot. Called by the rollout plane before it runs agents; a backend
    returns one URL per serving replica (``http://127.0.0.1:8000/v1``).
    """


@slot
def collect_rollouts(ctx: HookContext, tasks: list[Task], mode: str) -> list[Rollout]:
    """Run the agents on ``tasks`` against the current policy and return the finished rollouts.

    Kind: slot. ``mode`` is ``"train"`` (``rollout.n`` samples per task, for
    group estimators) or ``"val"``. Returns every rollout that ended,
    including failed and timed-out ones (their ``status`` says so); it must
    not hang on a rollout that never finishes. Counts such as
    ``rollout/n_failed`` may be put in ``ctx.step_metrics``.
    """


@pipeline
def post_process_batch(ctx: HookContext, batch: Batch) -> Batch:
    """Turn rollouts into training rows, then filter them.

    Kind: pipeline. The first batch has no rows and carries the step's
    rollouts in ``batch.meta["rollouts"]``; the first stage (a trace
    aggregator) returns a batch with the tensors ``input_ids``,
    ``attention_mask``, ``position_ids``, ``prompts``, ``responses``,
    ``response_mask``, ``token_level_scores``, ``is_drop_mask`` and the
    non-tensor columns ``uid`` (the group of the row), ``rollout_id`` and
    ``turn_index``; optionally ``prompt_length`` and ``response_length``
    (the real tokens on either side, as the attention mask marks them: the
    loop's metrics then read these instead of the mask), and the per-call
    columns step-level estimators read (``turn_ids`` and the ``call_*``
    columns of :data:`agl_core.data.CALL_COLUMNS`), which agl-plugin-traces'
    aggregators write; its batch is a new one, whose ``meta`` no longer holds
    ``"rollouts"``. Later stages filter
    rows (zero-variance groups, rows per rollout, …) and return the batch; a
    stage that changes ``attention_mask`` updates or drops the length
    columns. Stages may report metrics in ``ctx.step_metrics``.
    """


@slot
def compute_old_logprob(ctx: HookContext, batch: Batch) -> Batch:
    """Return ``batch`` with ``old_log_probs`` (and ``entropys``) of the responses under the current actor.

    Kind: slot. The batch is padded to a multiple of ``ctx.world_size``.
    Both tensors have the shape of ``responses``. The loop turns ``entropys``
    into the ``actor/entropy`` metric and drops it.
    """


@slot
def compute_ref_logprob(ctx: HookContext, batch: Batch) -> Batch:
    """Return ``batch`` with ``ref_log_prob``: log-probs under the reference policy.

    Kind: slot. Called only when a KL term is used (``algorithm.use_kl_in_reward``
    or ``algorithm.policy_loss.use_kl_loss``). A separate frozen model, or the
    actor with its LoRA adapter disabled.
    """


@slot
def compute_values(ctx: HookContext, batch: Batch) -> Batch:
    """Return ``batch`` with ``values`` from the critic, shape of ``responses``.

    Kind: slot. Called only when the estimator needs a critic (gae).
    """


@slot
def advantage(ctx: HookContext, batch: Batch) -> Batch:
    """Return ``batch`` with ``advantages`` and ``returns`` (shape of ``responses``).

    Kind: slot. Called on the unpadded batch after ``token_level_rewards`` was
    set (the scores, minus the KL penalty when it is in the reward). The
    built-in implementation dispatches to the estimator named by
    ``algorithm.estimator`` among the registered ones.
    """


@slot
def update_critic(ctx: HookContext, batch: Batch) -> dict[str, float]:
    """Update the critic on ``batch``; return its metrics (``critic/vf_loss``, …).

    Kind: slot. Called only when the estimator needs a critic.
    """


@slot
def update_actor(ctx: HookContext, batch: Batch) -> dict[str, float]:
    """Update the actor on ``batch``; return its metrics (``actor/pg_loss``, …).

    Kind: slot. Called once ``trainer.critic_warmup`` steps have passed. The
    batch size is a multiple of ``algorithm.ppo_mini_batch_size`` and its
    rows are balanced over ``ctx.world_size``.
    """


@slot
def validate(ctx: HookContext, tasks: list[Task]) -> dict[str, float]:
    """Evaluate the current policy on the validation ``tasks``; return ``val/…`` metrics.

    Kind: slot. Called before training (``trainer.val_before_train``) and every
    ``trainer.test_freq`` steps. The built-in implementation collects
    rollouts in ``"val"`` mode and reports their reward statistics.
    """


@broadcast
def save_checkpoint(ctx: HookContext, path: str) -> None:
    """Write this plugin's state (weights, optimizer, …) under the directory ``path``.

    Kind: broadcast. Called every ``trainer.save_freq`` steps and at the end.
    Each plugin writes its own files; the core writes its own state
    (step, data position, RNG) and the active plugin set.
    """


@broadcast
def load_checkpoint(ctx: HookContext, path: str) -> None:
    """Restore this plugin's state from the checkpoint directory ``path``.

    Kind: broadcast. Called once before ``on_train_start`` when resuming, with
    ``ctx.step`` already the checkpoint's step. The checkpoint is of this run
    (``resume=auto``) or one the recipe names (``trainer.resume=PATH``, maybe
    of another run).
    """


@broadcast
def log_metrics(ctx: HookContext, metrics: dict[str, Any], step: int) -> None:
    """Record the ``metrics`` of ``step`` (console, JSONL, TensorBoard, …).

    Kind: broadcast. Called once per step and once after the validation
    before training (step 0), before the step's checkpoint is written. After a
    resume the run logs the steps after the checkpoint's again: a plugin that
    writes per-step logs drops those steps at ``on_train_start`` (see there),
    so every step is held once.
    """


# --------------------------------------------------------------------------
# After training
# --------------------------------------------------------------------------


@broadcast
def export_model(ctx: HookContext, path: str, out: str, merged: bool, policy: str | None) -> str | None:
    """Write the policy of the checkpoint directory ``path`` as a model others can load; return where.

    Kind: broadcast, called by ``agl export RUN_DIR`` (never during training)
    on the plugins the run's recipe (``RUN_DIR/config.yaml``) activates.
    ``ctx`` is a context of that recipe and run directory with no step
    state and no resolved slots; ``path`` is the checkpoint (the run's
    latest one unless the command names one); ``out`` is a directory that
    does not exist yet or is empty. With ``merged`` the result must load on
    its own (a Hugging Face model directory: ``AutoModelForCausalLM.
    from_pretrained(out)``), e.g. an adapter folded into its base weights;
    without it a plugin may write its own format (the adapter alone).

    Each plugin recognises the checkpoints it can export from their files and
    returns ``out`` after writing them; for any other checkpoint it writes
    nothing and returns ``None``. Exactly one plugin must export: none is an
    error naming the run directory and the plugins asked, several an error
    naming them. ``policy`` (``agl export --policy NAME``) names one policy of
    a run with a ``policies`` section (checked against the recipe before the
    call; ``None`` otherwise): an exporter of several policies writes that
    one, or each in ``out/<name>`` when it is None and ``merged`` is false.
    """
