"""Token capture: the exact prompt ids, response ids and log-probs of a model call, read from the upstream's answer.

The gateway asks the upstream for them (vLLM's ``return_token_ids`` and
``logprobs``); these functions find them in the response of either endpoint
and say what is missing. Token ids are never made by re-tokenizing text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT, COMPLETIONS = "chat.completions", "completions"

NO_TOKEN_IDS = ("the upstream returned no token ids (it must support vLLM's return_token_ids, "
                "vLLM >= 0.10.2); this call cannot be trained on")


@dataclass(frozen=True)
class Captured:
    """What one choice of a response holds for training."""

    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float] | None
    error: str | None = None


def ask_for_tokens(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with the upstream asked for token ids and the sampled tokens' log-probs (the agent's choices kept)."""
    out = dict(body)
    out["return_token_ids"] = True
    if endpoint == CHAT:
        out["logprobs"] = True
    elif out.get("logprobs") is None:
        out["logprobs"] = 0  # completions: 0 alternatives, the sampled token's log-prob only
    return out


def capture(endpoint: str, response: dict[str, Any]) -> list[Captured]:
    """One :class:`Captured` per choice of an upstream ``response`` of ``endpoint``, in choice order."""
    top_prompt = response.get("prompt_token_ids")
    out = []
    for choice in response.get("choices") or []:
        prompt = top_prompt if top_prompt is not None else choice.get("prompt_token_ids")
        ids = choice.get("token_ids")
        if prompt is None or ids is None:
            out.append(Captured(list(prompt or []), list(ids or []), None, NO_TOKEN_IDS))
            continue
        logprobs = _logprobs(endpoint, choice.get("logprobs"))
        if logprobs is not None and len(logprobs) != len(ids):
            error = f"the upstream returned {len(logprobs)} log-probs for {len(ids)} response tokens"
            out.append(Captured(list(prompt), list(ids), None, error))
            continue
        out.append(Captured(list(prompt), list(ids), logprobs))
    return out


def _logprobs(endpoint: str, logprobs: Any) -> list[float] | None:
    if not isinstance(logprobs, dict):
        return None
    if endpoint == CHAT:
        content = logprobs.get("content")
        return None if content is None else [float(entry["logprob"]) for entry in content]
    values = logprobs.get("token_logprobs")
    return None if values is None else [float(v) for v in values]


TOKEN_FIELDS = ("prompt_token_ids", "token_ids", "logprobs")


def without_token_fields(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` without the token-level fields a span already holds as its own fields.

    Kept whole, the per-token log-prob objects would be most of a span's size
    and most of the objects a store keeps alive.
    """
    out = {key: value for key, value in response.items() if key not in TOKEN_FIELDS}
    if isinstance(out.get("choices"), list):
        out["choices"] = [{k: v for k, v in choice.items() if k not in TOKEN_FIELDS} if isinstance(choice, dict)
                          else choice for choice in out["choices"]]
    return out
