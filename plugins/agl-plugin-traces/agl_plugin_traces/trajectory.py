"""The ``trajectory`` aggregator: consecutive calls that extend one context merge into one training row.

A multi-turn agent usually sends, as its next prompt, its previous prompt,
the model's previous response and then new tokens (a tool result, the
environment's answer, template tokens). Such a call does not need a row of
its own: the new tokens join the previous row's response with
``response_mask`` 0 and the model's new response follows with mask 1, so one
forward pass trains on every turn with its exact context. A call whose
prompt is not such an extension starts a new row; the break is classified
(:mod:`agl_plugin_traces.mismatch`) and counted.

Two defects of Agent Lightning v0.3.0's aggregator (fixed in v1.0.0) are avoided:

* a call whose prompt is exactly the previous prompt + response (no new
  tokens) appends nothing before its response; v0.3.0 sliced
  ``prompt[-0:]`` and appended the whole prompt again;
* a row that starts at a later call with a prompt over the limit never
  trains on the overflow: it goes into the response with mask 0 (or the row
  is marked for dropping); v0.3.0 put it there with mask 1.
"""

from __future__ import annotations

from collections.abc import Iterable, Sized
from dataclasses import dataclass, field
from typing import Any, Literal

from agl_core.data import Batch, Rollout, TokenIds

from agl_plugin_traces.calls import TraceCounts, call_columns, trainable_rollouts
from agl_plugin_traces.mismatch import CLASSES, Tokenizer, classify_break, first_difference, recorded_class
from agl_plugin_traces.rows import RowBuilder


@dataclass
class Breaks:
    """The prefix breaks of a batch: per class, per rollout, and (when kept) one record each."""

    by_class: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CLASSES, 0))
    rollouts: int = 0
    records: list[dict[str, Any]] | None = None

    def metrics(self) -> dict[str, float]:
        return {"training/n_unmerged_rollouts": float(self.rollouts),
                **{f"training/mismatch/{name}": float(n) for name, n in self.by_class.items()}}


def trajectory_batch(rollouts: Iterable[Rollout], max_prompt_length: int, max_response_length: int, *,
                     per_call_rewards: bool = False, missing_reward: float | None = 0.0,
                     later_prompt_overflow: Literal["response", "drop"] = "response",
                     tokenizer: Tokenizer | None = None,
                     keep_break_records: bool = False,
                     pad_token_id: int = 0) -> tuple[Batch, dict[str, float], Breaks]:
    """Merged rows of the succeeded rollouts, the aggregation metrics, and the prefix breaks.

    A call is merged into the open row when its prompt starts with the
    previous call's prompt + response ids; the rest of its prompt is appended
    with mask 0 (nothing when there is no rest), then its response with
    mask 1. Otherwise it opens a new row whose prompt is the call's prompt.
    Responses are cut at ``max_response_length`` (counted once per row). A
    prompt over ``max_prompt_length`` marks the row in ``is_drop_mask`` when
    the row starts at the rollout's first call; at a later call,
    ``later_prompt_overflow="response"`` keeps the first ``max_prompt_length``
    tokens as prompt and moves the rest into the response with mask 0
    (``"drop"`` marks the row instead). Rows without a trainable token are
    dropped (counted).

    Rewards: the rollout's reward on the row's last trainable token; with
    ``per_call_rewards``, each call's own reward on its last kept token when
    any call of the row emitted one. Whatever ``per_call_rewards`` says, each
    row keeps its calls apart (``turn_ids``, per token) and each call's own
    reward and state key (the per-call columns, :data:`agl_core.data.CALL_COLUMNS`).
    """
    rows = RowBuilder(max_prompt_length, max_response_length)
    if isinstance(rollouts, Sized):
        rows.reserve(len(rollouts))  # about one row per rollout: its calls merge
    counts = TraceCounts()
    breaks = Breaks(records=[] if keep_break_records else None)
    overflow_to_response = later_prompt_overflow == "response"
    for rollout, reward, calls in trainable_rollouts(rollouts, missing_reward, counts):
        uid, rollout_id = rollout.task_id, rollout.rollout_id
        previous = None
        first_turn = 0  # the open row's first call (its position in the trace)
        broken = False
        for i, call in enumerate(calls):
            prompt = call.prompt_ids
            own = call.reward if per_call_rewards else None
            if previous is not None:
                # Does this prompt extend the previous prompt + response? Two memcmp on the packed buffers.
                packed, before, said = prompt.packed, previous.prompt_ids.packed, previous.response_ids.packed
                context_bytes = len(before) + len(said)
                if (len(packed) >= context_bytes and packed.startswith(before)
                        and packed.startswith(said, len(before))):
                    # What follows the previous context is new (possibly nothing), then the model speaks.
                    # (Counted in bytes of the packed buffers: len() of a TokenIds is a Python call.)
                    rows.add_turn((len(packed) - context_bytes) // TokenIds.itemsize, len(call.response_ids),
                                  call.logprobs, own, **call_columns(call, reward))
                    previous = call
                    continue
                rows.end(previous.prompt_ids, previous.response_ids, uid, rollout_id, first_turn, reward)
                broken = True
                context = previous.prompt_ids.tolist() + previous.response_ids.tolist()
                prompt_list = prompt.tolist()
                kind = (recorded_class(call.context, call.context_reason)
                        or classify_break(context, prompt_list, tokenizer))
                breaks.by_class[kind] += 1
                if breaks.records is not None:
                    breaks.records.append({"rollout_id": rollout_id, "turn_index": call.turn, "class": kind,
                                           "context_reason": call.context_reason,
                                           "first_difference": first_difference(context, prompt_list),
                                           "context_ids": context, "prompt_ids": prompt_list})
            rows.begin(prompt, overflow_to_response=overflow_to_response and i > 0)
            first_turn = call.turn
            rows.add_turn(0, len(call.response_ids), call.logprobs, own, **call_columns(call, reward))
            previous = call
        if previous is not None:
            rows.end(previous.prompt_ids, previous.response_ids, uid, rollout_id, first_turn, reward)
        breaks.rollouts += broken
    return rows.to_batch(pad_token_id), {**counts.metrics(), **rows.metrics(), **breaks.metrics()}, breaks
