"""Spans → calls: the model calls of one rollout that can be trained on, in order, with their rewards.

A rollout records ``llm_call`` spans (the exact prompt and response token ids
of each call, as the serving engine saw and returned them) and ``reward``
spans. This module orders the calls by ``sequence_id``, keeps only those a
trainer can use, and attaches each reward span to the call it rewards. A
call holds the span's own packed :class:`~agl_core.data.TokenIds` and
:class:`~agl_core.data.LogProbs`, never copied: the aggregators compare and
copy their raw buffers (``.packed``), with no Python object per token.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from agl_core.data import (REWARD_FROM_CALL, REWARD_FROM_JUDGE, REWARD_FROM_ROLLOUT, REWARD_SOURCE_KEY, LogProbs,
                           Rollout, TokenIds, Triplet)
from agl_core.rollout.agents import STATE_KEY


@dataclass(slots=True)
class Call:
    """One model call kept for training.

    ``turn`` is the call's position among the rollout's ``llm_call`` spans by
    sequence id, skipped calls included (a triplet's own ``turn_index``), so it
    names the same call in the trace whatever was skipped before it.
    ``reward`` is the call's own reward, the sum of the reward spans attached
    to it, or None when none was emitted for it; ``reward_source`` says who
    gave it (:data:`~agl_core.data.REWARD_FROM_CALL`: the agent,
    :data:`~agl_core.data.REWARD_FROM_JUDGE`: a judge, when any of its reward
    spans is a judge's), None without one. ``state_key`` is the
    state the agent said the call was made in (:func:`agl_core.rollout.agents.emit_state_key`),
    or None.
    """

    prompt_ids: TokenIds
    response_ids: TokenIds
    logprobs: LogProbs | None
    turn: int
    reward: float | None = None
    agent_name: str | None = None
    state_key: str | None = None
    context: str | None = None  # how the gateway made the prompt (agl_core.gateway.contexts), and why
    context_reason: str | None = None
    reward_source: str | None = None


@dataclass
class TraceCounts:
    """What became of the rollouts and model calls of a batch (reported as ``training/…`` metrics)."""

    rollouts: int = 0
    rollouts_skipped: int = 0
    rollouts_without_reward: int = 0
    kept: int = 0
    empty: int = 0
    error: int = 0
    incomplete: int = 0
    retried: int = 0
    rewards: int = 0
    rewards_unattached: int = 0

    def metrics(self) -> dict[str, float]:
        return {
            "training/n_rollouts": float(self.rollouts),
            "training/n_rollouts_skipped": float(self.rollouts_skipped),
            "training/n_rollouts_without_reward": float(self.rollouts_without_reward),
            "training/n_calls": float(self.kept),
            "training/n_calls_empty": float(self.empty),
            "training/n_calls_error": float(self.error),
            "training/n_calls_incomplete": float(self.incomplete),
            "training/n_calls_retried": float(self.retried),
            "training/n_call_rewards": float(self.rewards),
            "training/n_call_rewards_unattached": float(self.rewards_unattached),
        }


_by_sequence = attrgetter("sequence_id")


def _token_ids(ids) -> TokenIds:
    # Spans validated by pydantic hold TokenIds already; model_construct'ed spans and triplets may hold lists.
    return ids if type(ids) is TokenIds else TokenIds(ids)


def _logprobs(logprobs) -> LogProbs | None:
    return logprobs if logprobs is None or type(logprobs) is LogProbs else LogProbs(logprobs)


def rollout_calls(rollout: Rollout, counts: TraceCounts) -> list[Call]:
    """The trainable model calls of ``rollout`` in call order, with their per-call rewards.

    From spans: ``llm_call`` spans sorted by ``sequence_id``; a call without
    prompt or response tokens, or whose ``attributes["error"]`` is truthy, is
    skipped, and so is (counted apart) a call whose ``attributes["incomplete"]``
    is truthy: a streamed answer the agent stopped reading, which it never
    acted on whole; a call with the same prompt ids as earlier calls is a retry and
    replaces them (only the last is kept), except the further choices of one
    request (``attributes["choice_index"]`` 1, 2, …), which are samples.
    A ``reward`` span rewards the closest preceding ``llm_call`` span; when that
    call was skipped, its reward is counted as unattached. Several rewards of
    one call add up; a reward span whose ``attributes["reward_source"]`` is
    ``"judge"`` (a judge's, agl-plugin-teachers) marks the call's reward as
    the judge's. An ``annotation`` span with a ``state_key`` attribute
    (:func:`agl_core.rollout.agents.emit_state_key`) names the state of the next
    ``llm_call`` span (the last such annotation before the call wins); a retry
    keeps the state key of the call it replaces unless it was given its own.

    A rollout that carries ``triplets`` and no ``llm_call`` spans is taken as
    it is: one call per triplet, in the given order, ``Triplet.reward`` as the
    call's reward.
    """
    llm, rewards, states = [], [], []
    for span in rollout.spans:
        kind = span.kind
        if kind == "llm_call":
            llm.append(span)
        elif kind == "reward" and span.reward is not None:
            rewards.append(span)
        elif kind == "annotation" and span.attributes.get(STATE_KEY) is not None:
            states.append(span)
    llm.sort(key=_by_sequence)
    if not llm and rollout.triplets:
        counts.kept += len(rollout.triplets)
        return [Call(_token_ids(t.prompt_ids), _token_ids(t.response_ids), _logprobs(t.response_logprobs),
                     t.turn_index, t.reward, t.metadata.get("agent_name"), state_key_text(t.metadata.get(STATE_KEY)),
                     reward_source=None if t.reward is None else triplet_reward_source(t))
                for t in rollout.triplets]
    sequence_ids = [s.sequence_id for s in llm]
    # A state key names the state of the next call: the last one given before it (and after the call before it).
    state_keys: dict[int, str] = {}
    for span in sorted(states, key=_by_sequence):
        state_keys[bisect.bisect_right(sequence_ids, span.sequence_id)] = state_key_text(span.attributes[STATE_KEY])

    calls: list[Call | None] = []
    same_length: dict[int, list[int]] = {}  # prompt length -> indices of the kept calls with a prompt that long
    for turn, span in enumerate(llm):
        attributes = span.attributes
        prompt, response = span.prompt_token_ids, span.response_token_ids
        if type(prompt) is not TokenIds:
            prompt = TokenIds(prompt)
        if type(response) is not TokenIds:
            response = TokenIds(response)
        packed = prompt.packed
        skipped = ("incomplete" if attributes and attributes.get("incomplete")
                   else "error" if attributes and attributes.get("error")
                   else "empty" if not packed or not response.packed else None)
        if skipped is not None:
            setattr(counts, skipped, getattr(counts, skipped) + 1)
            calls.append(None)
            if turn in state_keys:  # the call that follows a failed one (its retry) is made in the same state
                state_keys.setdefault(turn + 1, state_keys[turn])
            continue
        # A retry re-sends the same prompt: the later call replaces the earlier one.
        # The length only narrows the candidates; equal prompts are confirmed by comparing the buffers.
        candidates = same_length.get(len(packed))
        if candidates is None:
            same_length[len(packed)] = [len(calls)]
        else:
            if not (attributes and attributes.get("choice_index")):  # choices 1, 2, ... of a request are samples
                for earlier in [i for i in candidates if calls[i].prompt_ids.packed == packed]:
                    # A retry is made in the state of the call it repeats, unless the agent named another.
                    state_keys.setdefault(turn, calls[earlier].state_key)
                    calls[earlier] = None
                    candidates.remove(earlier)
                    counts.retried += 1
            candidates.append(len(calls))
        logprobs = span.response_logprobs
        if logprobs is not None and type(logprobs) is not LogProbs:
            logprobs = LogProbs(logprobs)
        attributes = attributes or {}
        calls.append(Call(prompt, response, logprobs, turn, agent_name=attributes.get("agent_name"),
                          state_key=state_keys.get(turn), context=attributes.get("context"),
                          context_reason=attributes.get("context_reason")))

    if rewards:
        for span in rewards:
            target = bisect.bisect_right(sequence_ids, span.sequence_id) - 1
            call = calls[target] if target >= 0 else None
            if call is None:
                counts.rewards_unattached += 1
                continue
            call.reward = span.reward if call.reward is None else call.reward + span.reward
            if call.reward_source != REWARD_FROM_JUDGE:
                judged = span.attributes and span.attributes.get(REWARD_SOURCE_KEY) == REWARD_FROM_JUDGE
                call.reward_source = REWARD_FROM_JUDGE if judged else REWARD_FROM_CALL
            counts.rewards += 1

    kept = [c for c in calls if c is not None]
    counts.kept += len(kept)
    return kept


def call_columns(call: Call, rollout_reward: float) -> dict[str, Any]:
    """What the per-call columns keep of ``call`` (:meth:`RowBuilder.add_turn`'s keywords)."""
    own = call.reward is not None
    return {"turn": call.turn, "call_reward": call.reward if own else rollout_reward,
            "reward_source": call.reward_source if own else REWARD_FROM_ROLLOUT, "state_key": call.state_key}


def triplet_reward_source(triplet: Triplet) -> str:
    """Who gave a triplet's reward: a judge when its metadata says so (:func:`to_triplets`), else the agent."""
    return REWARD_FROM_JUDGE if triplet.metadata.get(REWARD_SOURCE_KEY) == REWARD_FROM_JUDGE else REWARD_FROM_CALL


def state_key_text(key: Any) -> str | None:
    """A state key as the rows hold it: a string as it is, any other JSON value as its canonical JSON text."""
    if key is None or isinstance(key, str):
        return key
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def rollout_reward(rollout: Rollout, missing_reward: float | None) -> float | None:
    """The rollout's reward: ``final_reward``, else ``missing_reward`` (None: the rollout cannot be trained on)."""
    return rollout.final_reward if rollout.final_reward is not None else missing_reward


def trainable_rollouts(rollouts: Iterable[Rollout], missing_reward: float | None,
                       counts: TraceCounts) -> Iterator[tuple[Rollout, float, list[Call]]]:
    """``(rollout, its reward, its calls)`` for every rollout that can be trained on.

    Skipped (and counted): rollouts whose status is not ``"succeeded"``. A
    rollout without a reward is counted and gets ``missing_reward``, or is
    skipped when that is None.
    """
    for rollout in rollouts:
        if rollout.status != "succeeded":
            counts.rollouts_skipped += 1
            continue
        if rollout.final_reward is None:
            counts.rollouts_without_reward += 1
            if missing_reward is None:
                continue
        counts.rollouts += 1
        yield rollout, rollout_reward(rollout, missing_reward), rollout_calls(rollout, counts)


def to_triplets(rollout: Rollout, missing_reward: float | None = 0.0) -> list[Triplet]:
    """The rollout's trainable calls as :class:`~agl_core.data.Triplet` records.

    A triplet's reward is the call's own reward where the agent (or a judge) emitted one
    (``metadata["reward_source"]`` ``"call"``, or ``"judge"``), else the rollout's reward
    (``"rollout"``); ``metadata["state_key"]`` is the call's state key. The
    triplets hold lists, as :class:`~agl_core.data.Triplet` declares.
    """
    final = rollout_reward(rollout, missing_reward)
    triplets = []
    for call in rollout_calls(rollout, TraceCounts()):
        own = call.reward is not None
        # model_construct: the spans were validated already.
        triplets.append(Triplet.model_construct(
            prompt_ids=call.prompt_ids.tolist(), response_ids=call.response_ids.tolist(),
            response_logprobs=None if call.logprobs is None else call.logprobs.tolist(),
            reward=call.reward if own else final, rollout_id=rollout.rollout_id, turn_index=call.turn,
            metadata={"agent_name": call.agent_name, REWARD_SOURCE_KEY: call.reward_source if own else REWARD_FROM_ROLLOUT,
                      STATE_KEY: call.state_key}))
    return triplets
