"""The gateway's OpenAI Responses API (/v1/responses): the real ``openai`` client and OpenAI Agents SDK in, spans out.

The translation functions and the response memory are tested on their own;
every other test goes over real HTTP on 127.0.0.1, with the test policy
endpoint behind the gateway, or the embedded backend's endpoint serving a tiny
model made from a config.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from gateway_apis import (CALL, LEASES, assert_learns_as_the_default_recipe, base_url, chat_answer,  # noqa: F401
                          events_of, serve, served_backend, spans, store, tokens, wait_for)

from agl_core.gateway import Gateway, api_routes
from agl_core.gateway import responses as responses_api
from agl_core.gateway.streaming import chunks_of
from agl_core.http.rules import RequestError

set_tracing_disabled(True)  # the SDK would export its traces to OpenAI


def client(gateway: Gateway, rollout: str = "r0") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url(gateway.url, rollout), api_key="unused", max_retries=0)


def player(gateway: Gateway, rollout: str = "r0", tools=(), **settings) -> Agent:
    """An Agents SDK agent on the gateway, with ``tools`` and the model ``settings`` (ModelSettings fields)."""
    model = OpenAIResponsesModel(model="policy", openai_client=openai.AsyncOpenAI(
        base_url=base_url(gateway.url, rollout), api_key="unused", max_retries=0))
    return Agent(name="player", model=model, model_settings=ModelSettings(**settings), tools=list(tools))


TOOL = {"type": "function", "name": "lookup", "description": "look a word up", "strict": True,
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"],
                       "additionalProperties": False}}


# ---------------------------------------------------------------- the translation alone


def test_a_request_becomes_the_chat_request_it_asks_for():
    body = {
        "model": "policy", "instructions": "be brief", "max_output_tokens": 50, "temperature": 0.5, "top_p": 0.9,
        "tools": [TOOL], "tool_choice": {"type": "function", "name": "lookup"}, "parallel_tool_calls": False,
        "include": [], "store": True, "metadata": {"k": "v"}, "truncation": "disabled",
        "text": {"format": {"type": "text"}},
        "input": [
            {"role": "developer", "content": "rules"},
            {"role": "user", "content": "find it"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
             "content": [{"type": "output_text", "text": "looking", "annotations": []}]},
            {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": '{"text": "it"}',
             "id": "fc_1"},
            {"type": "function_call_output", "call_id": "call_1", "output": "found"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and "},
                                                            {"type": "input_text", "text": "then?"}]},
        ]}
    history = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "before"}]
    chat, added = responses_api.chat_request(body, history)
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"text": "it"}'}}
    assert added == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "find it"},
        {"role": "assistant", "content": "looking", "tool_calls": [call]},  # its text and its call: one turn
        {"role": "tool", "tool_call_id": "call_1", "content": "found"},
        {"role": "user", "content": "and then?"},
    ]
    assert chat == {
        "model": "policy", "messages": [{"role": "system", "content": "be brief"}, *history, *added],
        "max_tokens": 50, "temperature": 0.5, "top_p": 0.9, "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "lookup"}},
        "tools": [{"type": "function", "function": {"name": "lookup", "description": "look a word up",
                                                    "parameters": TOOL["parameters"]}}]}
    assert responses_api.chat_request({"model": "m", "input": "hi"})[0]["messages"] == [{"role": "user",
                                                                                         "content": "hi"}]


@pytest.mark.parametrize("change, named", [
    ({"model": None}, "'model' must be a string"),
    ({"input": 3}, "'input' must be a string or a list"),
    ({"input": []}, "'input' must not be empty"),
    ({"input": [{"role": "robot", "content": "x"}]}, "'input[0].role'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "'input[0].content[0].type'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "'input[0].call_id'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'input[0].type'"),
    ({"tools": [{"type": "web_search"}]}, "'tools[0].type'"),
    ({"tool_choice": "sometimes"}, "'tool_choice'"),
    ({"text": {"format": {"type": "json_schema"}}}, "'text.format.type'"),
    ({"conversation": "conv_1"}, "'conversation'"),
    ({"background": True}, "'background'"),
    ({"stream": 1}, "'stream' must be a boolean"),
])
def test_a_bad_request_is_refused_naming_the_field(change, named):
    body = {"model": "policy", "input": "hi", **change}
    body = {key: value for key, value in body.items() if value is not None}
    with pytest.raises(RequestError) as caught:
        responses_api.wants_stream(body)
        responses_api.chat_request(body)
    assert named in str(caught.value) and caught.value.status == 400


def test_an_answer_becomes_a_response():
    request = {"model": "policy", "input": "hi", "instructions": "be brief"}
    done = responses_api.response(chat_answer("hello"), request)
    assert done["status"] == "completed" and done["incomplete_details"] is None and done["id"].startswith("resp_")
    (message,) = done["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "hello"
    assert done["usage"]["input_tokens"] == 3 and done["usage"]["output_tokens"] == 2
    assert done["instructions"] == "be brief" and done["model"] == "policy"

    cut = responses_api.response(chat_answer("hel", finish_reason="length"), request)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}

    called = responses_api.response(chat_answer(tool_calls=[CALL], finish_reason="tool_calls"), request)
    assert [(item["type"], item["call_id"], item["name"], item["arguments"]) for item in called["output"]] == [
        ("function_call", "call_1", "lookup", '{"text": "it"}')]
    assert responses_api.answer_message(chat_answer("a", tool_calls=[CALL])) == {
        "role": "assistant", "content": "a", "tool_calls": [CALL]}


@pytest.mark.parametrize("answer, names", [
    (chat_answer("let me look", tool_calls=[CALL], finish_reason="tool_calls"), [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]),
    (chat_answer("", finish_reason="length"), [  # no text came: the empty message is sent at the end
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]),
])
def test_the_events_of_a_stream_rebuild_the_response(answer, names):
    request = {"model": "policy", "input": "hi"}
    events = responses_api.ResponseEvents(request)
    frames = events.start()
    for chunk in chunks_of("chat.completions", answer, include_usage=True):
        frames += events.add(chunk)
    frames += events.end(answer, None)
    got = events_of(frames)
    assert [name for name, _ in got] == names
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    final = got[-1][1]["response"]
    assert final == events.done and final["id"] == events.id
    assert final["output"] == [{**item, "id": final["output"][i]["id"]}
                               for i, item in enumerate(responses_api.response(answer, request)["output"])]
    added = [data["item"]["id"] for name, data in got if name == "response.output_item.added"]
    assert added == [item["id"] for item in final["output"]]  # the ids announced are the final ones
    assert [name for name, _ in events_of(responses_api.ResponseEvents(request).end(None, "cut"))] == ["error"]


def test_the_memory_keeps_each_attempts_conversations_bounded():
    memory = responses_api.ResponseMemory(max_attempts=2, max_responses=2)
    a, b, c = ("r0", "1"), ("r1", "1"), ("r2", "1")
    hi, hello = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}
    memory.add(a, "resp_1", responses_api.Stored(None, (hi, hello)))
    memory.add(a, "resp_2", responses_api.Stored("resp_1", (hi, hello)))
    assert memory.conversation(a, "resp_2") == [hi, hello, hi, hello]
    with pytest.raises(RequestError, match="no response 'resp_1' in this rollout attempt"):
        memory.conversation(b, "resp_1")  # another attempt's responses are not this one's
    memory.add(a, "resp_3", responses_api.Stored("resp_2", (hi,)))
    with pytest.raises(RequestError, match="'resp_1'"):
        memory.conversation(a, "resp_3")  # the oldest of the attempt went: a chain through it is broken
    memory.add(b, "resp_4", responses_api.Stored(None, (hi,)))
    memory.add(c, "resp_5", responses_api.Stored(None, (hi,)))
    assert memory.attempts() == [b, c]  # the least recently used attempt went
    memory.drop(b)
    assert memory.attempts() == [c]


# ---------------------------------------------------------------- the real clients through the gateway


def test_a_responses_call_is_recorded_as_the_same_chat_call(endpoint, store, serve):
    gateway = serve(endpoint.url)
    reply = client(gateway).responses.create(model="policy", instructions="be brief", input="hi",
                                             max_output_tokens=32, temperature=0.2)
    assert reply.output_text == "echo: hi" and reply.status == "completed"
    chat = client(gateway).chat.completions.create(
        model="policy", max_tokens=32, temperature=0.2,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "echo: hi"
    via_responses, via_chat = spans(store)
    assert tokens(via_responses) == tokens(via_chat) and via_responses.response_token_ids
    assert via_responses.attributes["request"] == via_chat.attributes["request"]  # the chat request it became
    assert reply.usage.input_tokens == len(via_responses.prompt_token_ids)


def test_streamed_and_not_record_identical_token_ids_and_continue_a_conversation(endpoint, store, serve):
    gateway = serve(endpoint.url)
    endpoint.token_delay_s = 0.001
    openai_client = client(gateway)
    whole = openai_client.responses.create(model="policy", input="hello there", extra_body={"seed": 7})
    events = list(openai_client.responses.create(model="policy", input="hello there", extra_body={"seed": 7},
                                                 stream=True))
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    streamed = events[-1].response
    assert events[-1].type == "response.completed" and len(deltas) == len("echo: hello there")
    assert "".join(deltas) == streamed.output_text == whole.output_text == "echo: hello there"
    first, second = spans(store)
    assert tokens(first) == tokens(second)

    # A streamed response continues a conversation, and is continued, as a whole one.
    later = openai_client.responses.create(model="policy", input="and now", previous_response_id=streamed.id)
    assert later.output_text == "echo: and now" and later.previous_response_id == streamed.id
    assert endpoint.requests[-1]["messages"] == [{"role": "user", "content": "hello there"},
                                                 {"role": "assistant", "content": "echo: hello there"},
                                                 {"role": "user", "content": "and now"}]
    third = spans(store)[-1]
    assert third.prompt_token_ids[:len(second.prompt_token_ids) + len(second.response_token_ids)] == \
        second.prompt_token_ids + second.response_token_ids  # the next prompt extends the call: one trajectory


def test_the_agents_sdk_runs_a_tool_round_trip_streamed_and_not(endpoint, store, serve):
    gateway = serve(endpoint.url)
    looked_up = []

    @function_tool
    def lookup(text: str) -> str:
        """Look a word up."""
        looked_up.append(text)
        return f"{text} are red"

    async def play():
        agent = player(gateway, max_tokens=200, tools=[lookup])
        first = await Runner.run(agent, "apples")
        streamed = Runner.run_streamed(player(gateway, max_tokens=200, tools=[lookup]), "cherries")
        async for _ in streamed.stream_events():
            pass
        return first, streamed

    first, streamed = asyncio.run(play())
    assert looked_up == ["apples", "cherries"]
    assert first.final_output == "echo: apples are red" and streamed.final_output == "echo: cherries are red"
    sent = endpoint.requests[-1]
    assert sent["messages"][-2]["tool_calls"][0]["function"]["name"] == "lookup"
    assert sent["messages"][-1]["role"] == "tool" and sent["messages"][-1]["content"] == "cherries are red"
    assert sent["tools"][0]["function"]["name"] == "lookup"
    call, answer, streamed_call, streamed_answer = spans(store)
    for asked, answered in ((call, answer), (streamed_call, streamed_answer)):
        assert answered.prompt_token_ids[:len(asked.prompt_token_ids) + len(asked.response_token_ids)] == \
            asked.prompt_token_ids + asked.response_token_ids


def test_the_agents_sdk_continues_with_previous_response_id(endpoint, store, serve):
    gateway = serve(endpoint.url)

    async def play():
        agent = player(gateway, temperature=0.5)
        first = await Runner.run(agent, "one")
        second = await Runner.run(agent, "two", previous_response_id=first.last_response_id)
        return first, second

    first, second = asyncio.run(play())
    assert second.final_output == "echo: two"
    assert endpoint.requests[-1]["messages"] == [{"role": "user", "content": "one"},
                                                 {"role": "assistant", "content": "echo: one"},
                                                 {"role": "user", "content": "two"}]
    assert endpoint.requests[-1]["temperature"] == 0.5


def test_bad_requests_get_openais_error_shape_and_record_nothing(endpoint, store, serve):
    gateway = serve(endpoint.url)
    openai_client = client(gateway)
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.responses.create(model="policy", input=[{"role": "robot", "content": "x"}])
    assert caught.value.body["message"].startswith("'input[0].role' must be")
    with pytest.raises(openai.BadRequestError, match="'previous_response_id': no response 'resp_x'"):
        openai_client.responses.create(model="policy", input="hi", previous_response_id="resp_x")
    with pytest.raises(openai.BadRequestError, match="'temperature' must be in"):
        openai_client.responses.create(model="policy", input="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="unknown rollout 'nope'"):
        client(gateway, rollout="nope").responses.create(model="policy", input="hi")
    url = base_url(gateway.url, "r0") + "/responses"
    not_json = httpx.post(url, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and "must be a JSON object" in not_json.json()["error"]["message"]
    assert spans(store) == [] and len(endpoint.requests) == 0

    done = openai_client.responses.create(model="policy", input="hi")
    with pytest.raises(openai.BadRequestError, match="no response"):  # a response of another rollout's attempt
        client(gateway, rollout="r1").responses.create(model="policy", input="hi", previous_response_id=done.id)
    endpoint.fail_next.append(400)  # the policy server's own refusal, passed on in OpenAI's shape
    with pytest.raises(openai.BadRequestError, match="injected failure 400"):
        openai_client.responses.create(model="policy", input="hi")
    endpoint.fail_next.append(400)  # a stream refused before its first event: the same error, not an event stream
    with pytest.raises(openai.BadRequestError, match="injected failure 400"):
        openai_client.responses.create(model="policy", input="hi", stream=True)
    with pytest.raises(openai.BadRequestError, match="'previous_response_id'"):
        openai_client.responses.create(model="policy", input="hi", stream=True, previous_response_id="resp_x")


def test_a_disconnect_mid_stream_leaves_an_incomplete_span(endpoint, store, serve):
    gateway = serve(endpoint.url)
    endpoint.token_delay_s = 0.05
    url = base_url(gateway.url, "r0") + "/responses"
    with httpx.stream("POST", url, json={"model": "policy", "input": "a long answer please", "stream": True,
                                         "max_output_tokens": 40}, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: response.created"
        assert "event: response.output_text.delta" in lines  # a token arrived; the agent leaves now
    wait_for(lambda: spans(store))
    (span,) = spans(store)
    assert span.attributes["incomplete"] is True
    assert 0 < len(span.response_token_ids) < 40
    kept = gateway.translated.memory.attempts()
    assert kept == []  # a response the agent never saw whole cannot be continued


def test_the_responses_of_an_ended_attempt_are_dropped(endpoint, store, serve, monkeypatch):
    monkeypatch.setattr(api_routes, "SWEEP_S", 0.05)
    gateway = serve(endpoint.url)
    client(gateway, "r0").responses.create(model="policy", input="hi")
    client(gateway, "r1").responses.create(model="policy", input="hi")
    assert sorted(gateway.translated.memory.attempts()) == [("r0", "1"), ("r1", "1")]
    store.finish("r0", "1", "succeeded", 1.0, lease=LEASES["r0"])
    wait_for(lambda: gateway.translated.memory.attempts() == [("r1", "1")])


# ---------------------------------------------------------------- over the embedded backend


def test_over_the_embedded_backend_streamed_and_not_record_identical_token_ids(tmp_path, store, serve):
    backend = served_backend(tmp_path)
    try:
        gateway = serve(backend.url)
        openai_client = client(gateway)
        kwargs = dict(model="policy", input="guess a number", max_output_tokens=8, temperature=1.0,
                      extra_body={"seed": 11})
        whole = openai_client.responses.create(**kwargs)
        streamed = list(openai_client.responses.create(**kwargs, stream=True))[-1].response
        assert streamed.output_text == whole.output_text and streamed.status == whole.status
        first, second = spans(store)
        assert tokens(first) == tokens(second) and first.response_token_ids
    finally:
        backend.stop_serving()


# ---------------------------------------------------------------- the example agent's recipe


def test_the_openai_agents_recipe_learns_as_the_default_recipe(tmp_path, monkeypatch):
    assert_learns_as_the_default_recipe("recipe_openai_agents.yaml", tmp_path, monkeypatch)
