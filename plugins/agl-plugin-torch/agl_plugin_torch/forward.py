"""Per-token quantities of the response tokens of training rows: log-probs, entropy, values.

Rows are laid out as the trace aggregators make them: ``input_ids`` is a
left-padded prompt of P columns followed by a right-padded response of R
columns (``responses``). Response token ``j`` is predicted from position
``P + j - 1``, so its log-prob (and its value) is read there. Columns that
no row attends to are cut off before the forward pass: a batch whose longest
row is short costs what a short batch costs, whatever P and R are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from agl_core.algorithms.losses import entropy_from_logits


def attended_span(attention_mask: torch.Tensor, prompt_width: int) -> tuple[int, int]:
    """``(first, end)``: the columns some row attends to, widened to keep the last prompt column.

    The last prompt column predicts the first response token, so it is
    always kept, as is one response column.
    """
    used = attention_mask.any(dim=0).nonzero().flatten()
    if used.numel() == 0:
        return prompt_width - 1, prompt_width + 1
    first = min(int(used[0]), prompt_width - 1)
    end = max(int(used[-1]) + 1, prompt_width + 1)
    return first, end


def response_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      position_ids: torch.Tensor, responses: torch.Tensor,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy)`` of the response tokens under ``model``, each ``(B, R)`` float32.

    ``log_probs[b, j] = log softmax(logits)[responses[b, j]]`` of the raw
    logits (temperature 1), what the policy endpoint reports for a sampled
    token. ``entropy`` is that distribution's entropy (None unless asked).
    Columns past the last attended one are 0. Gradients flow when enabled.
    """
    width, response_width = input_ids.shape[1], responses.shape[1]
    prompt_width = width - response_width
    first, end = attended_span(attention_mask, prompt_width)
    kept = end - prompt_width  # response columns that hold a token in some row
    # logits_to_keep: only the kept+1 last positions are projected on the vocabulary.
    logits = model(input_ids=input_ids[:, first:end], attention_mask=attention_mask[:, first:end],
                   position_ids=position_ids[:, first:end], use_cache=False, logits_to_keep=kept + 1).logits
    logits = logits[:, :-1].float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, responses[:, :kept].unsqueeze(-1)).squeeze(-1)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return _pad_right(log_probs, response_width), None if entropy is None else _pad_right(entropy, response_width)


def response_values(critic: Callable[..., torch.Tensor], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, response_width: int) -> torch.Tensor:
    """Values ``(B, R)`` of the response positions: the critic's output where each token is chosen."""
    prompt_width = input_ids.shape[1] - response_width
    first, end = attended_span(attention_mask, prompt_width)
    values = critic(input_ids[:, first:end], attention_mask[:, first:end], position_ids[:, first:end])
    return _pad_right(values[:, prompt_width - first - 1:-1], response_width)


def _pad_right(x: torch.Tensor, width: int) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, width - x.shape[1]))
