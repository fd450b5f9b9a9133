"""Scoring given tokens: the log-prob the model gives each token of a sequence (vLLM's ``prompt_logprobs``).

A teacher in on-policy distillation (agl-plugin-teachers) sends the
student's prompt + sampled response as a completions ``prompt`` of token ids
with ``prompt_logprobs: k`` and reads, for every token after the first, its
log-prob under this model, its rank and the ``k`` most likely alternatives.
Log-probs are of the raw logits (temperature 1), as the trainer computes the
actor's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

ROWS_PER_FORWARD = 8
"""Sequences scored per forward pass: a pass holds (rows, length, vocabulary) floats of log-probs."""


@torch.no_grad()
def prompt_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], top_k: int,
                    pad_token_id: int) -> list[list[tuple[float, int, list[tuple[int, float]]]]]:
    """For each prompt, per token after the first: ``(log-prob, rank, [(id, log-prob)] * top_k)``.

    ``rank`` is 1 + the number of tokens more likely than the given one.
    Prompts are right-padded together; each is read at its own positions.
    """
    device = next(model.parameters()).device
    out: list[list[tuple[float, int, list[tuple[int, float]]]]] = []
    for start in range(0, len(prompts), ROWS_PER_FORWARD):
        part = prompts[start:start + ROWS_PER_FORWARD]
        width = max(len(p) for p in part)
        ids = torch.full((len(part), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for row, prompt in enumerate(part):
            ids[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            mask[row, :len(prompt)] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = torch.arange(width, device=device).expand(len(part), width)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        chosen = log_probs.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        ranks = (log_probs > chosen.unsqueeze(-1)).sum(-1) + 1
        top = log_probs.topk(top_k, dim=-1) if top_k else None
        for row, prompt in enumerate(part):
            n = len(prompt) - 1
            lps, rks = chosen[row, :n].tolist(), ranks[row, :n].tolist()
            alternatives = ([list(zip(i, v)) for i, v in zip(top.indices[row, :n].tolist(),
                                                           top.values[row, :n].tolist())]
                            if top is not None else [[] for _ in range(n)])
            out.append(list(zip(lps, rks, alternatives)))
    return out


def prompt_logprobs_field(scored: list[tuple[float, int, list[tuple[int, float]]]], prompt: Sequence[int],
                          token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of one choice: None for the first token, then ``{id: {logprob, rank,
    decoded_token}}`` holding the given token and the alternatives."""
    field: list[dict[str, Any] | None] = [None]
    for token, (logprob, rank, alternatives) in zip(prompt[1:], scored):
        entry = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": token_text(t)}
                 for i, (t, lp) in enumerate(alternatives)}
        entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": token_text(token)}
        field.append(entry)
    return field
