"""The contract suite: what the core relies on from each kind of extension, as test classes a plugin subclasses.

A plugin's test module subclasses one class per extension it provides and
names the plugin (and the component) with a fixture or two::

    from agl_core.testing.contracts import EstimatorContract, PluginContract

    class TestDrGrpo(EstimatorContract):
        @pytest.fixture
        def plugin_name(self):
            return "drgrpo"            # an installed plugin (entry point name)

        @pytest.fixture
        def estimator_name(self):
            return "dr_grpo"

    class TestEverything(PluginContract):   # every extension the plugin provides, nothing skipped silently
        @pytest.fixture
        def plugin_name(self):
            return "drgrpo"

The fixtures every class reads:

``plugin_name``
    The plugin under test, by its entry-point name (required).
``plugin_object``
    ``None`` (the default): the installed plugin of that name, enabled as
    ``-p NAME`` would. Any other object is loaded under ``plugin_name`` as a
    plugin that is not installed (a module or an object with hooks).
``plugin_overrides``
    Recipe overrides (``key=value``) the plugin needs, e.g. a required
    setting ``plugins.NAME.key=value``; default none.
``plugin_flags``
    Other installed plugins to enable beside it (``-p`` values), e.g.
    ``["instant"]`` for a backend's step; default none.

and per kind: ``estimator_name``, ``loss_name``, ``aggregator_name``,
``store_name`` (or a ``store`` fixture that returns a fresh store), and for a
backend ``backend_tasks`` (the tasks of its one step; default: prompts of
token ids, as the quick start's).

The checks are plain functions (``check_*``) that raise ``AssertionError``
naming the plugin, the component and what was expected, so the classes and
the aggregate :class:`PluginContract` share them.
"""

from __future__ import annotations

import inspect
import json
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl, hookspecs
from agl_core.components import REGISTRATION_HOOKS, Components
from agl_core.config import Recipe, load
from agl_core.context import TrainContext
from agl_core.data import Batch, Rollout, Span, Task, Triplet
from agl_core.http.recordable import MAX_SPAN_DEPTH
from agl_core.plugins import PluginSet, call
from agl_core.rollout.store import SPANS_LOST, TERMINAL, LeaseError, NewRollout, Store

ROW_TENSORS = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
               "token_level_scores", "is_drop_mask")
"""The tensors every batch with rows carries after the first ``post_process_batch`` stage."""
ROW_COLUMNS = ("uid", "rollout_id", "turn_index")
"""The non-tensor columns every batch with rows carries."""
BACKEND_SLOTS = ("collect_rollouts", "policy_endpoints", "compute_old_logprob", "compute_ref_logprob",
                 "compute_values", "update_actor", "update_critic", "validate")
"""The slots of the step a backend (or a rollout plane) fills; checked by one full step of the loop."""
LIFECYCLE_HOOKS = ("on_train_start", "on_step_start", "on_step_end", "on_train_end", "save_checkpoint",
                   "load_checkpoint")


# ----------------------------------------------------------------------------------------------- the plugin


@dataclass
class ContractEnv:
    """A validated recipe with the plugin under test active, its components and a ``TrainContext``."""

    plugin: str
    recipe: Recipe
    plugins: PluginSet
    ctx: TrainContext

    @property
    def hooks(self) -> list[str]:
        """The hooks the plugin under test implements."""
        return self.plugins.plugins[self.plugin].hooks

    def owned(self, kind: str) -> list[str]:
        """Names of the components of ``kind`` (``estimator``, ``store``, …) that the plugin registered."""
        components = self.ctx.components
        return [name for name in components.names(kind) if components.get(kind, name).plugin == self.plugin]

    def component(self, kind: str, name: str) -> Any:
        found = self.ctx.components.get(kind, name)
        assert found.plugin == self.plugin, (
            f"{kind} {name!r} is registered by plugin {found.plugin!r}, not by {self.plugin!r}")
        return found.obj

    def call_own(self, hook: str, **kwargs: Any) -> Any:
        """Call the plugin's own implementation of ``hook`` (``ctx`` is passed for you)."""
        for name, fn in self.plugins.implementations(hook):
            if name == self.plugin:
                return call(fn, {"ctx": self.ctx, **kwargs})
        raise AssertionError(f"plugin {self.plugin!r} does not implement {hook!r}")


def contract_env(run_dir: Path, plugin_name: str, plugin_object: Any = None, overrides: list[str] = (),
                 flags: list[str] = (), others: list[tuple[str, Any]] = ()) -> ContractEnv:
    """Load the recipe ``overrides`` with the plugin active, as ``agl train -p NAME`` would.

    ``others`` are more ``(name, object)`` plugins beside it (the stand-in a wrapper check wraps).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"trainer.run_dir={run_dir}", "trainer.progress=false", *overrides]
    extra = ([(plugin_name, plugin_object)] if plugin_object is not None else []) + list(others)
    enable = [plugin_name] if plugin_object is None else []
    recipe, plugins = load(None, overrides, [*enable, *flags], extra_plugins=extra)
    plugin = plugins.plugins[plugin_name]
    assert plugin.status == "active", f"plugin {plugin.label} is {plugin.status}: {plugin.reason}"
    ctx = TrainContext(recipe, plugins, Components.collect(plugins), run_dir)
    return ContractEnv(plugin_name, recipe, plugins, ctx)


def overrides_of(section: dict[str, Any], prefix: str) -> list[str]:
    """``key=value`` recipe overrides that set the nested ``section`` under ``prefix`` (e.g. ``plugins.NAME``).

    Values are written as JSON, which the recipe reader parses as YAML: lists
    and strings with commas survive.
    """
    out = []
    for key, value in section.items():
        if isinstance(value, dict):
            out += overrides_of(value, f"{prefix}.{key}")
        else:
            out.append(f"{prefix}.{key}={json.dumps(value)}")
    return out


# ------------------------------------------------------------------------------------------ example data


def example_batch(rows: int = 8, group_size: int = 4, prompt_length: int = 4, response_length: int = 6,
                  seed: int = 0, with_baselines: bool = False) -> Batch:
    """Rows as the loop hands them to an estimator: the aggregator's columns plus the computed ones.

    Responses have 1..``response_length`` real tokens (the first row is full),
    the reward sits on the last real token, groups of ``group_size`` rows
    share a ``uid`` and have rewards that differ. ``old_log_probs``,
    ``ref_log_prob``, ``values`` and ``token_level_rewards`` are set, and
    ``reward_baselines`` (the greedy responses' rewards, which only remax
    reads) with ``with_baselines``.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, response_length + 1, (rows,), generator=g)
    if rows:
        lengths[0] = response_length
    response_mask = (torch.arange(response_length) < lengths[:, None]).long()
    prompts = torch.randint(1, 50, (rows, prompt_length), generator=g)
    responses = torch.randint(1, 50, (rows, response_length), generator=g) * response_mask
    scores = torch.zeros(rows, response_length)
    rewards = torch.rand(rows, generator=g)
    scores[torch.arange(rows), (lengths - 1).clamp(min=0)] = rewards
    attention_mask = torch.cat([torch.ones(rows, prompt_length, dtype=torch.long), response_mask], dim=1)
    mask = response_mask.float()
    baselines = torch.rand(rows, generator=g)
    batch = Batch(
        tensors={
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "input_ids": torch.cat([prompts, responses], dim=1), "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "token_level_scores": scores, "token_level_rewards": scores.clone(),
            "is_drop_mask": torch.zeros(rows, dtype=torch.bool),
            "old_log_probs": -torch.rand(rows, response_length, generator=g) * mask,
            "ref_log_prob": -torch.rand(rows, response_length, generator=g) * mask,
            "values": torch.randn(rows, response_length, generator=g) * mask,
        },
        non_tensors={
            "uid": np.array([f"task-{i // group_size}" for i in range(rows)], dtype=object),
            "rollout_id": np.array([f"rollout-{i}" for i in range(rows)], dtype=object),
            "turn_index": np.zeros(rows, dtype=np.int64),
        },
    )
    if with_baselines:
        batch["reward_baselines"] = baselines
    return batch


def example_rollouts(tasks: int = 2, samples: int = 2) -> list[Rollout]:
    """Finished rollouts as a rollout plane returns them: two model calls each (spans and triplets), a reward.

    One more rollout failed and has nothing to train on.
    """
    rollouts = []
    for t in range(tasks):
        for s in range(samples):
            rollout_id, reward = f"rollout-{t}-{s}", float((t + s) % 2)
            spans, triplets, prompt = [], [], [1, 2, 3 + t]
            for turn in range(2):
                response = [5 + turn, 6 + s]
                spans.append(Span(rollout_id=rollout_id, attempt_id="1", sequence_id=turn, kind="llm_call",
                                  prompt_token_ids=prompt, response_token_ids=response,
                                  response_logprobs=[-0.5, -0.25]))
                triplets.append(Triplet(prompt_ids=prompt, response_ids=response, response_logprobs=[-0.5, -0.25],
                                        rollout_id=rollout_id, turn_index=turn))
                prompt = prompt + response + [9]
            spans.append(Span(rollout_id=rollout_id, attempt_id="1", sequence_id=2, kind="reward", reward=reward))
            rollouts.append(Rollout(rollout_id=rollout_id, task_id=f"task-{t}", sample_index=s, status="succeeded",
                                    final_reward=reward, spans=spans, triplets=triplets, attempt_id="1", attempts=1))
    rollouts.append(Rollout(rollout_id="rollout-failed", task_id="task-0", sample_index=samples, status="failed",
                            error="the agent raised", attempt_id="1", attempts=1))
    return rollouts


def example_tasks(n: int = 4) -> list[Task]:
    """Tasks whose input is a prompt of token ids, as the quick start's (``examples/quickstart``)."""
    return [Task(id=f"t{i}", input={"prompt_ids": [1 + i, 2 + i]}) for i in range(n)]


# ----------------------------------------------------------------------------------------------- checks


def _is_float_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def check_rows(batch: Any, who: str) -> None:
    """``batch`` is a Batch whose rows carry every column the later stages read, consistently shaped."""
    assert isinstance(batch, Batch), f"{who} returned {type(batch).__name__}, expected a Batch"
    if len(batch) == 0:
        return
    missing = [c for c in (*ROW_TENSORS, *ROW_COLUMNS) if c not in batch]
    assert not missing, f"{who} returned rows without the column(s) {missing}"
    n, width = len(batch), batch["prompts"].shape[1] + batch["responses"].shape[1]
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["position_ids"].shape == (n, width), (
        f"{who}: input_ids, attention_mask and position_ids must all be (rows, prompt + response width) = "
        f"{(n, width)}, got {tuple(batch['input_ids'].shape)}, {tuple(batch['attention_mask'].shape)}, "
        f"{tuple(batch['position_ids'].shape)}")
    assert torch.equal(batch["input_ids"], torch.cat([batch["prompts"], batch["responses"]], dim=1)), (
        f"{who}: input_ids must be prompts followed by responses")
    shape = batch["responses"].shape
    for column in ("response_mask", "token_level_scores"):
        assert batch[column].shape == shape, f"{who}: {column} has shape {tuple(batch[column].shape)}, " \
                                             f"expected the shape of responses {tuple(shape)}"
    mask = batch["response_mask"]
    assert set(mask.unique().tolist()) <= {0, 1}, f"{who}: response_mask holds values other than 0 and 1"
    assert torch.equal(batch["attention_mask"][:, -shape[1]:].bool() | ~mask.bool(), torch.ones_like(mask).bool()), (
        f"{who}: a response token with response_mask 1 must have attention_mask 1")
    assert _is_float_tensor(batch["token_level_scores"]), f"{who}: token_level_scores must be a float tensor"
    assert not batch["token_level_scores"][attention_free(batch)].any(), (
        f"{who}: token_level_scores must be 0 on padding (attention_mask 0)")
    assert batch["is_drop_mask"].shape == (n,) and batch["is_drop_mask"].dtype == torch.bool, (
        f"{who}: is_drop_mask must be a bool tensor of one value per row")


def attention_free(batch: Batch) -> torch.Tensor:
    """Response positions that are padding (attention mask 0)."""
    return batch["attention_mask"][:, -batch["responses"].shape[1]:] == 0


def check_estimator(env: ContractEnv, name: str) -> None:
    """The estimator ``name`` of the plugin, called as the core calls it (the ``advantage`` slot, ``algorithm.estimator``).

    Advantages and returns have the shape of ``responses`` and are finite
    floats (what they hold where ``response_mask`` is 0 is never read: verl's
    whitened GAE is not 0 there), leave the batch's inputs unchanged and
    depend on the batch alone (the same batch gives the same result).
    """
    env.component("estimator", name)
    assert env.recipe.algorithm.estimator == name, "the env must be made with algorithm.estimator=" + name
    env.ctx.slots["advantage"] = env.plugins.resolve_slot("advantage", env.recipe.plugins.slots.get("advantage"))
    who = f"estimator {name!r} of plugin {env.plugin!r}"
    # The loop sets reward_baselines only for the estimator that reads it (remax): others get a batch without it.
    try:
        env.ctx.call("advantage", batch=example_batch())
        with_baselines = False
    except KeyError as exc:
        if "reward_baselines" not in str(exc):
            raise
        with_baselines = True
    batch = example_batch(with_baselines=with_baselines)
    inputs = {k: batch[k].clone() for k in ("token_level_rewards", "response_mask", "values", "old_log_probs")}
    out = env.ctx.call("advantage", batch=batch)
    assert isinstance(out, Batch) and len(out) == len(batch), f"{who}: the advantage slot must return the batch"
    for column in ("advantages", "returns"):
        assert column in out, f"{who} set no {column!r}"
        value = out[column]
        assert _is_float_tensor(value), f"{who}: {column} must be a float tensor, got {type(value).__name__} " \
                                        f"{getattr(value, 'dtype', '')}"
        assert value.shape == out["responses"].shape, (
            f"{who}: {column} has shape {tuple(value.shape)}, expected (rows, response_length) = "
            f"{tuple(out['responses'].shape)}")
        assert torch.isfinite(value).all(), f"{who}: {column} holds NaN or inf"
    for column, before in inputs.items():
        assert torch.equal(out[column], before), f"{who} changed the input column {column!r}"
    again = env.ctx.call("advantage", batch=example_batch(with_baselines=with_baselines))
    assert torch.allclose(again["advantages"], out["advantages"]), f"{who}: the same batch gave other advantages"


def check_policy_loss(env: ContractEnv, name: str) -> None:
    """The policy loss ``name``, called as a backend calls it: ``fn(old_log_prob, log_prob, advantages, mask, config)``.

    The loss is a finite scalar tensor with a gradient to ``log_prob``; masked
    positions change neither the loss nor get a gradient; the metrics are a
    dict of names to finite numbers.
    """
    fn = env.component("policy_loss", name)
    who = f"policy loss {name!r} of plugin {env.plugin!r}"
    config = env.recipe.algorithm.policy_loss
    batch = example_batch()
    old, adv, mask = batch["old_log_probs"], batch["values"], batch["response_mask"].float()
    noise = 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    log_prob = (old + noise * mask).requires_grad_()
    result = fn(old, log_prob, adv, mask, config)
    assert isinstance(result, tuple) and len(result) == 2, f"{who} must return (loss, metrics), got {result!r}"
    loss, metrics = result
    assert _is_float_tensor(loss) and loss.ndim == 0, f"{who}: the loss must be a scalar float tensor, got {loss!r}"
    assert torch.isfinite(loss), f"{who}: the loss is {loss.item()}"
    assert loss.requires_grad, f"{who}: the loss has no gradient to log_prob"
    loss.backward()
    assert torch.isfinite(log_prob.grad).all(), f"{who}: the gradient holds NaN or inf"
    assert not log_prob.grad[mask == 0].any(), f"{who}: masked positions (response_mask 0) got a gradient"
    garbage = (log_prob.detach() + 7.0 * (1 - mask)).requires_grad_()
    masked_loss, _ = fn(old, garbage, adv, mask, config)
    assert torch.allclose(masked_loss, loss), f"{who}: the loss depends on masked positions"
    assert isinstance(metrics, dict), f"{who}: metrics must be a dict, got {type(metrics).__name__}"
    for key, value in metrics.items():
        assert isinstance(key, str), f"{who}: metric name {key!r} is not a string"
        assert math.isfinite(float(value)), f"{who}: metric {key!r} is {value!r}, not a finite number"


def check_aggregator(env: ContractEnv, name: str) -> None:
    """The aggregator ``name``: ``fn(ctx, rollouts) -> Batch`` with rows of the succeeded rollouts only."""
    fn = env.component("aggregator", name)
    who = f"aggregator {name!r} of plugin {env.plugin!r}"
    rollouts = example_rollouts()
    env.ctx.step_metrics = {}
    batch = fn(env.ctx, rollouts)
    check_rows(batch, who)
    succeeded = {r.rollout_id for r in rollouts if r.status == "succeeded"}
    assert len(batch) > 0, f"{who} made no rows of {len(succeeded)} succeeded rollouts"
    assert set(batch["rollout_id"]) == succeeded, (
        f"{who}: rows must come from every succeeded rollout and no other; got {sorted(set(batch['rollout_id']))}")
    by_task = {r.rollout_id: r.task_id for r in rollouts}
    assert all(uid == by_task[rid] for uid, rid in zip(batch["uid"], batch["rollout_id"])), (
        f"{who}: a row's uid must be its rollout's task id (the group of group estimators)")
    empty = fn(env.ctx, [])
    assert isinstance(empty, Batch) and len(empty) == 0, f"{who}: no rollouts must give a batch with no rows"
    for key, value in env.ctx.step_metrics.items():
        assert math.isfinite(float(value)), f"{who}: step metric {key!r} is {value!r}"


def check_pipeline_stage(env: ContractEnv) -> None:
    """The plugin's ``post_process_batch`` stage on rows, on no rows, and on the first batch (rollouts only).

    On rows it returns a Batch of some of the rows (a filter never invents a
    row), every column intact; on an empty batch it returns a Batch; on the
    first batch it either passes it on or turns the rollouts into rows.
    """
    who = f"post_process_batch stage of plugin {env.plugin!r}"
    env.ctx.step_metrics = {}
    rows = example_batch()
    seen = set(zip(rows["rollout_id"], rows["turn_index"].tolist()))
    out = env.call_own("post_process_batch", batch=rows)
    check_rows(out, who)
    assert len(out) <= len(rows), f"{who} returned {len(out)} rows from {len(rows)}"
    kept = set(zip(out["rollout_id"], out["turn_index"].tolist())) if len(out) else set()
    assert kept <= seen, f"{who} returned rows that were not in its input: {sorted(kept - seen)}"
    assert isinstance(env.call_own("post_process_batch", batch=example_batch().select([])), Batch), (
        f"{who} must return a Batch for a batch with no rows")
    first = env.call_own("post_process_batch", batch=Batch(meta={"rollouts": example_rollouts()}))
    check_rows(first, who + " (first batch, rollouts only)")
    if len(first) == 0:
        assert "rollouts" in first.meta, f"{who} dropped batch.meta['rollouts'] without making rows"
    for key, value in env.ctx.step_metrics.items():
        assert math.isfinite(float(value)), f"{who}: step metric {key!r} is {value!r}"


def check_logger(env: ContractEnv) -> None:
    """The plugin's ``log_metrics``: a run's calls (validation at step 0, steps 1 and 2) end to end, metrics untouched."""
    who = f"log_metrics of plugin {env.plugin!r}"
    metrics = {"critic/score/mean_after_processing": 0.5, "val/reward/mean": 1.0, "actor/pg_loss": -0.1,
               "timing_s/step": 0.25, "training/global_step": 1, "training/epoch": 0}
    try:
        if "on_train_start" in env.hooks:
            env.call_own("on_train_start")
        for step in (0, 1, 2):
            given = dict(metrics, **{"training/global_step": step})
            returned = env.call_own("log_metrics", metrics=given, step=step)
            assert returned is None, f"{who} returned {returned!r}; a broadcast's result is not read: return None"
            assert given == dict(metrics, **{"training/global_step": step}), (
                f"{who} changed the metrics it was given; every logger gets the same dict")
    finally:
        if "on_train_end" in env.hooks:
            env.call_own("on_train_end")


def check_lifecycle(env: ContractEnv) -> None:
    """The plugin's lifecycle hooks in a run's order, with a checkpoint written and read back in between."""
    who = f"plugin {env.plugin!r}"
    hooks = set(env.hooks)
    path = env.ctx.run_dir / "checkpoints" / "global_step_1"
    path.mkdir(parents=True, exist_ok=True)
    try:
        if "on_train_start" in hooks:
            env.call_own("on_train_start")
        env.ctx.step = 1
        if "on_step_start" in hooks:
            env.call_own("on_step_start", step=1)
        if "on_step_end" in hooks:
            metrics: dict[str, float] = {}
            env.call_own("on_step_end", step=1, metrics=metrics)
            assert all(math.isfinite(float(v)) for v in metrics.values()), f"{who}: on_step_end added {metrics}"
        if "save_checkpoint" in hooks:
            env.call_own("save_checkpoint", path=str(path))
        if "load_checkpoint" in hooks:
            env.call_own("load_checkpoint", path=str(path))
    finally:
        if "on_train_end" in hooks:
            env.call_own("on_train_end")


# ---------------------------------------------------------------------------------------------- wrappers


STAND_IN = "contract_stand_in"
"""The name of the plugin whose implementation a wrapper check wraps."""


class _StandInSettings(pydantic.BaseModel):
    pass


def _batch_with(*columns: str) -> Callable[[ContractEnv], tuple[dict[str, Any], Any]]:
    def make(env: ContractEnv) -> tuple[dict[str, Any], Any]:
        batch = example_batch()
        out = example_batch()
        for column in columns:
            if column not in out:
                out[column] = torch.zeros(out["responses"].shape)
        return {"batch": batch}, out

    return make


def _trained_batch() -> Batch:
    """Rows as the updates get them: with advantages and returns."""
    batch = example_batch()
    batch["advantages"] = batch["values"].clone()
    batch["returns"] = batch["values"].clone()
    return batch


def _checkpoint_dir(env: ContractEnv) -> str:
    path = env.ctx.run_dir / "checkpoints" / "global_step_1"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


WRAPPED_CALLS: dict[str, Callable[[ContractEnv], tuple[dict[str, Any], Any]]] = {
    "plugin_config_schema": lambda env: ({}, _StandInSettings),
    **{hook: (lambda env: ({"register": lambda *args, **kwargs: None, "settings": None}, None))
       for hook in REGISTRATION_HOOKS.values()},
    "on_train_start": lambda env: ({}, None),
    "on_train_end": lambda env: ({}, None),
    "on_step_start": lambda env: ({"step": 1}, None),
    "on_step_end": lambda env: ({"step": 1, "metrics": {"actor/pg_loss": 0.5}}, None),
    "policy_endpoints": lambda env: ({}, ["http://127.0.0.1:9/v1"]),
    "collect_rollouts": lambda env: ({"tasks": example_tasks(2), "mode": "train"}, example_rollouts()),
    "post_process_batch": lambda env: ({"batch": example_batch()}, example_batch()),
    "compute_old_logprob": _batch_with("old_log_probs", "entropys"),
    "compute_ref_logprob": _batch_with("ref_log_prob"),
    "compute_values": _batch_with("values"),
    "advantage": _batch_with("advantages", "returns"),
    "update_critic": lambda env: ({"batch": _trained_batch()}, {"critic/vf_loss": 0.25}),
    "update_actor": lambda env: ({"batch": _trained_batch()}, {"actor/pg_loss": 0.25}),
    "validate": lambda env: ({"tasks": example_tasks(2)}, {"val/reward/mean": 0.5}),
    "save_checkpoint": lambda env: ({"path": _checkpoint_dir(env)}, None),
    "load_checkpoint": lambda env: ({"path": _checkpoint_dir(env)}, None),
    "log_metrics": lambda env: ({"metrics": {"actor/pg_loss": 0.5}, "step": 1}, None),
    "export_model": lambda env: ({"path": _checkpoint_dir(env), "out": str(env.ctx.run_dir / "export"),
                                  "merged": True, "policy": None}, str(env.ctx.run_dir / "export")),
}
"""Hook → (the arguments of one call but ``ctx``, what a stand-in implementation returns) for a wrapper check."""


class StandIn:
    """A plugin whose implementation of one hook returns :attr:`result` and counts its calls."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, hook: str):
        self.result: Any = None
        self.calls = 0

        def implementation():
            self.calls += 1
            return self.result

        self.implementation = hookimpl(specname=hook)(implementation)


def check_wrapper(env_with: Callable[[Any], ContractEnv], hook: str) -> None:
    """The plugin's wrapper of ``hook`` around one call of a stand-in implementation, as the core makes it.

    ``env_with(stand_in)`` makes an env with the plugin under test and ``stand_in`` (named
    :data:`STAND_IN`) active. The call goes through pluggy, so the wrapper wraps it: it must let the
    implementation run once and give back a result the core accepts: for a hook with a result, not
    ``None`` (the core names the wrapper when it replaces a good result with a bad one).
    """
    make = WRAPPED_CALLS.get(hook)
    assert make is not None, f"no contract call is known for hook {hook!r}: declare the wrapper in not_covered"
    standin = StandIn(hook)
    env = env_with(standin)
    who = f"the wrapper of {hook!r} of plugin {env.plugin!r}"
    kwargs, standin.result = make(env)
    if "ctx" in inspect.signature(getattr(hookspecs, hook)).parameters:
        kwargs["ctx"] = env.ctx
    out = env.plugins.call(hook, STAND_IN, **kwargs)
    assert standin.calls == 1, (
        f"{who} let the implementation it wraps run {standin.calls} times, expected once (a wrapper yields once)")
    if standin.result is not None:
        assert out is not None, (
            f"{who} returned None in place of the implementation's result; end it with "
            f"'result = yield' ... 'return result'")


# ------------------------------------------------------------------------------------------------ stores


def _new(rollout_id: str, max_attempts: int = 1, **metadata: Any) -> NewRollout:
    return NewRollout(rollout_id, Task(id=f"task-{rollout_id}", input={"q": rollout_id}), 0, max_attempts, metadata)


def _call_span(rollout_id: str, attempt_id: str, sequence_id: int) -> Span:
    return Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                prompt_token_ids=[1, 2, 3], response_token_ids=[7, 8], response_logprobs=[-0.1, -0.2])


def check_store_lifecycle(store: Store) -> None:
    """queuing → running → succeeded, spans read back by sequence id, a second ``finish`` a no-op."""
    assert isinstance(store, Store), f"{type(store).__name__} does not have every method of the Store protocol"
    store.enqueue([_new("a", agent_name="guesser"), _new("b")])
    assert [r.status for r in store.query()] == ["queuing", "queuing"], "enqueued rollouts must be queuing, in order"
    attempt = store.dequeue("w1", lease_s=30)
    assert (attempt.rollout_id, attempt.attempt_id, attempt.task.input) == ("a", "1", {"q": "a"}), (
        f"dequeue must start attempt '1' of the oldest rollout, got {attempt}")
    assert attempt.metadata == {"agent_name": "guesser"}, "dequeue must hand over the rollout's metadata"
    state = store.attempt_state("a", "1")
    assert state.current and state.rollout_status == "running", f"attempt_state of the running attempt: {state}"
    assert not store.attempt_state("a", "2").current and store.attempt_state("nope", "1") is None
    ids = [store.next_sequence_id("a") for _ in range(3)]
    assert ids == sorted(set(ids)) and len(ids) == 3, f"next_sequence_id must hand out increasing ids, got {ids}"
    assert attempt.lease, "dequeue must hand over the attempt's lease token"
    leases = {("a", "1"): attempt.lease}
    store.add_spans([_call_span("a", "1", ids[2]), _call_span("a", "1", ids[0])], leases=leases)
    store.add_spans([Span(rollout_id="a", attempt_id="1", sequence_id=ids[1], kind="reward", reward=0.5)],
                    leases=leases)
    assert store.finish("a", "1", "succeeded", final_reward=1.0, lease=attempt.lease), (
        "finish of the running attempt must return True")
    assert not store.finish("a", "1", "failed", lease=attempt.lease), (
        "a second finish must return False and change nothing")
    store.flush()
    (rollout,) = store.get_rollouts(["a"])
    assert (rollout.status, rollout.final_reward, rollout.task_id) == ("succeeded", 1.0, "task-a"), rollout
    assert (rollout.attempt_id, rollout.attempts) == ("1", 1), rollout
    assert [s.sequence_id for s in rollout.spans] == ids, "spans must be read back ordered by sequence id"
    assert rollout.spans[0] == _call_span("a", "1", ids[0]), "a span must be read back as it was written"
    assert {r.rollout_id for r in store.query(["queuing"])} == {"b"}


def check_store_admit(store: Store) -> None:
    """``admit``: the attempt's state and, for the running attempt only, ``n`` fresh sequence ids."""
    store.enqueue([_new("a", agent_name="guesser"), _new("b")])
    attempt = store.dequeue("w1", lease_s=30)
    state, ids = store.admit("a", attempt.attempt_id, 2, lease=attempt.lease)
    assert state.current and state.rollout_status == "running" and state.metadata == {"agent_name": "guesser"}, (
        f"admit of the running attempt must give its state, got {state}")
    assert len(ids) == 2 and ids == sorted(set(ids)), f"admit must hand out n increasing ids, got {ids}"
    later = store.next_sequence_id("a")
    assert later > ids[-1], f"ids after admit must come after its ids, got {later} after {ids}"
    assert store.admit("a", "2", 3, lease=attempt.lease)[1] == [], (
        "admit of an attempt that is not running must hand out no id")
    state, ids = store.admit("b", "1", 1, lease=attempt.lease)
    assert (state.rollout_status, state.current, ids) == ("queuing", False, []), (state, ids)
    assert store.admit("nope", "1", 1) == (None, []), "admit of an unknown rollout must give (None, [])"
    with pytest.raises(LeaseError):  # the running attempt, under another token
        store.admit("a", attempt.attempt_id, 1, lease="not-the-token")


def check_store_queues_ahead(store: Store) -> None:
    """Rollouts enqueued ``ahead`` are dequeued before those queued earlier, in their own order."""
    store.enqueue([_new("a"), _new("b")])
    store.enqueue([NewRollout("v1", Task(id="val-1", input={}), ahead=True), _new("c"),
                   NewRollout("v2", Task(id="val-2", input={}), ahead=True)])
    order = [store.dequeue(f"w{i}", lease_s=30).rollout_id for i in range(5)]
    assert order == ["v1", "v2", "a", "b", "c"], f"rollouts queued ahead must be dequeued first, in order: {order}"


def check_store_refuses_duplicates(store: Store) -> None:
    """A rollout id already in the store is refused with ValueError."""
    store.enqueue([_new("a")])
    with pytest.raises(ValueError):
        store.enqueue([_new("a")])


def check_store_lease_expiry(store: Store) -> None:
    """A lost lease requeues the rollout at the front; the stale attempt can neither renew nor finish; out of attempts it fails."""
    store.enqueue([_new("a", max_attempts=2), _new("b")])
    first = store.dequeue("lost-worker", lease_s=0.05)
    assert first.rollout_id == "a"
    store.add_spans([_call_span("a", "1", store.next_sequence_id("a"))], leases={("a", "1"): first.lease})
    time.sleep(0.1)
    second = store.dequeue("w2", lease_s=0.05)
    assert (second.rollout_id, second.attempt_id) == ("a", "2"), (
        f"an expired lease must put its rollout back at the front of the queue as attempt '2', got {second}")
    assert not store.heartbeat("a", "1", 30, lease=first.lease), "heartbeat of a lost attempt must return False"
    assert not store.finish("a", "1", "succeeded", lease=first.lease), "finish of a lost attempt must return False"
    time.sleep(0.1)
    assert store.requeue_expired() == 1
    (rollout,) = store.get_rollouts(["a"])
    assert rollout.status == "failed" and rollout.attempts == 2, f"out of attempts the rollout fails: {rollout}"
    assert rollout.error, "a rollout failed by a lost lease must say why"
    assert rollout.spans == [], "the spans of an earlier attempt must not be read with the last one"


def check_store_heartbeat(store: Store) -> None:
    """A heartbeat extends the lease past its first expiry."""
    store.enqueue([_new("a", max_attempts=1)])
    attempt = store.dequeue("w", lease_s=0.3)
    assert store.heartbeat("a", attempt.attempt_id, 30, lease=attempt.lease)
    time.sleep(0.4)
    assert store.requeue_expired() == 0 and store.attempt_state("a", attempt.attempt_id).current
    assert store.finish("a", attempt.attempt_id, "timed_out", error="too slow", lease=attempt.lease)
    assert store.get_rollouts(["a"])[0].status == "timed_out"


def check_store_wait_cancel_release(store: Store) -> None:
    """``wait`` returns the terminal ones by its timeout; ``cancel`` ends unfinished ones; ``release`` forgets."""
    assert store.dequeue("w", lease_s=30, wait_s=0.05) is None, "dequeue of an empty queue must return None"
    store.enqueue([_new("a"), _new("b"), _new("queued")])
    a, b = store.dequeue("w", 30), store.dequeue("w", 30)
    assert store.wait(["a", "b"], timeout_s=0.05) == set()
    store.finish("a", a.attempt_id, "succeeded", lease=a.lease)
    timer = threading.Timer(0.05, lambda: store.finish("b", b.attempt_id, "failed", error="boom", lease=b.lease))
    timer.start()
    assert store.wait(["a", "b"], timeout_s=10) == {"a", "b"}, "wait must return once every rollout is terminal"
    timer.join()
    assert store.cancel(None, "abandoned") == 1, "cancel must end the one unfinished rollout"
    statuses = {r.rollout_id: r.status for r in store.query()}
    assert statuses == {"a": "succeeded", "b": "failed", "queued": "failed"}, statuses
    assert store.dequeue("w", 30) is None, "a cancelled rollout must not be dequeued"
    store.release(["a", "b", "queued"])
    assert store.query() == [], "released rollouts must not be listed by query()"


def check_store_many_workers(store: Store) -> None:
    """Threads dequeuing at once each get a different rollout: every rollout runs exactly once."""
    store.enqueue([_new(f"r{i}") for i in range(30)])
    taken, lock = [], threading.Lock()

    def worker(name: str) -> None:
        while (attempt := store.dequeue(name, 30)) is not None:
            store.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
            with lock:
                taken.append(attempt.rollout_id)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(taken) == sorted(f"r{i}" for i in range(30)), "each rollout must be dequeued exactly once"


def check_store_spans_written_again(store: Store) -> None:
    """A span written twice (a retried upload) is read back once: span keys are idempotent."""
    store.enqueue([_new("a")])
    attempt = store.dequeue("w", 30)
    span = _call_span("a", attempt.attempt_id, store.next_sequence_id("a"))
    leases = {("a", attempt.attempt_id): attempt.lease}
    store.add_spans([span], leases=leases)
    store.add_spans([span], leases=leases)
    other = span.model_copy(update={"attributes": {"another": "call"}})
    try:  # the first span under an id stays; another one is refused, not ignored
        store.add_spans([other], leases=leases)
        store.flush()
        refused_at_once = False  # a store that writes later (a service's client): the attempt ends failed
    except LeaseError:
        refused_at_once = True
    store.finish("a", attempt.attempt_id, "succeeded", lease=attempt.lease)
    (rollout,) = store.get_rollouts(["a"])
    assert rollout.spans == [span], "a span written again must be kept once, and a conflicting one not at all"
    assert rollout.status == ("succeeded" if refused_at_once else "failed"), (
        f"a conflicting span must be refused when added, or fail its attempt: {rollout}")
    assert refused_at_once or rollout.error.startswith(SPANS_LOST), rollout.error


def check_store_leases(store: Store) -> None:
    """Only the lease token's holder acts on an attempt: heartbeat, finish and spans under another token (or
    none) raise LeaseError and change nothing; spans of an unknown or ended attempt are refused."""
    store.enqueue([_new("a"), _new("b")])
    attempt = store.dequeue("w", 30)
    for lease in (None, "not-the-token"):
        with pytest.raises(LeaseError):
            store.heartbeat("a", attempt.attempt_id, 30, lease=lease)
        with pytest.raises(LeaseError):
            store.finish("a", attempt.attempt_id, "succeeded", final_reward=9.0, lease=lease)
        _refused(store, _call_span("a", attempt.attempt_id, store.next_sequence_id("a")), lease)
    _refused(store, _call_span("a", "7", store.next_sequence_id("a")), attempt.lease)  # an attempt that never ran
    _refused(store, _call_span("b", "1", store.next_sequence_id("b")), attempt.lease)  # still queued: none runs
    assert store.attempt_state("a", attempt.attempt_id).current, "a refused call must change nothing"
    assert store.finish("a", attempt.attempt_id, "succeeded", final_reward=1.0, lease=attempt.lease)
    # ended: an id handed out after its end is not one of its calls
    _refused(store, _call_span("a", attempt.attempt_id, store.next_sequence_id("a") + 1), attempt.lease)
    (rollout,) = store.get_rollouts(["a"])
    assert (rollout.status, rollout.final_reward, rollout.spans) == ("succeeded", 1.0, []), rollout


def _refused(store: Store, span: Span, lease: str | None) -> None:
    """Add ``span`` under ``lease``, which the store must refuse: LeaseError at once, or (a store that writes
    later: a service's client) dropped by the time it is flushed; the callers check that nothing was written."""
    try:
        store.add_spans([span], leases={(span.rollout_id, span.attempt_id): lease})
        store.flush()
    except LeaseError:
        pass


def check_store_refuses_unrecordable_spans(store: Store) -> None:
    """A span no reader could read back (nested deeper than MAX_SPAN_DEPTH, a lone surrogate in a key or a value)
    is a ValueError naming its path when added, nothing of its call is written, and the store goes on."""
    store.enqueue([_new("a")])
    attempt = store.dequeue("w", 30)
    leases = {("a", attempt.attempt_id): attempt.lease}
    deep: Any = "leaf"
    for _ in range(MAX_SPAN_DEPTH):
        deep = {"x": deep}
    bad = [{"request": deep}, {"request": {"content": "hi \ud800"}}, {"meta": {"\udfff": 1}},
           {"list": ["ok", ["\udbff tail"]]}]
    for attributes in bad:
        span = _call_span("a", attempt.attempt_id, store.next_sequence_id("a")).model_copy(
            update={"attributes": attributes})
        with pytest.raises(ValueError, match=r"attributes\.(request|meta|list)"):
            store.add_spans([span], leases=leases)
    good = _call_span("a", attempt.attempt_id, store.next_sequence_id("a"))
    store.add_spans([good], leases=leases)
    assert store.finish("a", attempt.attempt_id, "succeeded", lease=attempt.lease)
    (rollout,) = store.get_rollouts(["a"])
    assert (rollout.status, rollout.spans) == ("succeeded", [good]), rollout


STORE_CHECKS: tuple[Callable[[Store], None], ...] = (
    check_store_lifecycle, check_store_refuses_duplicates, check_store_queues_ahead, check_store_lease_expiry,
    check_store_heartbeat, check_store_wait_cancel_release, check_store_many_workers,
    check_store_spans_written_again, check_store_admit, check_store_leases, check_store_refuses_unrecordable_spans,
)


def open_store(env: ContractEnv, name: str) -> Store:
    """A fresh store ``name`` made by the plugin's factory for the run ``env.ctx``."""
    return env.component("store", name)(env.ctx)


# ----------------------------------------------------------------------------------------------- backend


def backend_trainer(env: ContractEnv, tasks: list[Task]):
    """A Trainer of ``env``'s recipe with ``tasks`` for training and validation."""
    from agl_core.loop import Trainer  # the loop imports the whole step: only backend checks need it

    return Trainer(env.recipe, env.plugins, train_tasks=tasks, val_tasks=tasks[:2])


def check_backend_slots(env: ContractEnv, tasks: list[Task]) -> list[str]:
    """One step of the loop, slot by slot, checking what each slot the plugin fills returns; the slots checked.

    The plugin's slots are those the recipe resolves to it; the others come
    from the recipe's other plugins.
    """
    from agl_core.data import Batch as _Batch

    trainer = backend_trainer(env, tasks)
    ctx = trainer.ctx
    own = [hook for hook, (owner, _) in ctx.slots.items() if owner == env.plugin]
    assert own, f"plugin {env.plugin!r} fills none of the slots this recipe needs ({', '.join(ctx.slots)})"
    checked = []
    ctx.plugins.broadcast("on_train_start", ctx=ctx)
    try:
        ctx.step = 1
        ctx.step_metrics = {}
        if "policy_endpoints" in own:
            urls = ctx.call("policy_endpoints")
            assert isinstance(urls, list) and all(isinstance(u, str) for u in urls), (
                f"policy_endpoints of {env.plugin!r} must return a list of URLs, got {urls!r}")
            checked.append("policy_endpoints")
        rollouts = ctx.call("collect_rollouts", tasks=tasks, mode="train")
        if "collect_rollouts" in own:
            assert isinstance(rollouts, list) and all(isinstance(r, Rollout) for r in rollouts), (
                f"collect_rollouts of {env.plugin!r} must return a list of Rollout")
            assert len(rollouts) == len(tasks) * env.recipe.rollout.n, (
                f"collect_rollouts of {env.plugin!r} returned {len(rollouts)} rollouts for {len(tasks)} tasks × "
                f"rollout.n={env.recipe.rollout.n}")
            assert all(r.status in TERMINAL for r in rollouts), "collect_rollouts must return finished rollouts only"
            checked.append("collect_rollouts")
        batch = trainer.post_process(_Batch(meta={"rollouts": rollouts}))
        check_rows(batch, "the post_process_batch pipeline")
        assert len(batch) > 0, "the step's rollouts made no rows to train on"
        batch, pad = batch.pad_to_divisor(ctx.world_size)
        for hook, columns in (("compute_old_logprob", ("old_log_probs", "entropys")),
                              ("compute_ref_logprob", ("ref_log_prob",)), ("compute_values", ("values",))):
            if hook not in ctx.slots:
                continue
            batch = ctx.call(hook, batch=batch)
            if hook in own:
                assert isinstance(batch, _Batch), f"{hook} of {env.plugin!r} must return the batch"
                for column in columns:
                    value = batch[column]
                    assert _is_float_tensor(value) and value.shape == batch["responses"].shape, (
                        f"{hook} of {env.plugin!r}: {column} must be a float tensor shaped like responses "
                        f"{tuple(batch['responses'].shape)}, got {getattr(value, 'shape', value)}")
                    assert torch.isfinite(value).all(), f"{hook} of {env.plugin!r}: {column} holds NaN or inf"
                if hook != "compute_values":
                    logprobs = batch[columns[0]]
                    assert (logprobs[batch["response_mask"].bool()] <= 1e-6).all(), (
                        f"{hook} of {env.plugin!r}: log-probs must be <= 0")
                checked.append(hook)
        batch.pop("entropys")
        batch = batch.unpad(pad)
        batch["token_level_rewards"] = batch["token_level_scores"]
        batch = ctx.call("advantage", batch=batch)
        rows = len(batch) - len(batch) % env.recipe.algorithm.ppo_mini_batch_size
        assert rows > 0, (f"one step made {len(batch)} rows, fewer than algorithm.ppo_mini_batch_size="
                          f"{env.recipe.algorithm.ppo_mini_batch_size}: give backend_tasks more tasks")
        batch = batch[np.arange(rows)]
        for hook in ("update_critic", "update_actor"):
            if hook in own:
                metrics = ctx.call(hook, batch=batch)
                assert isinstance(metrics, dict) and all(math.isfinite(float(v)) for v in metrics.values()), (
                    f"{hook} of {env.plugin!r} must return a dict of finite metrics, got {metrics!r}")
                checked.append(hook)
        if "validate" in own:
            metrics = ctx.call("validate", tasks=tasks[:2])
            assert isinstance(metrics, dict) and all(math.isfinite(float(v)) for v in metrics.values()), (
                f"validate of {env.plugin!r} must return a dict of finite metrics, got {metrics!r}")
            checked.append("validate")
    finally:
        trainer.end_plugins()
    return checked


def check_backend_run(env: ContractEnv, tasks: list[Task]) -> dict[str, float]:
    """One step of ``Trainer.fit`` with a checkpoint, then a second run that resumes from it; the last metrics."""
    trainer = backend_trainer(env, tasks)
    metrics = trainer.fit()
    assert metrics.get("training/global_step") == 1, f"one step was asked, the run logged {metrics}"
    assert (env.ctx.run_dir / "checkpoints" / "global_step_1").is_dir(), "the step's checkpoint was not written"
    return metrics


# -------------------------------------------------------------------------------------- the test classes


class _ContractBase:
    """Fixtures every contract class shares; a subclass provides ``plugin_name`` (and what its kind needs)."""

    @pytest.fixture
    def plugin_object(self) -> Any:
        return None

    @pytest.fixture
    def plugin_overrides(self) -> list[str]:
        return []

    @pytest.fixture
    def plugin_flags(self) -> list[str]:
        return []

    @pytest.fixture
    def backend_tasks(self) -> list[Task]:
        return example_tasks()

    @pytest.fixture
    def contract_recipe(self, plugin_overrides) -> list[str]:
        """The overrides the env is made with: the plugin's, plus what the kind under test needs."""
        return list(plugin_overrides)

    @pytest.fixture
    def env(self, tmp_path, plugin_name, plugin_object, contract_recipe, plugin_flags) -> ContractEnv:
        return contract_env(tmp_path / "run", plugin_name, plugin_object, contract_recipe, plugin_flags)

    @pytest.fixture
    def env_with(self, tmp_path, plugin_name, plugin_object, plugin_overrides, plugin_flags):
        """Factory: a new env (its own run directory) with the stand-in plugin of a wrapper check beside the plugin."""
        counter = iter(range(1_000_000))

        def make(standin: Any) -> ContractEnv:
            return contract_env(tmp_path / f"wrapped-{next(counter)}", plugin_name, plugin_object,
                                plugin_overrides, plugin_flags, others=[(STAND_IN, standin)])

        return make


class EstimatorContract(_ContractBase):
    """An advantage estimator (``register_estimators``). Fixtures: ``plugin_name``, ``estimator_name``."""

    @pytest.fixture
    def contract_recipe(self, plugin_overrides, estimator_name) -> list[str]:
        return [f"algorithm.estimator={estimator_name}", *plugin_overrides]

    def test_advantages_and_returns(self, env, estimator_name):
        check_estimator(env, estimator_name)


class PolicyLossContract(_ContractBase):
    """A policy loss (``register_policy_losses``). Fixtures: ``plugin_name``, ``loss_name``."""

    @pytest.fixture
    def contract_recipe(self, plugin_overrides, loss_name) -> list[str]:
        return [f"algorithm.policy_loss.name={loss_name}", *plugin_overrides]

    def test_loss_gradient_masks_and_metrics(self, env, loss_name):
        check_policy_loss(env, loss_name)


class AggregatorContract(_ContractBase):
    """A trace aggregator (``register_aggregators``). Fixtures: ``plugin_name``, ``aggregator_name``."""

    def test_rows_of_the_succeeded_rollouts(self, env, aggregator_name):
        check_aggregator(env, aggregator_name)


class StoreContract(_ContractBase):
    """A rollout store (``register_stores``): the protocol's lease, requeue and idempotence semantics.

    Fixtures: ``plugin_name`` and ``store_name`` (the store is made by the
    plugin's factory), or override ``store`` to return a fresh store.
    """

    @pytest.fixture
    def store(self, env, store_name) -> Iterator[Store]:
        store = open_store(env, store_name)
        yield store
        store.close()

    def test_lifecycle(self, store):
        check_store_lifecycle(store)

    def test_duplicates_refused(self, store):
        check_store_refuses_duplicates(store)

    def test_queued_ahead(self, store):
        check_store_queues_ahead(store)

    def test_lost_lease_requeued_then_failed(self, store):
        check_store_lease_expiry(store)

    def test_heartbeat_extends_the_lease(self, store):
        check_store_heartbeat(store)

    def test_wait_cancel_release(self, store):
        check_store_wait_cancel_release(store)

    def test_each_rollout_dequeued_once(self, store):
        check_store_many_workers(store)

    def test_a_span_written_again_is_kept_once(self, store):
        check_store_spans_written_again(store)

    def test_admit(self, store):
        check_store_admit(store)

    def test_leases(self, store):
        check_store_leases(store)

    def test_unrecordable_spans_refused(self, store):
        check_store_refuses_unrecordable_spans(store)


class LoggerContract(_ContractBase):
    """A metrics logger (``log_metrics``). Fixture: ``plugin_name``."""

    def test_logs_a_run(self, env):
        check_logger(env)


class PipelineStageContract(_ContractBase):
    """A ``post_process_batch`` stage (a filter, or the aggregating first stage). Fixture: ``plugin_name``."""

    def test_stage(self, env):
        check_pipeline_stage(env)


class WrapperContract(_ContractBase):
    """The plugin's hook wrappers (``@hookimpl(wrapper=True)`` or ``hookwrapper=True``), each around one call.

    Fixture: ``plugin_name``. Each wrapper wraps a stand-in implementation of its hook, called as the
    core calls it: the implementation runs once and the wrapper gives back a result the core accepts.
    """

    def test_wrappers(self, env, env_with):
        wrappers = env.plugins.plugins[env.plugin].wrappers
        assert wrappers, f"plugin {env.plugin!r} wraps no hook"
        for hook in wrappers:
            check_wrapper(env_with, hook)


class BackendContract(_ContractBase):
    """The slots a backend fills, in one full step of the loop (the instant loop of the quick start).

    Fixtures: ``plugin_name``; ``plugin_overrides`` for what the backend
    needs (a model, an agent); ``backend_tasks`` for its step's tasks.
    """

    @pytest.fixture
    def contract_recipe(self, plugin_overrides, backend_tasks) -> list[str]:
        return backend_overrides(plugin_overrides, backend_tasks)

    def test_each_slot_returns_what_the_loop_reads(self, env, backend_tasks):
        check_backend_slots(env, backend_tasks)

    def test_one_step_with_a_checkpoint(self, env, backend_tasks):
        check_backend_run(env, backend_tasks)


def backend_overrides(plugin_overrides: list[str], tasks: list[Task]) -> list[str]:
    """A one-step recipe over ``tasks`` with a validation and a checkpoint, small batches; the plugin's overrides win."""
    return ["trainer.total_steps=1", "trainer.save_freq=1", "trainer.test_freq=1", "trainer.val_before_train=false",
            f"data.train_batch_size={len(tasks)}", "rollout.n=4", "algorithm.ppo_mini_batch_size=8", "data.max_prompt_length=8",
            "data.max_response_length=4", *plugin_overrides]


class PluginContract(_ContractBase):
    """Every extension a plugin provides, each on its contract, and none left out silently.

    Fixture: ``plugin_name`` (and ``plugin_overrides`` if it needs settings).
    What the plugin provides is found from it: its registered estimators,
    policy losses, aggregators and stores, its logger, its pipeline stage,
    its backend slots and its lifecycle hooks. A hook no contract covers (say
    ``export_model``) fails :meth:`test_nothing_left_out` unless the class
    names it in ``not_covered`` with the reason, e.g.
    ``not_covered = {"export_model": "tested by tests/test_export.py"}``.
    ``"estimator:NAME"`` (or ``policy_loss:``, ``aggregator:``, ``store:``)
    leaves out one component that needs inputs the contract cannot make
    (a column only a GPU backend computes); the others are checked and the
    test then ends as skipped, naming it.
    A key naming a hook of a kind, or ``"backend"`` (every backend slot) or
    ``"lifecycle"`` (the lifecycle hooks), skips that kind's test with the
    reason, listed in pytest's summary: for what cannot run here (a backend
    that needs a GPU, a runner that needs an agent and a policy server).
    Every wrapper the plugin has (``@hookimpl(wrapper=True)``) runs around
    a stand-in implementation of its hook (:func:`check_wrapper`);
    ``"wrapper:HOOK"`` in ``not_covered`` leaves one out, and a wrapper of a
    hook the suite has no call for fails :meth:`test_nothing_left_out`.
    """

    not_covered: dict[str, str] = {}

    def _skip_if_declared(self, hook: str) -> None:
        if hook in self.not_covered:
            pytest.skip(f"{hook}: {self.not_covered[hook]}")

    @pytest.fixture
    def fresh_env(self, tmp_path, plugin_name, plugin_object, plugin_overrides, plugin_flags):
        """Factory: a new env (its own run directory) with more overrides before the plugin's own."""
        counter = iter(range(1_000_000))

        def make(*extra: str) -> ContractEnv:
            return contract_env(tmp_path / f"run-{next(counter)}", plugin_name, plugin_object,
                                [*extra, *plugin_overrides], plugin_flags)

        return make

    def test_loads(self, env):
        plugin = env.plugins.plugins[env.plugin]
        assert plugin.status == "active" and (plugin.hooks or plugin.wrappers), (
            f"plugin {plugin.label} implements and wraps no hook")

    def _each(self, env: ContractEnv, kind: str) -> Iterator[str]:
        """The plugin's components of ``kind``, less those declared ``not_covered["kind:name"]``; then a skip naming those."""
        declared = {}
        for name in env.owned(kind):
            if f"{kind}:{name}" in self.not_covered:
                declared[name] = self.not_covered[f"{kind}:{name}"]
            else:
                yield name
        if declared:
            pytest.skip("the others passed; not covered: " + "; ".join(f"{kind} {n}: {why}"
                                                                     for n, why in declared.items()))

    def test_estimators(self, env, fresh_env):
        self._skip_if_declared("register_estimators")
        for name in self._each(env, "estimator"):
            check_estimator(fresh_env(f"algorithm.estimator={name}"), name)

    def test_policy_losses(self, env, fresh_env):
        self._skip_if_declared("register_policy_losses")
        for name in self._each(env, "policy_loss"):
            check_policy_loss(fresh_env(f"algorithm.policy_loss.name={name}"), name)

    def test_aggregators(self, env):
        self._skip_if_declared("register_aggregators")
        for name in self._each(env, "aggregator"):
            check_aggregator(env, name)

    def test_stores(self, env, fresh_env):
        self._skip_if_declared("register_stores")
        for name in self._each(env, "store"):
            for check in STORE_CHECKS:
                store = open_store(fresh_env(), name)
                try:
                    check(store)
                finally:
                    store.close()

    def test_logger(self, env):
        self._skip_if_declared("log_metrics")
        if "log_metrics" in env.hooks:
            check_logger(env)

    def test_pipeline_stage(self, env):
        self._skip_if_declared("post_process_batch")
        if "post_process_batch" in env.hooks:
            check_pipeline_stage(env)

    def test_lifecycle(self, env):
        self._skip_if_declared("lifecycle")
        if set(LIFECYCLE_HOOKS) & set(env.hooks):
            check_lifecycle(env)

    def test_backend_slots(self, env, fresh_env, backend_tasks):
        self._skip_if_declared("backend")
        if not set(BACKEND_SLOTS) & set(env.hooks):
            return
        check_backend_slots(fresh_env(*backend_overrides([], backend_tasks)), backend_tasks)
        check_backend_run(fresh_env(*backend_overrides([], backend_tasks)), backend_tasks)

    def test_wrappers(self, env, env_with):
        for hook in env.plugins.plugins[env.plugin].wrappers:
            if f"wrapper:{hook}" not in self.not_covered:
                check_wrapper(env_with, hook)

    def test_nothing_left_out(self, env):
        covered = {"plugin_config_schema", "advantage", *REGISTRATION_HOOKS.values(), "log_metrics",
                   "post_process_batch", *LIFECYCLE_HOOKS, *BACKEND_SLOTS}
        covered -= {"register_actor_transforms"}  # no contract runs an actor transform: declare it
        left = [h for h in env.hooks if h not in covered and h not in self.not_covered]
        left += [f"wrapper:{h}" for h in env.plugins.plugins[env.plugin].wrappers
                 if h not in WRAPPED_CALLS and f"wrapper:{h}" not in self.not_covered]
        assert not left, (
            f"plugin {env.plugin!r} implements {left}, which no contract checks; test them and name each in "
            f"not_covered = {{hook: 'where it is tested'}} of {type(self).__name__}")
