"""Rows of several policies: each policy's calls aggregated apart, rows carrying their policy, groups by (policy, task).

A rollout of a multi-agent system holds the calls of several roles. Rows of one
policy are trained by its adapter alone, so a row never mixes two policies'
calls: each rollout is split into one view per policy (its calls of that
policy, and every reward and annotation span, so each view has the rollout's
rewards), the aggregator the recipe names turns each policy's views into rows,
and the rows get

- the ``policy`` column (a non-tensor column of the batch);
- ``uid`` = ``<policy>/<task uid>``: every stage that groups rows by ``uid``
  (advantage estimators, the zero-variance filter, balancing) groups them by
  (policy, task), so a hinter's rows are never baselined against a guesser's.

Only the policies that train make rows (:func:`agl_core.policies.training_policies`):
those ``trainer.agent_match`` does not select, frozen ones and the base model
were served and recorded, never trained. A run without a ``policies`` section
is aggregated as before.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np

from agl_core.data import Batch, Rollout

LLM_CALL = "llm_call"


def policy_view(rollout: Rollout, policy: str) -> Rollout | None:
    """``rollout`` with only ``policy``'s model calls (rewards and annotations kept); None when it made none."""
    spans = [s for s in rollout.spans if s.kind != LLM_CALL or s.attributes.get("policy") == policy]
    triplets = [t for t in rollout.triplets if t.metadata.get("policy") == policy]
    if not any(s.kind == LLM_CALL for s in spans) and not triplets:
        return None
    return rollout.model_copy(update={"spans": spans, "triplets": triplets})


def policies_called(rollouts: Sequence[Rollout]) -> list[str]:
    """The policies the rollouts' calls reached, in order of first appearance."""
    seen: dict[str, None] = {}
    for rollout in rollouts:
        for span in rollout.spans:
            if span.kind == LLM_CALL and span.attributes.get("policy") is not None:
                seen.setdefault(span.attributes["policy"], None)
        for triplet in rollout.triplets:
            if triplet.metadata.get("policy") is not None:
                seen.setdefault(triplet.metadata["policy"], None)
    return list(seen)


def aggregate_by_policy(aggregate: Callable[[list[Rollout]], Batch], rollouts: Sequence[Rollout],
                        trained: Collection[str]) -> Batch:
    """Rows of each ``trained`` policy's calls (``aggregate`` over its views), with ``policy`` and grouped ``uid``."""
    parts = []
    for policy in policies_called(rollouts):
        if policy not in trained:
            continue
        views = [view for rollout in rollouts if (view := policy_view(rollout, policy)) is not None]
        batch = aggregate(views)
        if not len(batch):
            continue
        batch["policy"] = np.array([policy] * len(batch), dtype=object)
        batch["uid"] = np.array([f"{policy}/{uid}" for uid in batch["uid"]], dtype=object)
        parts.append(batch)
    if not parts:
        return aggregate([])
    return parts[0] if len(parts) == 1 else Batch.concat(parts)
