"""Several policies in one run: the recipe's ``policies`` section, routing a call to its policy, selection.

A run may hold several policies on one base model, one per role of a
multi-agent system (a planner and a solver, a hinter and a guesser): each is
a LoRA adapter of its own (an adapter plugin, e.g. agl-plugin-lora, puts them
on the actor) or the base model itself. The core knows only their names and
the contract a row needs:

- a call reaches its policy by the ``model`` name the agent sends, or by the
  role its client was made for (``llm.for_role(name)``, whose base URL names
  the role); the gateway records the policy on the call's span
  (:func:`route`);
- rows carry it (the ``policy`` column), advantages are computed within
  (policy, task) groups, and ``trainer.agent_match`` says which policies'
  calls become training rows (:func:`selected`); the others are served and
  recorded, never trained.

With no ``policies`` section the run has one policy, as always: the gateway
forwards ``model`` unchanged and rows carry no policy.

A call naming no policy of the run is refused with 404 naming the policies,
rather than sent to a default one: a typo in a role's name, or an agent
written against another model name, would otherwise train the wrong adapter
on that role's calls without a word.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A policy's name: it is a ``model`` name, a URL path segment, a metric key part and a directory name."""

METRIC_PREFIX = "policy"
"""Per-policy metrics are ``policy/<name>/<metric>``."""

POLICY_ADAPTERS = "agl_policy_adapters"
"""The contract between an adapter plugin and a backend: the actor's attribute ``{policy: adapter name}``.

An actor transform that puts a named adapter per policy on the actor sets it;
:data:`BASE_ADAPTER` names a policy that is the base model itself.
"""

BASE_ADAPTER = "__base__"
"""peft's name for 'no adapter' in a mixed-adapter batch: the base model."""


class PolicyConfig(BaseModel):
    """One entry of the recipe's ``policies`` section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    base: bool = Field(False, description="the base model itself (every adapter off): served, never trained")
    trainable: bool | None = Field(None, description="whether its adapter trains (default: true; false keeps it "
                                                     "frozen but served; a base policy never trains)")
    lr: float | None = Field(None, gt=0, description="its adapter's learning rate (None: the backend's actor lr)")
    adapter: dict[str, Any] = Field(default_factory=dict,
                                    description="the adapter's shape: keys of the adapter plugin's section "
                                                "(plugins.lora: rank, alpha, dropout, target_modules, "
                                                "modules_to_save); unset keys take that section's values")

    @model_validator(mode="after")
    def _base_is_frozen(self) -> PolicyConfig:
        if self.base and (self.trainable or self.adapter or self.lr is not None):
            raise ValueError("a base policy (base: true) is the base model itself: it has no adapter, lr or "
                             "trainable setting")
        return self

    @property
    def trains(self) -> bool:
        return not self.base and self.trainable is not False


def check_names(policies: Mapping[str, Any]) -> None:
    """ValueError naming the first policy name that cannot serve as a model name, URL segment and metric key."""
    for name in policies:
        if not NAME_PATTERN.fullmatch(name):
            raise ValueError(f"policy name {name!r} must match {NAME_PATTERN.pattern} (it is sent as the "
                             f"model name and used in URLs, metric keys and directory names)")


def check_agent_match(agent_match: str | list[str] | None, policies: Collection[str]) -> None:
    """ValueError when ``trainer.agent_match`` is set without policies, is a bad regex, or names no policy."""
    if agent_match is None:
        return
    if not policies:
        raise ValueError("trainer.agent_match selects which policies' calls train; it needs a policies section")
    if isinstance(agent_match, str):
        try:
            pattern = re.compile(agent_match)
        except re.error as exc:
            raise ValueError(f"trainer.agent_match {agent_match!r} is not a regular expression: {exc}") from None
        if not any(pattern.fullmatch(name) for name in policies):
            raise ValueError(f"trainer.agent_match {agent_match!r} matches none of the policies "
                             f"({', '.join(policies)})")
        return
    unknown = [name for name in agent_match if name not in policies]
    if unknown:
        raise ValueError(f"trainer.agent_match names {', '.join(map(repr, unknown))}, which are not policies "
                         f"of this run ({', '.join(policies)})")


def selected(policy: str | None, agent_match: str | list[str] | None) -> bool:
    """Whether calls of ``policy`` become training rows under ``trainer.agent_match`` (unset: every policy)."""
    if agent_match is None:
        return True
    if policy is None:
        return False
    if isinstance(agent_match, str):
        return re.fullmatch(agent_match, policy) is not None
    return policy in agent_match


def training_policies(policies: Mapping[str, PolicyConfig], agent_match: str | list[str] | None) -> list[str]:
    """The policies whose adapters a step updates: trainable ones whose calls are selected."""
    return [name for name, spec in policies.items() if spec.trains and selected(name, agent_match)]


def route(policies: Collection[str], model: Any, role: str | None) -> str | None:
    """The policy a call reaches: its client's declared ``role``, else the ``model`` it names; None without policies.

    RequestError 404 naming the run's policies when the role or the model
    names none of them (see the module's docstring for why there is no
    default policy).
    """
    if not policies:
        return None
    from agl_core.http.rules import RequestError  # starlette: not imported with the recipe's schema

    if role is not None:
        if role not in policies:
            raise RequestError(404, f"role {role!r} is not a policy of this run; the policies are "
                                    f"{', '.join(policies)}")
        return role
    if isinstance(model, str) and model in policies:
        return model
    raise RequestError(404, f"model {model!r} names no policy of this run; the policies are {', '.join(policies)} "
                            f"(send one as 'model', or make the client with llm.for_role(name))")


def metric_key(policy: str, metric: str) -> str:
    """``policy/<name>/<metric>``."""
    return f"{METRIC_PREFIX}/{policy}/{metric}"
