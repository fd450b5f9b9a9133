"""Test helpers for the embedded backend and the plugins built on it (agl-plugin-lora, ...).

A tiny llama made from a config (no download), prompts and samples from its
backend, training rows laid out as the trace aggregators make them, and the
pieces of a PPO update. Import them in tests; put :func:`restore_torch_threads`
in a ``conftest.py`` (``from agl_plugin_torch.testing import restore_torch_threads``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agl_core.config import AlgorithmConfig
from agl_core.data import Batch

from agl_plugin_torch.forward import response_logprobs
from agl_plugin_torch.sampling import SamplingParams, generate, left_pad, position_ids_of

VOCABULARY = [str(i) for i in range(10)] + ["guess", "a", "number", "higher", "lower", "hello", "world", ","]


@pytest.fixture(autouse=True)
def restore_torch_threads():
    """The backend sets torch's thread count for its run; give it back so other tests keep their own."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_section(num_layers: int = 1, lr: float = 0.01, **overrides) -> dict:
    """The ``plugins.torch`` section of a tiny llama (hidden 32, about 20k parameters a layer) over :data:`VOCABULARY`."""
    section = {"model": {"build": {"vocabulary": VOCABULARY, "hidden_size": 32, "num_layers": num_layers,
                                   "num_heads": 2, "max_position_embeddings": 64}},
               "actor": {"lr": lr, "weight_decay": 0.0}, "num_threads": 1}
    section.update(overrides)
    return section


def prompt(backend, text: str) -> list[int]:
    """The chat prompt ids of one user message."""
    return backend.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 return_dict=False)


def sample(backend, prompts, params, generator=None):
    """:func:`generate` with the backend's model and tokenizer."""
    tokenizer = backend.tokenizer
    return generate(backend.actor, prompts, params, eos_token_ids=[tokenizer.eos_token_id],
                    pad_token_id=tokenizer.pad_token_id,
                    decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                    generator=generator or torch.Generator().manual_seed(0))


def full_forward_logprobs(backend, prompt_ids, response_ids) -> list[float]:
    """Log-probs of ``response_ids`` after ``prompt_ids`` from one forward pass over the whole sequence."""
    input_ids, attention_mask = left_pad([prompt_ids + response_ids], 0)
    with torch.no_grad():
        log_probs, _ = response_logprobs(backend.actor, input_ids, attention_mask, position_ids_of(attention_mask),
                                         torch.tensor([response_ids]))
    return log_probs[0].tolist()


def rows(prompts, responses, prompt_width=12, response_width=8) -> Batch:
    """Training rows laid out as the trace aggregators make them (left-padded prompt, right-padded response)."""
    n = len(prompts)
    prompt_ids, prompt_mask = left_pad([p[-prompt_width:] for p in prompts], 0)
    prompt_ids = torch.nn.functional.pad(prompt_ids, (prompt_width - prompt_ids.shape[1], 0))
    prompt_mask = torch.nn.functional.pad(prompt_mask, (prompt_width - prompt_mask.shape[1], 0))
    response_ids = torch.zeros(n, response_width, dtype=torch.long)
    response_mask = torch.zeros(n, response_width, dtype=torch.long)
    for i, response in enumerate(responses):
        response_ids[i, :len(response)] = torch.tensor(response[:response_width])
        response_mask[i, :len(response)] = 1
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({"prompts": prompt_ids, "responses": response_ids, "response_mask": response_mask,
                  "input_ids": torch.cat([prompt_ids, response_ids], dim=1), "attention_mask": attention_mask,
                  "position_ids": position_ids_of(attention_mask)},
                 {"uid": np.array(["task"] * n, dtype=object)})


def sampled_rows(backend, n=16, seed=0, max_tokens=6) -> Batch:
    """``n`` sampled responses to one prompt as training rows, with their ``old_log_probs`` under the actor."""
    p = prompt(backend, "guess a number")
    samples = sample(backend, [p] * n, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * n,
                     generator=torch.Generator().manual_seed(seed))
    batch = rows([p] * n, [s.token_ids for s in samples], response_width=max(8, max_tokens))
    batch["old_log_probs"], _ = backend.logprobs(backend.actor, batch, with_entropy=False)
    return batch


def algorithm(**overrides) -> AlgorithmConfig:
    """The recipe's ``algorithm`` section for a small update: mini-batches of 16 rows, one epoch."""
    return AlgorithmConfig(**{"ppo_mini_batch_size": 16, "ppo_epochs": 1, **overrides})
