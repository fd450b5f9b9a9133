"""Batched sampling with a KV cache: token ids and their log-probs for many prompts at once.

Every row of a batch has its own sampling parameters (temperature, top-p,
top-k, token limit, stop strings and tokens, seed). The log-prob reported for
a sampled token is that of the model's own distribution, ``log_softmax`` of
the raw logits, before temperature, top-p or top-k reshape the distribution
that is sampled from (vLLM's default ``raw_logprobs``). It is therefore the
quantity the trainer recomputes for the same tokens: with temperature 1 and
no truncation the rollout is on-policy and both agree up to float noise.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import StaticCache

STOP, LENGTH = "stop", "length"
DYNAMIC, STATIC = "dynamic", "static"
"""The KV caches :func:`generate` can use (``serving.kv_cache``)."""

SEED_SPACE = 2**64
"""Seeds are taken modulo this, the range of ``torch.Generator.manual_seed`` (which itself wraps negative seeds
so): any int seeds a row, and a seed torch takes seeds the same stream as in torch."""


@dataclass(frozen=True)
class SamplingParams:
    """How one row is sampled. ``temperature`` 0 is greedy; ``top_k`` 0 and ``top_p`` 1 switch those off.

    ``seed`` may be any int (it is taken modulo :data:`SEED_SPACE`).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    top_logprobs: int = 0


@dataclass
class Sample:
    """What was generated for one row.

    ``token_ids`` include the token that ended the row (EOS or a stop token),
    as vLLM returns them; ``text`` is their decoding without special tokens,
    cut before the first stop string. ``top_logprobs`` holds, per token, the
    ``params.top_logprobs`` most likely (id, log-prob) pairs.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str = LENGTH
    text: str = ""


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of the prompts, left-padded to the longest one."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt):] = torch.as_tensor(prompt, dtype=torch.long)
            attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def position_ids_of(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over the attended tokens only (left padding does not shift them)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def sampling_distribution(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                          top_p: torch.Tensor) -> torch.Tensor:
    """Probabilities to sample from: ``softmax(logits / T)`` restricted to the top-k and the top-p nucleus.

    ``logits`` (B, V) float; ``temperature`` (B,) > 0, ``top_k`` (B,) long (0: all tokens),
    ``top_p`` (B,) in (0, 1]. The most likely token always stays in.
    """
    z = logits / temperature.unsqueeze(-1)
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        sorted_z, order = z.sort(dim=-1, descending=True)
        rank = torch.arange(z.shape[-1], device=z.device).expand_as(z)
        k = torch.where(top_k > 0, top_k, z.shape[-1]).unsqueeze(-1)
        drop = rank >= k
        probs = torch.softmax(sorted_z.masked_fill(drop, -torch.inf), dim=-1)
        # A token leaves the nucleus when the mass before it already reaches top_p.
        drop |= (probs.cumsum(-1) - probs) >= top_p.unsqueeze(-1)
        drop[:, 0] = False
        z = z.scatter(-1, order, sorted_z.masked_fill(drop, -torch.inf))
    return torch.softmax(z, dim=-1)


class _Rows:
    """Per-row sampling parameters as tensors, and one generator for each seeded row."""

    def __init__(self, params: Sequence[SamplingParams], device: torch.device):
        self.params = params
        self.greedy = torch.tensor([p.temperature == 0 for p in params], device=device)
        self.temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        self.top_p = torch.tensor([p.top_p for p in params], device=device)
        self.seeded = [(row, torch.Generator(device=device).manual_seed(p.seed % SEED_SPACE))
                       for row, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        self.shared = [row for row, p in enumerate(params) if p.seed is None and p.temperature > 0]
        self.all_greedy = bool(self.greedy.all())

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The next token of every row: argmax for greedy rows, a sample for the others."""
        tokens = logits.argmax(dim=-1)
        if self.all_greedy:
            return tokens
        probs = sampling_distribution(logits, self.temperature, self.top_k, self.top_p)
        if self.shared:
            rows = torch.tensor(self.shared, device=logits.device)
            tokens[rows] = torch.multinomial(probs[rows], 1, generator=generator).squeeze(-1)
        for row, row_generator in self.seeded:  # each seeded row draws from its own stream: batching cannot change it
            tokens[row] = torch.multinomial(probs[row], 1, generator=row_generator).squeeze(-1)
        return tokens


@torch.no_grad()
def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], *,
             eos_token_ids: Sequence[int], pad_token_id: int, decode: Callable[[list[int]], str],
             generator: torch.Generator | None = None,
             on_step: Callable[[list[Sample], list[int]], None] | None = None,
             kv_cache: str = DYNAMIC, decode_forward: Callable[..., object] | None = None) -> list[Sample]:
    """Sample a continuation of every prompt; one :class:`Sample` per prompt, in order.

    A row ends on an EOS token (unless ``ignore_eos``), one of its
    ``stop_token_ids``, a ``stop`` string appearing in its decoded text
    (finish reason ``"stop"``), or after ``max_tokens`` tokens (``"length"``).
    Unseeded rows draw from ``generator`` in row order; a seeded row draws
    from its own generator, so its sample does not depend on the batch it
    was in. ``decode(ids)`` must drop special tokens. ``on_step(samples,
    rows)``, when given, is called after each step with the rows that got a
    token in it (their last token, log-prob and alternatives are the new ones):
    what streaming reads.

    ``kv_cache``: ``"dynamic"`` grows the cache a token at a time;
    ``"static"`` allocates it whole on the model's device (prompt + longest
    response), with an attention mask of that fixed width, so every decode
    step has the same shapes: what ``decode_forward``, a compiled
    ``model.forward`` (CUDA graphs), needs. Both give the same samples.
    """
    device = next(model.parameters()).device
    rows = _Rows(params, device)
    samples = [Sample() for _ in prompts]
    input_ids, attention_mask = left_pad(prompts, pad_token_id)
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = position_ids_of(attention_mask)
    eos = set(eos_token_ids)
    stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else eos) for p in params]
    texts: dict[int, str] = {}  # rows cut at a stop string
    active = list(range(len(prompts)))
    max_new = max(p.max_tokens for p in params)
    prompt_width = input_ids.shape[1]
    cache, forward = None, model
    if kv_cache == STATIC:
        cache = StaticCache(config=model.config, max_cache_len=prompt_width + max_new)
        attention_mask = torch.cat([attention_mask, attention_mask.new_zeros(len(prompts), max_new)], dim=-1)
    elif kv_cache != DYNAMIC:
        raise ValueError(f"kv_cache must be {DYNAMIC!r} or {STATIC!r}, got {kv_cache!r}")
    # Off the CPU only the last position is projected on the vocabulary (a (B, P, V) prefill's logits are
    # gigabytes at a real vocabulary); on the CPU the full projection is kept: its rounding is what the golden
    # runs of the tests recorded.
    keep = {} if device.type == "cpu" else {"logits_to_keep": 1}
    for step in range(max_new):
        out = forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      past_key_values=cache, use_cache=True, **keep)
        cache = out.past_key_values
        if decode_forward is not None:
            forward = decode_forward  # the prefill ran eagerly; the decode steps, of one shape, run compiled
        logits = out.logits[:, -1].float()
        tokens = rows.choose(logits, generator)
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
        want_top = max(params[row].top_logprobs for row in active)
        if want_top:
            top_values, top_ids = logprobs.topk(min(want_top, logprobs.shape[-1]), dim=-1)
        still = []
        token_list = tokens.tolist()
        for row in active:
            sample, p, token = samples[row], params[row], token_list[row]
            sample.token_ids.append(token)
            sample.logprobs.append(chosen[row])
            if p.top_logprobs:
                sample.top_logprobs.append(list(zip(top_ids[row, :p.top_logprobs].tolist(),
                                                    top_values[row, :p.top_logprobs].tolist())))
            if token in stops[row]:
                sample.finish_reason = STOP
            elif p.stop and (text := _cut_at_stop(decode(sample.token_ids), p.stop)) is not None:
                sample.finish_reason, texts[row] = STOP, text
            elif len(sample.token_ids) < p.max_tokens:
                still.append(row)
        if on_step is not None:
            on_step(samples, active)
        active = still
        if not active:
            break
        # Every row advances by one token (finished rows too, unread): the cache stays rectangular.
        input_ids = tokens.unsqueeze(-1)
        if kv_cache == STATIC:
            attention_mask = attention_mask.clone()  # a new tensor: a compiled step may hold the last one
            attention_mask[:, prompt_width + step] = 1
        else:
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(prompts), 1)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
    for row, sample in enumerate(samples):
        sample.text = texts[row] if row in texts else decode(sample.token_ids)
    return samples


def _cut_at_stop(text: str, stop: tuple[str, ...]) -> str | None:
    """``text`` up to its first stop string, or None when it holds none."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return None if cut < 0 else text[:cut]
