"""Helpers of the LoRA plugin's tests: a tiny model's recipe section, an adapted backend, sampled rows, a PPO update."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from agl_core.algorithms.losses import ppo_clip_loss
from agl_core.config import AlgorithmConfig
from agl_core.data import Batch

from agl_plugin_torch.backend import Backend, create
from agl_plugin_torch.sampling import SamplingParams, generate, left_pad, position_ids_of
from agl_plugin_torch.settings import TorchConfig

from agl_plugin_lora.embedded import adapt_actor
from agl_plugin_lora.settings import LoraSettings

VOCABULARY = [str(i) for i in range(10)] + ["guess", "a", "number", "higher", "lower", "hello", "world", ","]


def tiny_section(**overrides) -> dict:
    """The ``plugins.torch`` section of a tiny llama over :data:`VOCABULARY` (two layers: adapters stack)."""
    section = {"model": {"build": {"vocabulary": VOCABULARY, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                                   "max_position_embeddings": 64}},
               "actor": {"lr": 0.05, "weight_decay": 0.0}, "num_threads": 1}
    section.update(overrides)
    return section


def adapted_backend(tmp_path, settings: LoraSettings, **section) -> Backend:
    """A torch backend (not serving) made with the plugin's actor transform, as a run with ``plugins.lora`` is."""
    ctx = SimpleNamespace(slots={}, plugin_config=lambda name: settings)  # no KL term: no reference slot to check
    return create(TorchConfig.model_validate(tiny_section(**section)), tmp_path, seed=0, with_critic=False,
                  transforms=[lambda actor: adapt_actor(actor, ctx)])


def sampled_rows(backend, n=8, seed=0, width=6) -> Batch:
    """``n`` sampled responses to one chat prompt, as the trace aggregators lay rows out."""
    tokenizer = backend.tokenizer
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "guess a number"}],
                                           add_generation_prompt=True, return_dict=False)
    samples = generate(backend.actor, [prompt] * n, [SamplingParams(max_tokens=width, ignore_eos=True)] * n,
                       eos_token_ids=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
                       decode=tokenizer.decode, generator=torch.Generator().manual_seed(seed))
    prompt_ids, prompt_mask = left_pad([prompt] * n, 0)
    responses = torch.tensor([s.token_ids for s in samples])
    response_mask = torch.ones_like(responses)
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    return Batch({"prompts": prompt_ids, "responses": responses, "response_mask": response_mask,
                  "input_ids": torch.cat([prompt_ids, responses], dim=1), "attention_mask": attention_mask,
                  "position_ids": position_ids_of(attention_mask)},
                 {"uid": np.array(["task"] * n, dtype=object)})


def policy_loss(old_log_prob, log_prob, advantages, response_mask, config):
    """The ``vanilla`` policy loss, as the core's estimators plugin registers it."""
    return ppo_clip_loss(old_log_prob, log_prob, advantages, response_mask, clip_ratio=config.clip_ratio,
                         loss_agg_mode=config.loss_agg_mode)


def algorithm(**overrides) -> AlgorithmConfig:
    return AlgorithmConfig(**{"ppo_mini_batch_size": 8, "ppo_epochs": 2, **overrides})
