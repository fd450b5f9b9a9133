"""The ``transition`` aggregator: one training row per model call."""

from __future__ import annotations

from collections.abc import Iterable

from agl_core.data import Batch, Rollout

from agl_plugin_traces.calls import TraceCounts, call_columns, trainable_rollouts
from agl_plugin_traces.rows import RowBuilder


def transition_batch(rollouts: Iterable[Rollout], max_prompt_length: int, max_response_length: int, *,
                     per_call_rewards: bool = False, missing_reward: float | None = 0.0,
                     pad_token_id: int = 0) -> tuple[Batch, dict[str, float]]:
    """One row per trainable model call of the succeeded rollouts, and the aggregation metrics.

    The prompt is left-padded to ``max_prompt_length``; a longer one keeps its
    last tokens and is marked in ``is_drop_mask``. The response is
    right-padded to ``max_response_length`` or cut there (counted), every
    token with ``response_mask`` 1. The row's reward sits on its last
    response token: the rollout's reward, or with ``per_call_rewards`` the
    call's own reward where it emitted one. Every row also carries its call
    in the per-call columns (:data:`agl_core.data.CALL_COLUMNS`), own reward
    and state key included, whatever ``per_call_rewards`` says.
    """
    rows = RowBuilder(max_prompt_length, max_response_length)
    counts = TraceCounts()
    for rollout, reward, calls in trainable_rollouts(rollouts, missing_reward, counts):
        for call in calls:
            rows.begin(call.prompt_ids)
            own = call.reward is not None
            rows.add_turn(0, len(call.response_ids), call.logprobs,
                          call.reward if own and per_call_rewards else reward, **call_columns(call, reward))
            rows.end(call.prompt_ids, call.response_ids, rollout.task_id, rollout.rollout_id, call.turn, reward)
    return rows.to_batch(pad_token_id), {**counts.metrics(), **rows.metrics()}
