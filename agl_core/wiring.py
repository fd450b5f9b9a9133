"""Which implementation fills each stage of the step, resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from agl_core.components import Components
from agl_core.config import Recipe
from agl_core.plugins import PluginSet

ALWAYS = ("collect_rollouts", "compute_old_logprob", "advantage", "update_actor")


@dataclass
class StepPlan:
    """The resolved hooks of a run: slot owners, pipeline stages, and what the algorithm needs."""

    slots: dict[str, tuple[str, Callable]]
    post_process: list[tuple[str, Callable]]
    needs_ref: bool
    needs_critic: bool

    def describe(self) -> str:
        """The table printed at start-up and by ``agl doctor``."""
        lines = ["slots:"]
        lines += [f"  {hook:<22} {owner}" for hook, (owner, _) in self.slots.items()]
        lines.append("post_process_batch pipeline: " + (" -> ".join(n for n, _ in self.post_process) or "(empty)"))
        return "\n".join(lines)


def needed_slots(recipe: Recipe, components: Components, validates: bool) -> tuple[list[str], bool, bool]:
    """(slot hooks the run calls, needs_ref, needs_critic) for this recipe."""
    algo = recipe.algorithm
    needs_ref = algo.use_kl_in_reward or algo.policy_loss.use_kl_loss
    needs_critic = components.get("estimator", algo.estimator).options.get("needs_critic", False)
    hooks = list(ALWAYS)
    if recipe.rollout.agent is not None:  # agents call a model: someone must say where it is served
        hooks.append("policy_endpoints")
    if needs_ref:
        hooks.append("compute_ref_logprob")
    if needs_critic:
        hooks += ["compute_values", "update_critic"]
    if validates:
        hooks.append("validate")
    return hooks, needs_ref, needs_critic


def plan(recipe: Recipe, plugins: PluginSet, components: Components, validates: bool) -> StepPlan:
    """Resolve every hook the run needs; raise PluginError on an empty or ambiguous slot."""
    hooks, needs_ref, needs_critic = needed_slots(recipe, components, validates)
    choices = recipe.plugins.slots
    slots = {}
    for hook in hooks:
        slots[hook] = plugins.resolve_slot(hook, choices.get(hook))
    stages = plugins.pipeline("post_process_batch", recipe.plugins.order.get("post_process_batch"))
    return StepPlan(slots, stages, needs_ref, needs_critic)
