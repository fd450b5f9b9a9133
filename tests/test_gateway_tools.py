"""Tool calls through the gateway over real HTTP on 127.0.0.1: the openai client's ``tools`` / ``tool_choice`` in,
``tool_calls`` out, the tool's result in the next prompt, and every call recorded with its token ids, streamed
or not. The test endpoint answers a user message with a call of the first tool (see its module)."""

import json

import openai
import pytest

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.store import NewRollout
from agl_core.testing.endpoint import ByteTokenizer

TOKENIZER = ByteTokenizer()
TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Look a word up.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


@pytest.fixture
def store():
    s = MemoryStore()
    s.enqueue([NewRollout("r1", Task(id="t1", input={}))])
    s.lease = s.dequeue("w", lease_s=60).lease
    yield s
    s.close()


@pytest.fixture
def llm(store, endpoint):
    server = Gateway(store, GatewayConfig(), upstreams=[endpoint.url]).serve()
    yield openai.OpenAI(base_url=Gateway.base_url(server.url, "r1", "1", store.lease), api_key="unused",
                        max_retries=0)
    server.stop()


def ask(llm, messages, stream, **kwargs):
    """One chat call, streamed or not: the assistant message as the agent sends it back, and the finish reason."""
    if not stream:
        choice = llm.chat.completions.create(model="m", messages=messages, tools=TOOLS, **kwargs).choices[0]
        return choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}), \
            choice.finish_reason
    calls, content, finish = {}, "", None
    for chunk in llm.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or ():
                slot = calls.setdefault(call.index, {"id": None, "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
                slot["id"] = call.id or slot["id"]
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return {k: v for k, v in message.items() if v is not None}, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_round_trip_is_recorded_with_token_ids(store, llm, endpoint, stream):
    messages = [{"role": "user", "content": "cat"}]
    message, finish = ask(llm, messages, stream, tool_choice="auto")
    assert finish == "tool_calls" and "content" not in message
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "lookup" and json.loads(call["function"]["arguments"]) == {"text": "cat"}
    assert endpoint.requests[-1]["tools"] == TOOLS and endpoint.requests[-1]["tool_choice"] == "auto"

    messages += [message, {"role": "tool", "tool_call_id": call["id"], "content": "a small animal"}]
    answer, finish = ask(llm, messages, stream)
    assert finish == "stop" and answer["content"] == "echo: a small animal"
    assert endpoint.requests[-1]["messages"][-1] == messages[-1]

    first, second = [s for s in store._entries["r1"].spans if s.kind == "llm_call"]
    for span in (first, second):
        assert "error" not in span.attributes and "incomplete" not in span.attributes
        assert len(span.response_logprobs) == len(span.response_token_ids) > 0
    assert TOKENIZER.decode(first.response_token_ids).startswith("<tool_call>")
    assert first.attributes["response"]["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "lookup"
    assert first.attributes["request"]["tools"] == TOOLS
    # The second prompt holds the first prompt, the model's call and the tool's result after it: one trajectory.
    context = list(first.prompt_token_ids) + list(first.response_token_ids)
    assert list(second.prompt_token_ids[:len(context)]) == context
    assert "a small animal" in TOKENIZER.decode(second.prompt_token_ids[len(context):])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_choice_and_none_reach_the_policy_server(llm, endpoint, stream):
    tools = TOOLS + [{"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "other"}}
    llm_kwargs = {"tool_choice": named}
    message, _ = ask(llm, [{"role": "user", "content": "x"}], stream, **llm_kwargs, extra_body={"tools": tools})
    assert message["tool_calls"][0]["function"]["name"] == "other"
    assert endpoint.requests[-1]["tool_choice"] == named
    message, finish = ask(llm, [{"role": "user", "content": "x"}], stream, tool_choice="none")
    assert message["content"] == "echo: x" and finish == "stop"


def test_a_malformed_message_list_gets_a_400_naming_the_field(llm):
    with pytest.raises(openai.BadRequestError, match="'messages'"):
        llm.chat.completions.create(model="m", messages=["not a message"], tools=TOOLS)


@pytest.mark.parametrize("extra, field", [
    ({"tools": {"name": "lookup"}}, "'tools' must be a list"),
    ({"tools": [{"type": "retrieval"}]}, r"'tools\[0\]' must be a tool object"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, r"'tools\[0\].function.name'"),
    ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}},
     "'tool_choice' names the function 'missing'"),
])
def test_malformed_tool_fields_get_a_400_naming_the_field_and_write_nothing(store, llm, extra, field):
    with pytest.raises(openai.BadRequestError, match=field):
        llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], extra_body=extra)
    assert store._entries["r1"].spans == []
