"""What a judge is asked about and what it answers: transcripts (of a rollout, or of one turn) and verdicts."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass
class Verdict:
    """A judge's answer about one transcript: its score, or why there is none (``failure``: "failed"/"garbage")."""

    score: float | None
    failure: str | None = None
    reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Transcript:
    """What one verdict is about: a rollout's transcript (``turn`` None) or one turn's, as the policy's token ids."""

    rollout_id: str
    task_id: str
    turn: int | None
    ids: list[int]

    @property
    def key(self) -> tuple[str, int | None]:
        """What its verdict is cached by: (rollout id, turn)."""
        return self.rollout_id, self.turn


def parse_verdict(answer: str, pattern: re.Pattern) -> float | None:
    """The number of the last match of ``pattern`` (its first group) in ``answer``, or None."""
    found = None
    for found in pattern.finditer(answer or ""):
        pass
    if found is None:
        return None
    try:
        return float(found.group(1))
    except (IndexError, TypeError, ValueError):
        return None


def rollout_transcript(rollout) -> Transcript:
    """The rollout's last model call, prompt and response (the prompt holds the conversation before it)."""
    calls = sorted((s for s in rollout.spans if s.kind == "llm_call"), key=lambda s: s.sequence_id)
    if calls:
        ids = list(calls[-1].prompt_token_ids) + list(calls[-1].response_token_ids)
    else:
        ids = [i for t in rollout.triplets[-1:] for i in (*t.prompt_ids, *t.response_ids)]
    return Transcript(rollout.rollout_id, rollout.task_id, None, ids)


def turn_transcripts(rollout, calls, alone: bool) -> list[Transcript]:
    """One transcript per trainable call (``calls``: :func:`agl_plugin_traces.calls.rollout_calls`): its prompt and
    response — the conversation up to and including the turn — or, ``alone``, the turn only: what its prompt adds to
    the previous call's prompt and response (the whole prompt when it does not extend them), then its response."""
    out, previous = [], None
    for call in calls:
        prompt = call.prompt_ids.tolist()
        if alone and previous is not None:
            context = previous.prompt_ids.tolist() + previous.response_ids.tolist()
            if prompt[:len(context)] == context:
                prompt = prompt[len(context):]
        out.append(Transcript(rollout.rollout_id, rollout.task_id, call.turn, prompt + call.response_ids.tolist()))
        previous = call
    return out
