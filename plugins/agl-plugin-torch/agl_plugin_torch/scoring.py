"""Scoring given tokens: the log-prob the model gives each token of a sequence (vLLM's ``prompt_logprobs``).

A teacher in on-policy distillation (agl-plugin-teachers) sends the
student's prompt + sampled response as a completions ``prompt`` of token ids
with ``prompt_logprobs: k`` and reads, for every token after the first, its
log-prob under this model, its rank and the ``k`` most likely alternatives.
Log-probs are of the raw logits (temperature 1), as the trainer computes the
actor's.

Packed (``packed_prompt_logprobs: true`` beside ``prompt_logprobs: 0``, an
extension of this endpoint's): a choice carries only the given tokens'
log-probs, as the base64 text of their little-endian float32 values
(:func:`pack_logprobs`), no JSON object per token — what a teacher needs, at
a fraction of the cost of building, sending and parsing vLLM's per-token
dictionaries.
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

LOGPROB_BUDGET = 2**26
"""Most log-prob floats one forward pass holds (rows x length x vocabulary, 256 MB): as many rows as fit are
scored together, at least one."""


def _log_probs(model: torch.nn.Module, prompts: Sequence[Sequence[int]],
               pad_token_id: int) -> Iterator[tuple[Sequence[Sequence[int]], torch.Tensor, torch.Tensor]]:
    """``(prompts, log-probs of every next token (rows, width - 1, vocabulary), the given next ids)`` per forward
    pass over as many prompts as :data:`LOGPROB_BUDGET` allows, right-padded together (each is read at its own
    positions)."""
    device = next(model.parameters()).device
    vocabulary = model.get_output_embeddings().weight.shape[0]
    rows_per_forward = max(1, LOGPROB_BUDGET // (max(len(p) for p in prompts) * vocabulary))
    for start in range(0, len(prompts), rows_per_forward):
        part = prompts[start:start + rows_per_forward]
        width = max(len(p) for p in part)
        ids = torch.full((len(part), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for row, prompt in enumerate(part):
            ids[row, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
            mask[row, :len(prompt)] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = torch.arange(width, device=device).expand(len(part), width)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        yield part, torch.log_softmax(logits[:, :-1].float(), dim=-1), ids[:, 1:]


@torch.inference_mode()
def prompt_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], top_k: int,
                    pad_token_id: int) -> list[list[tuple[float, int, list[tuple[int, float]]]]]:
    """For each prompt, per token after the first: ``(log-prob, rank, [(id, log-prob)] * top_k)``.

    ``rank`` is 1 + the number of tokens more likely than the given one.
    """
    out: list[list[tuple[float, int, list[tuple[int, float]]]]] = []
    for part, log_probs, following in _log_probs(model, prompts, pad_token_id):
        chosen = log_probs.gather(-1, following.unsqueeze(-1)).squeeze(-1)
        ranks = (log_probs > chosen.unsqueeze(-1)).sum(-1) + 1
        top = log_probs.topk(top_k, dim=-1) if top_k else None
        chosen, ranks = chosen.tolist(), ranks.tolist()  # one conversion for the whole part, not one per row
        indices, values = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
        for row, prompt in enumerate(part):
            n = len(prompt) - 1
            alternatives = ([list(zip(i, v)) for i, v in zip(indices[row][:n], values[row][:n])]
                            if top is not None else [()] * n)
            out.append(list(zip(chosen[row][:n], ranks[row][:n], alternatives)))
    return out


@torch.inference_mode()
def token_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], pad_token_id: int) -> list[np.ndarray]:
    """For each prompt, the log-prob of each token after the first (float32), no rank and no alternatives."""
    out: list[np.ndarray] = []
    for part, log_probs, following in _log_probs(model, prompts, pad_token_id):
        chosen = log_probs.gather(-1, following.unsqueeze(-1)).squeeze(-1).cpu().numpy()
        out.extend(chosen[row, :len(prompt) - 1] for row, prompt in enumerate(part))
    return out


def pack_logprobs(values: np.ndarray) -> str:
    """The packed form of log-probs: the base64 text of their little-endian float32 bytes."""
    return base64.b64encode(np.ascontiguousarray(values, dtype="<f4").tobytes()).decode("ascii")


def prompt_logprobs_field(scored: list[tuple[float, int, list[tuple[int, float]]]], prompt: Sequence[int],
                          token_text: Callable[[int], str]) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs`` of one choice: None for the first token, then ``{id: {logprob, rank,
    decoded_token}}`` holding the given token and the alternatives."""
    texts: dict[int, str] = {}  # a token's text, decoded once per answer (a decode costs more than the rest)

    def text(token: int) -> str:
        if token not in texts:
            texts[token] = token_text(token)
        return texts[token]

    field: list[dict[str, Any] | None] = [None]
    for token, (logprob, rank, alternatives) in zip(prompt[1:], scored):
        entry = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": text(t)}
                 for i, (t, lp) in enumerate(alternatives)}
        entry[str(token)] = {"logprob": logprob, "rank": rank, "decoded_token": text(token)}
        field.append(entry)
    return field
