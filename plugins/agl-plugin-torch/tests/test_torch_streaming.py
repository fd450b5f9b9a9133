"""Streamed calls on the embedded backend, with the real openai client: directly and through the gateway, a
streamed call and the same call not streamed give the same token ids and record the same spans (same seeds)."""

from __future__ import annotations

from openai import OpenAI

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.store import NewRollout

MESSAGES = [{"role": "user", "content": "guess a number"}, {"role": "assistant", "content": "5"},
            {"role": "user", "content": "higher"}]


def test_a_streamed_answer_is_the_same_answer_in_chunks(served, client):
    kwargs = dict(model="policy", messages=MESSAGES, max_tokens=6, seed=11, n=2, temperature=1.0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == whole.model_extra["prompt_token_ids"]
    for index, choice in enumerate(whole.choices):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content
        assert [t for c in mine for t in c.model_extra.get("token_ids") or []] == choice.model_extra["token_ids"]
        assert [e.logprob for c in mine if c.logprobs for e in c.logprobs.content] == \
            [e.logprob for e in choice.logprobs.content]
        assert mine[-1].finish_reason == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_completions_stream_too(served, client):
    kwargs = dict(model="policy", prompt="hello world", max_tokens=4, seed=3)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]


def test_through_the_gateway_streamed_and_not_record_identical_spans(served):
    store = MemoryStore()
    store.enqueue([NewRollout(r, Task(id="t", input={})) for r in ("plain", "streamed")])
    store.dequeue("w", lease_s=60)
    store.dequeue("w", lease_s=60)
    server = Gateway(store, GatewayConfig(), upstreams=[served.url]).serve()
    try:
        def llm(rollout):
            return OpenAI(base_url=Gateway.base_url(server.url, rollout, "1"), api_key="unused", max_retries=0,
                          timeout=60)

        kwargs = dict(model="policy", messages=MESSAGES, max_tokens=6, seed=5, temperature=1.0)
        llm("plain").chat.completions.create(**kwargs)
        list(llm("streamed").chat.completions.create(**kwargs, stream=True))
    finally:
        server.stop()
    [plain], [streamed] = ([s for s in store._entries[r].spans if s.kind == "llm_call"] for r in ("plain", "streamed"))
    assert "error" not in streamed.attributes and "incomplete" not in streamed.attributes
    assert streamed.prompt_token_ids == plain.prompt_token_ids
    assert streamed.response_token_ids == plain.response_token_ids and len(plain.response_token_ids) > 0
    assert streamed.response_logprobs == plain.response_logprobs
    assert streamed.attributes["weight_version"] == plain.attributes["weight_version"] == 0
