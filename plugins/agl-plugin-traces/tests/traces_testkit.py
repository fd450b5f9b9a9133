"""Hand-built spans and rollouts for the traces tests, and a reader of batch rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agl_core.data import Batch, Rollout, Span


def logprobs_of(tokens: list[int]) -> list[float]:
    """A made-up log-prob per token, derived from the token so tests can check where each one landed."""
    return [-token / 1024 for token in tokens]


def llm(seq: int, prompt: list[int], response: list[int], logprobs: bool = True, rollout_id: str = "r0",
        **attributes) -> Span:
    return Span(rollout_id=rollout_id, sequence_id=seq, kind="llm_call", prompt_token_ids=prompt,
                response_token_ids=response, response_logprobs=logprobs_of(response) if logprobs else None,
                attributes=attributes)


def reward(seq: int, value: float, rollout_id: str = "r0") -> Span:
    return Span(rollout_id=rollout_id, sequence_id=seq, kind="reward", reward=value)


def rollout(spans: list[Span], rollout_id: str = "r0", task_id: str = "t0", final_reward: float | None = 1.0,
            status: str = "succeeded") -> Rollout:
    return Rollout(rollout_id=rollout_id, task_id=task_id, status=status, final_reward=final_reward, spans=spans)


def conversation(first_prompt: list[int], turns: list[tuple[list[int], list[int]]], rollout_id: str = "r0",
                 first_seq: int = 0) -> list[Span]:
    """The spans of an agent whose every prompt extends the previous one.

    ``turns`` is ``[(observation, response), ...]``: the first observation is
    ignored (the first prompt is ``first_prompt``); later prompts are the
    previous prompt + previous response + the turn's observation.
    """
    spans, prompt = [], list(first_prompt)
    for i, (observation, response) in enumerate(turns):
        if i:
            prompt = prompt + spans[-1].response_token_ids + observation
        spans.append(llm(first_seq + i, prompt, response, rollout_id=rollout_id))
    return spans


@dataclass
class Row:
    """One batch row read back without padding."""

    prompt: list[int]
    response: list[int]
    mask: list[int]
    logprobs: list[float] | None
    scores: list[float]
    drop: bool
    uid: str
    rollout_id: str
    turn_index: int

    @property
    def trained(self) -> list[int]:
        """The response tokens with mask 1."""
        return [t for t, m in zip(self.response, self.mask) if m]


def rows(batch: Batch) -> list[Row]:
    """The rows of ``batch``, checking on the way that the tensors agree with each other."""
    P = batch["prompts"].shape[1]
    out = []
    for i in range(len(batch)):
        attention = batch["attention_mask"][i]
        prompt_len, response_len = int(attention[:P].sum()), int(attention[P:].sum())
        assert attention[:P].tolist() == [0] * (P - prompt_len) + [1] * prompt_len  # left padding
        assert attention[P:].tolist()[:response_len] == [1] * response_len  # right padding
        assert torch.equal(batch["input_ids"][i], torch.cat([batch["prompts"][i], batch["responses"][i]]))
        expected_positions = (attention.cumsum(-1) - 1).clamp(min=0)
        assert torch.equal(batch["position_ids"][i], expected_positions)
        mask = batch["response_mask"][i]
        assert not bool(mask[response_len:].any()), "mask 1 on padding"
        logprobs = None
        if "rollout_log_probs" in batch:
            row_logprobs = batch["rollout_log_probs"][i]
            assert not bool(row_logprobs[mask == 0].any()), "log-prob on a masked token"
            logprobs = row_logprobs[:response_len].tolist()
        out.append(Row(prompt=batch["prompts"][i, P - prompt_len:].tolist(),
                       response=batch["responses"][i, :response_len].tolist(),
                       mask=mask[:response_len].tolist(), logprobs=logprobs,
                       scores=batch["token_level_scores"][i].tolist(), drop=bool(batch["is_drop_mask"][i]),
                       uid=batch["uid"][i], rollout_id=batch["rollout_id"][i],
                       turn_index=int(batch["turn_index"][i])))
    return out


def score_at(row: Row) -> dict[int, float]:
    """The non-zero scores of a row by response position."""
    return {i: s for i, s in enumerate(row.scores) if s}
