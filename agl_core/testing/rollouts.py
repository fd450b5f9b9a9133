"""Rollouts built by hand, for tests of what reads traces (aggregators, estimators, bridges)."""

from __future__ import annotations

from agl_core.data import Rollout, Span


def multi_turn_rollout(rollout_id: str, task_id: str, rewards: list[float | None], keys: list[str | None], *,
                       response_length: int = 1, final_reward: float = 1.0) -> Rollout:
    """A succeeded rollout whose calls extend one context, one call per entry of ``rewards``.

    The first prompt is ``[1, 2]``; call i answers ``10 + i`` then ``11``s
    (``response_length`` tokens in all), and the observation ``9`` follows it
    in the next call's prompt. ``rewards[i]`` (None: none) is a reward span
    after call i; ``keys[i]`` (None: none) a state-key annotation before it.
    """
    spans, prompt, seq = [], [1, 2], 0
    for i, (reward, key) in enumerate(zip(rewards, keys)):
        if key is not None:
            spans.append(Span(rollout_id=rollout_id, sequence_id=seq, kind="annotation",
                              attributes={"state_key": key}))
            seq += 1
        response = [10 + i] + [11] * (response_length - 1)
        spans.append(Span(rollout_id=rollout_id, sequence_id=seq, kind="llm_call", prompt_token_ids=prompt,
                          response_token_ids=response))
        seq += 1
        if reward is not None:
            spans.append(Span(rollout_id=rollout_id, sequence_id=seq, kind="reward", reward=reward))
            seq += 1
        prompt = prompt + response + [9]
    return Rollout(rollout_id=rollout_id, task_id=task_id, status="succeeded", final_reward=final_reward,
                   spans=spans)
