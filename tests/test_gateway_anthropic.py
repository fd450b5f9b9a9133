"""The gateway's Anthropic Messages API (/v1/messages): the real ``anthropic`` client in, spans out.

The translation functions are tested on their own; every other test goes over
real HTTP on 127.0.0.1, with the test policy endpoint behind the gateway, or
the embedded backend's endpoint serving a tiny model made from a config.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from gateway_apis import (CALL, LEASES, assert_learns_as_the_default_recipe, base_url, chat_answer,  # noqa: F401
                          events_of, serve, served_backend, spans, store, tokens, wait_for)

from agl_core.gateway import Gateway
from agl_core.gateway import anthropic as messages_api
from agl_core.gateway.streaming import chunks_of
from agl_core.http.rules import RequestError


def messages_client(gateway: Gateway, rollout: str = "r0", api_key: str = "unused") -> anthropic.Anthropic:
    # The SDK appends /v1/messages to its base URL: the attempt's base URL without its /v1.
    return anthropic.Anthropic(base_url=base_url(gateway.url, rollout).removesuffix("/v1"),
                               api_key=api_key, max_retries=0, timeout=30)


def chat_client(gateway: Gateway, rollout: str = "r0") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(gateway.url, rollout), api_key="unused", max_retries=0)


TOOL = {"name": "lookup", "description": "look a word up", "input_schema": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}


# ---------------------------------------------------------------- the translation alone


def test_a_request_becomes_the_chat_request_it_asks_for():
    body = {
        "model": "policy", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "stop_sequences": ["END"],
        "metadata": {"user_id": "u"}, "seed": 3,
        "system": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief", "cache_control": {}}],
        "tools": [TOOL], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "find it"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": "s"},
                                              {"type": "text", "text": "looking"},
                                              {"type": "tool_use", "id": "toolu_1", "name": "lookup",
                                               "input": {"text": "it"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "found"}]},
                                         {"type": "text", "text": "and "}, {"type": "text", "text": "then?"}]},
        ]}
    assert messages_api.chat_request(body) == {
        "model": "policy", "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
        "stop": ["END"], "parallel_tool_calls": False, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                                    "parameters": TOOL["input_schema"]}}],
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "find it"},
            {"role": "assistant", "content": "looking", "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "lookup", "arguments": '{"text": "it"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "found"},   # tool results before the text
            {"role": "user", "content": "and then?"},
        ]}
    named = messages_api.chat_request({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                       "tool_choice": {"type": "tool", "name": "lookup"}})
    assert named["tool_choice"] == {"type": "function", "function": {"name": "lookup"}}


@pytest.mark.parametrize("change, named", [
    ({"max_tokens": None}, "'max_tokens' is required"),
    ({"model": 3}, "'model' must be a string"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "system", "content": "x"}]}, "'messages[0].role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'messages[0].content[0].type'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]},
     "not supported in a user message"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "'messages[0].content[0].text'"),
    ({"system": [{"type": "image"}]}, "'system[0].type'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "'tools[0].type'"),
    ({"tools": [{"name": "t"}]}, "'tools[0].input_schema'"),
    ({"tool_choice": {"type": "sometimes"}}, "'tool_choice.type'"),
    ({"stop_sequences": "END"}, "'stop_sequences' must be a list"),
    ({"stream": "yes"}, "'stream' must be a boolean"),
    ({"frequency_penalty": 1.0}, "'frequency_penalty'"),
])
def test_a_bad_request_is_refused_naming_the_field(change, named):
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body.update(change)
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(RequestError, match=named.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")) as caught:
        messages_api.wants_stream(body)
        messages_api.chat_request(body)
    assert caught.value.status == 400


@pytest.mark.parametrize("answer, stop_reason, stop_sequence", [
    (chat_answer("hi"), "end_turn", None),
    (chat_answer("hi", finish_reason="length"), "max_tokens", None),
    (chat_answer("hi", stop_reason="END"), "stop_sequence", "END"),
    (chat_answer(tool_calls=[CALL], finish_reason="tool_calls"), "tool_use", None),
])
def test_an_answer_becomes_a_message_with_its_stop_reason(answer, stop_reason, stop_sequence):
    out = messages_api.message(answer, "policy")
    assert (out["stop_reason"], out["stop_sequence"]) == (stop_reason, stop_sequence)
    assert out["type"] == "message" and out["role"] == "assistant" and out["model"] == "policy"
    assert out["usage"] == {"input_tokens": 3, "output_tokens": 2}
    if stop_reason == "tool_use":
        assert out["content"] == [{"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"text": "it"}}]
    else:
        assert out["content"] == [{"type": "text", "text": "hi"}]


def test_malformed_tool_arguments_reach_the_agent_as_written():
    broken = {**CALL, "function": {"name": "lookup", "arguments": '{"text": '}}
    out = messages_api.message(chat_answer(tool_calls=[broken], finish_reason="tool_calls"), "policy")
    assert out["content"][0]["input"] == {"_raw": '{"text": '}


def test_the_events_of_a_stream_rebuild_the_message():
    answer = chat_answer("let me look", tool_calls=[CALL], finish_reason="tool_calls")
    events = messages_api.MessageEvents("policy")
    frames = events.start()
    for chunk in chunks_of("chat.completions", answer, include_usage=True):
        frames += events.add(chunk)
    frames += events.end(answer, None)
    got = events_of(frames)
    assert [name for name, _ in got] == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert got[0][1]["message"]["usage"]["input_tokens"] == 3 and got[0][1]["message"]["stop_reason"] is None
    assert got[2][1]["delta"] == {"type": "text_delta", "text": "let me look"}
    assert got[4][1]["content_block"] == {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {}}
    assert json.loads(got[5][1]["delta"]["partial_json"]) == {"text": "it"} and got[5][1]["index"] == 1
    assert got[7][1]["delta"]["stop_reason"] == "tool_use" and got[7][1]["usage"] == {"output_tokens": 2}
    broken = messages_api.MessageEvents("policy")
    assert [name for name, _ in events_of(broken.end(None, "cut off"))] == ["message_start", "error"]


# ---------------------------------------------------------------- the real client through the gateway


def test_a_messages_call_is_recorded_as_the_same_chat_call(endpoint, store, serve):
    gateway = serve(endpoint.url)
    reply = messages_client(gateway).messages.create(
        model="policy", max_tokens=32, system="be brief", messages=[{"role": "user", "content": "hi"}],
        extra_body={"temperature": 0.2})
    assert [block.text for block in reply.content] == ["echo: hi"]
    assert reply.stop_reason == "end_turn" and reply.role == "assistant" and reply.model == "policy"
    chat = chat_client(gateway).chat.completions.create(
        model="policy", max_tokens=32, temperature=0.2,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "echo: hi"

    via_messages, via_chat = spans(store)
    assert tokens(via_messages) == tokens(via_chat) and via_messages.response_token_ids
    assert via_messages.attributes["request"] == via_chat.attributes["request"]  # the chat request it became
    assert via_messages.attributes["endpoint"] == "chat.completions"
    assert reply.usage.input_tokens == len(via_messages.prompt_token_ids)
    assert reply.usage.output_tokens == len(via_messages.response_token_ids)


def test_streamed_and_not_record_identical_token_ids(endpoint, store, serve):
    gateway = serve(endpoint.url)
    endpoint.token_delay_s = 0.001
    client = messages_client(gateway)
    kwargs = dict(model="policy", max_tokens=5, messages=[{"role": "user", "content": "hello there"}],
                  extra_body={"seed": 7})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        deltas = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert len(deltas) == 5  # relayed token by token as the endpoint streamed them
    assert "".join(deltas) == streamed.content[0].text == whole.content[0].text == "echo:"
    assert streamed.stop_reason == whole.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == whole.usage.output_tokens == 5
    first, second = spans(store)
    assert tokens(first) == tokens(second)
    assert "incomplete" not in second.attributes and second.attributes["request"]["stream"] is True


def test_a_tool_call_round_trip(endpoint, store, serve):
    gateway = serve(endpoint.url)
    client = messages_client(gateway)
    asked = [{"role": "user", "content": "find apples"}]
    first = client.messages.create(model="policy", max_tokens=200, tools=[TOOL], messages=asked)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert (use.type, use.name, use.input) == ("tool_use", "lookup", {"text": "find apples"})
    with client.messages.stream(model="policy", max_tokens=200, tools=[TOOL], messages=asked) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "lookup", {"text": "find apples"})]

    result = [{"role": "assistant", "content": [use.model_dump(include={"type", "id", "name", "input"})]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "red ones"}]}]
    second = client.messages.create(model="policy", max_tokens=200, tools=[TOOL], messages=asked + result)
    assert second.content[0].text == "echo: red ones" and second.stop_reason == "end_turn"
    sent = endpoint.requests[-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == use.id and sent[2] == {"role": "tool", "tool_call_id": use.id,
                                                                   "content": "red ones"}
    call, _, answer = spans(store)
    assert answer.prompt_token_ids[:len(call.prompt_token_ids) + len(call.response_token_ids)] == \
        call.prompt_token_ids + call.response_token_ids  # the next prompt extends the call: one trajectory


def test_bad_requests_get_anthropics_error_shape_and_record_nothing(endpoint, store, serve):
    gateway = serve(endpoint.url)
    client = messages_client(gateway)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "robot", "content": "hi"}])
    assert caught.value.body == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "'messages[0].role' must be 'user' or 'assistant', got 'robot'"}}
    with pytest.raises(anthropic.BadRequestError, match="'temperature' must be in"):
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                               extra_body={"temperature": -1})
    with pytest.raises(anthropic.NotFoundError, match="unknown rollout 'nope'") as caught:
        messages_client(gateway, rollout="nope").messages.create(model="policy", max_tokens=8,
                                                                 messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "not_found_error"
    url = base_url(gateway.url, "r0") + "/messages"
    not_json = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["type"] == "error"
    assert "not valid JSON" in not_json.json()["error"]["message"]
    assert spans(store) == [] and endpoint.requests == type(endpoint.requests)(maxlen=1000)  # nothing forwarded

    endpoint.fail_next.append(400)  # the policy server's own refusal, in Anthropic's shape
    with pytest.raises(anthropic.BadRequestError, match="injected failure 400"):
        client.messages.create(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    endpoint.fail_next.append(400)  # a stream refused before its first event: the same error, not an event stream
    with pytest.raises(anthropic.BadRequestError, match="injected failure 400"):
        with client.messages.stream(model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}]):
            pass
    assert [bool(span.attributes["error"]) for span in spans(store)] == [True, True]


def test_the_token_is_read_from_the_sdks_api_key(endpoint, store, serve):
    gateway = serve(endpoint.url, token="s3cret")
    reply = messages_client(gateway, api_key="s3cret").messages.create(
        model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert reply.content[0].text == "echo: hi"
    with pytest.raises(anthropic.AuthenticationError) as caught:
        messages_client(gateway, api_key="wrong").messages.create(
            model="policy", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert len(spans(store)) == 1


def test_a_disconnect_mid_stream_leaves_an_incomplete_span(endpoint, store, serve):
    gateway = serve(endpoint.url)
    endpoint.token_delay_s = 0.05
    url = base_url(gateway.url, "r0") + "/messages"
    body = {"model": "policy", "max_tokens": 40, "stream": True,
            "messages": [{"role": "user", "content": "a long answer please"}]}
    with httpx.stream("POST", url, json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        assert "event: content_block_delta" in lines  # a token arrived; the agent leaves now
    wait_for(lambda: spans(store))
    (span,) = spans(store)
    assert span.attributes["incomplete"] is True
    assert 0 < len(span.response_token_ids) < 40  # what arrived before the agent left


# ---------------------------------------------------------------- over the embedded backend


def test_over_the_embedded_backend_streamed_and_not_record_identical_token_ids(tmp_path, store, serve):
    backend = served_backend(tmp_path)
    try:
        gateway = serve(backend.url)
        client = messages_client(gateway)
        kwargs = dict(model="policy", max_tokens=8, messages=[{"role": "user", "content": "guess a number"}],
                      extra_body={"seed": 11, "temperature": 1.0})
        whole = client.messages.create(**kwargs)
        with client.messages.stream(**kwargs) as stream:
            streamed = stream.get_final_message()
        chat = chat_client(gateway).chat.completions.create(
            model="policy", max_tokens=8, seed=11, temperature=1.0,
            messages=[{"role": "user", "content": "guess a number"}])
        assert [b.text for b in streamed.content] == [b.text for b in whole.content]
        first, second, third = spans(store)
        assert tokens(first) == tokens(second) == tokens(third) and first.response_token_ids
        assert whole.content[0].text == chat.choices[0].message.content
    finally:
        backend.stop_serving()


# ---------------------------------------------------------------- the example agent's recipe


def test_the_anthropic_agents_recipe_learns_as_the_default_recipe(tmp_path, monkeypatch):
    assert_learns_as_the_default_recipe("recipe_anthropic.yaml", tmp_path, monkeypatch)
