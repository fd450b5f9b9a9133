"""The policy endpoint answers the real openai client with vLLM's token-id fields, batching concurrent calls."""

import threading

import httpx
import openai
import pytest
from openai import OpenAI
from transformers import PreTrainedTokenizerFast

from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import full_forward_logprobs, tiny_section

MESSAGES = [{"role": "user", "content": "guess a number"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "higher"}]


def test_chat_returns_token_ids_logprobs_and_weight_version(served, client):
    reply = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=6, temperature=1.0)
    extra = reply.model_extra
    choice = reply.choices[0]
    tokenizer = served.tokenizer
    assert extra["prompt_token_ids"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                                      return_dict=False)
    token_ids = choice.model_extra["token_ids"]
    assert 1 <= len(token_ids) <= 6
    assert choice.message.content == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert [entry.token for entry in choice.logprobs.content] == [tokenizer.decode([t]) for t in token_ids]
    assert extra["weight_version"] == 0
    assert reply.usage.prompt_tokens == len(extra["prompt_token_ids"])
    assert reply.usage.completion_tokens == len(token_ids)


def test_served_logprobs_equal_the_trainers_recomputation(served, client):
    reply = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=8)
    served_logprobs = [entry.logprob for entry in reply.choices[0].logprobs.content]
    recomputed = full_forward_logprobs(served, reply.model_extra["prompt_token_ids"],
                                       reply.choices[0].model_extra["token_ids"])
    assert served_logprobs == pytest.approx(recomputed, abs=1e-5)


def test_completions_give_ids_per_choice_and_seeds_repeat(served, client):
    kwargs = dict(model="policy", prompt="hello world", max_tokens=5, n=3, seed=7, logprobs=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert [c.model_extra["token_ids"] for c in first.choices] == [c.model_extra["token_ids"] for c in again.choices]
    for choice in first.choices:
        assert choice.model_extra["prompt_token_ids"] == served.tokenizer.encode("hello world")
        assert len(choice.logprobs.token_logprobs) == len(choice.model_extra["token_ids"])
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_concurrent_calls_are_batched(served, client):
    replies, errors = [], []

    def call():
        try:
            replies.append(client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4))
        except Exception as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors and len(replies) == 16
    assert served.engine.batches < 16  # some calls shared a forward pass


def test_responses_carry_the_version_of_the_weights_that_made_them(served, client):
    served.set_weight_version(3)
    reply = client.completions.create(model="policy", prompt="hello", max_tokens=2)
    assert reply.model_extra["weight_version"] == 3
    assert httpx.get(served.url.removesuffix("/v1") + "/health").json()["weight_version"] == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"stream": True}, "streaming is not supported"),
    ({"temperature": -1}, "'temperature' must be in"),
    ({"n": 0}, "'n' must be in"),
    ({"max_tokens": 0}, "'max_tokens' must be in"),
    ({"messages": [{"role": "user", "content": "1 " * 80}]}, "leaves no room for a response"),
])
def test_bad_requests_are_refused_with_the_reason(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**{"model": "policy", "messages": MESSAGES, **kwargs})


def test_a_made_qwen2_model_is_served_with_its_own_word_tokenizer(tmp_path):
    section = tiny_section()
    section["model"]["build"]["architecture"] = "qwen2"
    backend = create(TorchConfig.model_validate(section), tmp_path, seed=0, with_critic=False)
    backend.start_serving("policy")
    try:
        client = OpenAI(base_url=backend.url, api_key="unused", max_retries=0, timeout=30)
        reply = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=4)
    finally:
        backend.stop_serving()
    assert type(backend.actor).__name__ == "Qwen2ForCausalLM"
    assert reply.model_extra["prompt_token_ids"][:3] == backend.tokenizer.encode("<|user|> guess a")
    served = [entry.logprob for entry in reply.choices[0].logprobs.content]
    recomputed = full_forward_logprobs(backend, reply.model_extra["prompt_token_ids"],
                                       reply.choices[0].model_extra["token_ids"])
    assert served == pytest.approx(recomputed, abs=1e-5)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path / "model")
    assert reloaded.encode("higher , 3") == backend.tokenizer.encode("higher , 3")


def test_models_lists_the_policy(client):
    assert [m.id for m in client.models.list().data] == ["policy"]
