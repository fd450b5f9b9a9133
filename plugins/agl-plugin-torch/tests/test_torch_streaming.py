"""Streamed calls on the embedded backend, with the real openai client: directly and through the gateway, a
streamed call and the same call not streamed give the same token ids and record the same spans (same seeds)."""

from __future__ import annotations

import pytest
from openai import OpenAI

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.store import NewRollout

from agl_plugin_torch.streaming import TextDeltas

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
    assert [t for c in chunks for t in c.choices[0].model_extra.get("token_ids") or []] == \
        whole.choices[0].model_extra["token_ids"]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == whole.choices[0].model_extra["prompt_token_ids"]
    assert [c.choices[0].finish_reason for c in chunks][-1] == whole.choices[0].finish_reason


def test_through_the_gateway_streamed_and_not_record_identical_spans(served):
    store = MemoryStore()
    store.enqueue([NewRollout(r, Task(id="t", input={})) for r in ("plain", "streamed")])
    leases = {attempt.rollout_id: attempt.lease for attempt in (store.dequeue("w", 60), store.dequeue("w", 60))}
    server = Gateway(store, GatewayConfig(), upstreams=[served.url]).serve()
    try:
        def llm(rollout):
            return OpenAI(base_url=Gateway.base_url(server.url, rollout, "1", leases[rollout]), api_key="unused",
                          max_retries=0, timeout=60)

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


def test_tokens_are_streamed_one_chunk_each_as_they_come(served, client):
    chunks = list(client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=7, seed=1,
                                                 extra_body={"ignore_eos": True}, stream=True))
    with_tokens = [c for c in chunks if c.choices and c.choices[0].model_extra.get("token_ids")]
    assert len(with_tokens) == 7 and all(len(c.choices[0].model_extra["token_ids"]) == 1 for c in with_tokens)
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].model_extra["weight_version"] == 0


def test_with_tools_the_text_waits_and_the_call_comes_at_the_end(tmp_path):
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig
    from agl_plugin_torch.testing import tiny_section

    section = tiny_section()
    section["model"]["build"]["vocabulary"] = ["1", "2", "3", "guess", "number", "[", "(", "=", ")]"]
    backend = create(TorchConfig.model_validate(section), tmp_path, seed=0, with_critic=False)
    backend.start_serving("policy")
    try:
        tool = {"type": "function", "function": {"name": "guess", "parameters": {
            "type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
        client = OpenAI(base_url=backend.url, api_key="unused", max_retries=0, timeout=60)
        kwargs = dict(model="policy", messages=[{"role": "user", "content": "guess a number"}], tools=[tool],
                      tool_choice="required", max_tokens=1, temperature=0)
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
    finally:
        backend.stop_serving()
    deltas = [c.choices[0].delta for c in chunks]
    assert all(not d.content and not d.tool_calls for d in deltas[:-1])  # the answer may be a call: it waits
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    if whole.message.tool_calls:
        assert deltas[-1].tool_calls[0].function.arguments == whole.message.tool_calls[0].function.arguments
    else:  # the greedy model wrote a value no call takes: the text, opening included, at the end
        assert deltas[-1].content == whole.message.content and whole.message.content.startswith("[guess(number=")


@pytest.mark.parametrize("stop, final", [((), "hello worldly"), (("world",), "hello "), (("ly", "o w"), "hell")])
def test_streamed_text_never_runs_past_where_a_stop_string_cuts_it(stop, final):
    pieces = ["he", "llo", " wor", "ldly"]  # the last token runs past the stop string "world"

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    deltas = TextDeltas(decode, stop)
    sent = "".join(deltas.add(list(range(k + 1))) for k in range(len(pieces)))
    assert final.startswith(sent) and sent + deltas.rest(final) == final


def test_an_agent_that_leaves_mid_stream_through_the_gateway_leaves_an_incomplete_span(served, monkeypatch):
    """The tiny model made slow (50 ms a forward pass, as a real model on a CPU would be) so that the agent leaves
    while tokens are still being generated, even on a loaded machine (the 40 tokens take 2 s)."""
    import time

    forward = served.actor.forward

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return forward(*args, **kwargs)

    monkeypatch.setattr(served.actor, "forward", slow)
    store = MemoryStore()
    store.enqueue([NewRollout("r1", Task(id="t", input={}))])
    lease = store.dequeue("w", lease_s=60).lease
    server = Gateway(store, GatewayConfig(), upstreams=[served.url]).serve()
    try:
        llm = OpenAI(base_url=Gateway.base_url(server.url, "r1", "1", lease), api_key="unused", max_retries=0,
                     timeout=60)
        with llm.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=40, stream=True,
                                         extra_body={"ignore_eos": True}) as stream:
            for count, _ in enumerate(stream):
                if count == 3:
                    break
        deadline = time.time() + 10
        while not store._entries["r1"].spans and time.time() < deadline:
            time.sleep(0.02)
    finally:
        server.stop()
    [span] = store._entries["r1"].spans
    assert span.attributes["incomplete"] is True and "error" not in span.attributes
    assert 0 < len(span.response_token_ids) < 40 and len(span.response_logprobs) == len(span.response_token_ids)
