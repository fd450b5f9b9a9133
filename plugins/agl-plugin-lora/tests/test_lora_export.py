"""A checkpoint whose adapter trains copies of the tied embeddings (``modules_to_save``) resumes and merges exactly.

With tied embeddings (the made models tie the output head to the input
embedding), trained copies of ``embed_tokens`` and ``lm_head`` no longer hold
the same matrix: the merged model must be saved untied, or it would compute
something else than the adapted actor.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from agl_plugin_lora.export import merge
from agl_plugin_lora.settings import LoraSettings
from agl_plugin_torch.testing import sampled_rows
from lora_testkit import adapted_backend
from test_lora_reference import train

SETTINGS = LoraSettings(rank=4, alpha=8, modules_to_save=["embed_tokens", "lm_head", "norm"])


def test_lora_trained_embedding_copies_resume_and_merge_to_the_same_logprobs(tmp_path):
    backend = adapted_backend(tmp_path / "a", SETTINGS)
    assert backend.actor.config.tie_word_embeddings
    batch = sampled_rows(backend)
    train(backend, batch)
    checkpoint = tmp_path / "checkpoint"
    backend.save(checkpoint)
    expected = backend.logprobs(backend.actor, batch, with_entropy=False)[0]

    resumed = adapted_backend(tmp_path / "a", SETTINGS)  # the same run directory: the same base model
    resumed.load(checkpoint)
    torch.testing.assert_close(resumed.logprobs(resumed.actor, batch, with_entropy=False)[0], expected,
                               rtol=0, atol=1e-5)

    merge(checkpoint / "actor", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert not merged.config.tie_word_embeddings
    assert not torch.equal(merged.get_input_embeddings().weight, merged.get_output_embeddings().weight)
    torch.testing.assert_close(backend.logprobs(merged, batch, with_entropy=False)[0], expected, rtol=0, atol=1e-5)
