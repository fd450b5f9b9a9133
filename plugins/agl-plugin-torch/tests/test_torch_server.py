"""The policy endpoint answers the real openai client with vLLM's token-id fields, batching concurrent calls."""

import json
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
    assert served.endpoint.batches() < 16  # some calls shared a forward pass


def test_responses_carry_the_version_of_the_weights_that_made_them(served, client):
    served.set_weight_version(3)
    reply = client.completions.create(model="policy", prompt="hello", max_tokens=2)
    assert reply.model_extra["weight_version"] == 3
    assert httpx.get(served.url.removesuffix("/v1") + "/health").json()["weight_version"] == 3


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1}, "'temperature' must be in"),
    ({"n": 0}, "'n' must be in"),
    ({"max_tokens": 0}, "'max_tokens' must be in"),
    ({"messages": [{"role": "user", "content": "1 " * 80}]}, "leaves no room for a response"),
])
def test_bad_requests_are_refused_with_the_reason(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.chat.completions.create(**{"model": "policy", "messages": MESSAGES, **kwargs})


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("fields, named", [
    ({"seed": 2**64}, "'seed'"),
    ({"seed": -1}, "'seed'"),
    ({"temperature": 1e-300}, "'temperature'"),
    ({"temperature": NAN}, "'temperature'"),  # json.dumps writes the literal NaN, which json.loads accepts
    ({"temperature": INF}, "'temperature'"),
    ({"temperature": 10**400}, "'temperature'"),
    ({"top_p": NAN}, "'top_p'"),
    ({"top_p": 0}, "'top_p'"),
    ({"max_tokens": 0}, "'max_tokens'"),
    ({"max_completion_tokens": 2**64}, "'max_completion_tokens'"),
    ({"n": 257}, "'n'"),  # more than serving.max_batch_rows
    ({"top_k": "5"}, "'top_k'"),
    ({"top_logprobs": 21}, "'top_logprobs'"),
    ({"model": ["policy"]}, "'model'"),
    ({"ignore_eos": "yes"}, "'ignore_eos'"),
    ({"stop_token_ids": [True]}, "'stop_token_ids'"),
    ({"messages": [{"role": "user", "content": [{"text": 5}]}]}, "'messages[0].content[0].text'"),
    ({"messages": [{"role": "user", "content": 5}]}, "'messages[0].content'"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "'messages[0].content[0]'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "'messages[0].content[0].type'"),
    ({"messages": [{"role": 5, "content": "hi"}]}, "'messages[0].role'"),
    ({"messages": ["hi"]}, "'messages[0]'"),
])
def test_every_bad_field_is_a_400_that_names_it(served, fields, named):
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4, **fields}
    reply = httpx.post(f"{served.url}/chat/completions", content=json.dumps(body),
                       headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400
    assert named in reply.json()["error"]["message"]


def test_a_seeded_request_at_the_top_of_the_seed_range_is_served(client):
    reply = client.completions.create(model="policy", prompt="hello", max_tokens=3, n=3, seed=2**63 - 1)
    assert len(reply.choices) == 3


def test_text_parts_are_read_as_the_text_they_hold(served, client):
    parts = [{"type": "text", "text": "guess a"}, {"text": " number"}]
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": parts}],
                                           max_tokens=2)
    assert reply.model_extra["prompt_token_ids"] == served.tokenizer.apply_chat_template(
        [{"role": "user", "content": "guess a number"}], add_generation_prompt=True, return_dict=False)


def test_other_model_names_are_served_and_logged_once_each(client, caplog):
    for name in ("gpt-4o", "gpt-4o", "claude", "policy", "gpt-4o"):
        assert client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1).model == name
    logged = [r.getMessage() for r in caplog.records if "the policy endpoint serves" in r.getMessage()]
    assert len(logged) == 2 and "'gpt-4o'" in logged[0] and "'claude'" in logged[1]


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
