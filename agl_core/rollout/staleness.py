"""Staleness of rollouts in asynchronous training: which weights served them, which groups a step may train on.

Weight versions count the actor's updates: the weights of version ``v`` have
had ``v`` updates. Step ``t`` updates weights of version ``t - 1``, so a
rollout served by version ``v`` and trained at step ``t`` is
``(t - 1) - v`` updates stale: 0 in synchronous training. A rollout's
version is the *oldest* that served any of its model calls (a multi-turn
rollout may span a weight sync). With ``trainer.async.max_staleness = k``
step ``t`` trains only on rollouts of staleness ``<= k``, i.e. served by
version ``>= t - 1 - k``.

GRPO compares the ``rollout.n`` samples of a task with each other, so a
group is taken or dropped whole: one rollout over the bound drops its group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from agl_core.data import Rollout


def served_version(rollout: Rollout) -> int | None:
    """The oldest weight version that answered one of the rollout's model calls; None when none recorded one."""
    versions = [span.attributes.get("weight_version") for span in rollout.spans if span.kind == "llm_call"]
    versions = [v for v in versions if isinstance(v, int)]
    return min(versions) if versions else None


def staleness(step: int, version: int) -> int:
    """Updates between the weights that served a rollout (``version``) and those step ``step`` updates."""
    return (step - 1) - version


@dataclass
class Taken:
    """The groups a step keeps, and what the bound cost it."""

    rollouts: list[Rollout] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    """One entry per kept rollout that recorded a version."""
    n_stale_dropped: int = 0
    """Rollouts dropped (with their whole group) because one of the group was over the bound."""
    n_groups_dropped: int = 0

    def metrics(self) -> dict[str, float]:
        """``async/staleness_mean``, ``async/staleness_max`` (of the kept rollouts) and ``async/n_stale_dropped``."""
        out = {"async/n_stale_dropped": float(self.n_stale_dropped),
               "async/n_groups_dropped": float(self.n_groups_dropped)}
        if self.staleness:
            out["async/staleness_mean"] = sum(self.staleness) / len(self.staleness)
            out["async/staleness_max"] = float(max(self.staleness))
        return out


def within_bound(groups: Sequence[Sequence[Rollout]], step: int, max_staleness: int) -> Taken:
    """The groups whose every rollout is at most ``max_staleness`` stale at ``step``, in order; the others counted.

    A rollout that recorded no version (it made no call, or every call failed
    before reaching a policy server) cannot be stale.
    """
    taken = Taken()
    for group in groups:
        versions = [served_version(r) for r in group]
        ages = [staleness(step, v) for v in versions if v is not None]
        if any(age > max_staleness for age in ages):
            taken.n_stale_dropped += len(group)
            taken.n_groups_dropped += 1
            continue
        taken.rollouts.extend(group)
        taken.staleness.extend(ages)
    return taken
