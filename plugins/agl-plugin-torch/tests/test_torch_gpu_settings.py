"""The settings that matter on a GPU: attention kernel, KV cache, compiled decode, a real model's shape.

No GPU here: what is checked is the choice each setting makes (which kernel, which shapes), and that the engine
counts what a GPU's throughput is read from.
"""

import pytest
from pydantic import ValidationError

from agl_plugin_torch import modeling
from agl_plugin_torch.settings import BuildConfig, ModelConfig, ServingConfig

WORDS = ["guess", "a", "number"]


def model_config(**model) -> ModelConfig:
    return ModelConfig(build=BuildConfig(vocabulary=WORDS), **model)


def test_auto_attention_is_sdpa_on_a_gpu_without_flash_attn_and_the_default_on_a_cpu(monkeypatch):
    assert modeling.attention_implementation(model_config(device="cpu")) is None
    monkeypatch.setattr(modeling.importlib.util, "find_spec", lambda name: None)
    assert modeling.attention_implementation(model_config(device="cuda")) == "sdpa"
    monkeypatch.setattr(modeling.importlib.util, "find_spec", lambda name: object() if name == "flash_attn" else None)
    assert modeling.attention_implementation(model_config(device="cuda")) == "flash_attention_2"
    assert modeling.attention_implementation(model_config(device="cuda", attention="eager")) == "eager"


def test_a_made_model_can_have_a_real_models_shape():
    build = BuildConfig(vocabulary=WORDS, architecture="qwen2", hidden_size=56, num_heads=14, num_kv_heads=2,
                        vocab_size=1000)
    config = modeling.model_config(build, modeling.word_tokenizer(WORDS))
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads) == (1000, 14, 2)
    small = modeling.model_config(BuildConfig(vocabulary=WORDS, vocab_size=2), modeling.word_tokenizer(WORDS))
    assert small.vocab_size == len(modeling.word_tokenizer(WORDS))  # never fewer rows than the tokenizer has
    with pytest.raises(ValidationError, match="not a multiple of num_kv_heads"):
        BuildConfig(vocabulary=WORDS, hidden_size=64, num_heads=4, num_kv_heads=3)


def test_a_compiled_decode_needs_a_static_cache():
    assert ServingConfig(kv_cache="static", compile_decode=True).compile_decode
    with pytest.raises(ValidationError, match="compile_decode needs serving.kv_cache: static"):
        ServingConfig(compile_decode=True)


def test_the_endpoint_counts_the_tokens_it_generated_and_its_time(served, client):
    assert served.generated()[0] == 0
    reply = client.completions.create(model="policy", prompt="guess a number", max_tokens=5, n=3,
                                      extra_body={"ignore_eos": True})
    tokens, seconds = served.generated()
    assert tokens == sum(len(choice.token_ids) for choice in reply.choices) == 15 and seconds > 0
