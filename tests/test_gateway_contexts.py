"""Exact contexts' pieces on a real Hugging Face tokenizer with a ChatML template: the continuation of a
conversation as token ids (the template's end of turn after what the model sampled), the matching of a call
to the earlier call it continues, and the token path's request and answer (agl_core.gateway.contexts)."""

from __future__ import annotations

import asyncio
import json
from collections import deque

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from agl_core.gateway.chat_template import ChatTemplate
from agl_core.gateway.contexts import ExactContexts, chat_answer, completion_request, message_key
from agl_core.rollout.context_record import EDITED, EXACT, FIRST, NEW_CONVERSATION, REBUILT, TOOLS_CHANGED

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["user", "assistant", "tool", "\n", "hi", "there", "more", "x", "guess", "4", "[", "(", "number", "=", ")]"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    vocab = {token: i for i, token in enumerate([*SPECIAL, *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split("\n", "isolated"),
                                                 pre_tokenizers.WhitespaceSplit()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>",
                                        eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(path)
    return ChatTemplate.load(str(path))


def ids(template, text):
    return template.encode(text)


def test_the_continuation_closes_the_models_turn_with_what_it_did_not_sample(template):
    history = [{"role": "user", "content": "hi"}]
    reply = {"role": "assistant", "content": "there"}
    new = [{"role": "user", "content": "more"}]
    tail = ids(template, "<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
    end, newline = ids(template, "<|im_end|>"), ids(template, "\n")
    # It sampled its end of turn: only the template's newline after it.
    assert template.continuation(history, reply, new, None, ids(template, "there") + end) == newline + tail
    # Cut by max_tokens: the whole closing.
    assert template.continuation(history, reply, new, None, ids(template, "there")) == end + newline + tail
    # Exactly what the full rendering of the conversation has after the reply.
    full = ids(template, template.render([*history, reply, *new], None, True))
    assert full[-len(newline + tail):] == newline + tail


def test_a_rendering_is_apply_chat_templates_with_tools_special_tokens_and_globals(template):
    """ChatTemplate.render skips apply_chat_template's wrapper: the same text, whatever the template reads."""
    reads_all = ("{{ eos_token }}{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
                 "{% if m['role'] == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                 "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = template.tokenizer
    tokenizer.chat_template, saved = reads_all, tokenizer.chat_template
    try:
        other = ChatTemplate(tokenizer)
        tools = [{"type": "function", "function": {"name": "guess", "parameters": {"type": "object"}}}]
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "there"}]
        for offered in (None, tools):
            for generation in (False, True):
                assert other.render(messages, offered, generation) == tokenizer.apply_chat_template(
                    messages, tools=offered, add_generation_prompt=generation, tokenize=False)
        with pytest.raises(Exception, match="no bad roles"):
            other.render([{"role": "bad", "content": "x"}], None, True)
    finally:
        tokenizer.chat_template = saved


def test_a_template_that_renders_the_past_differently_has_no_continuation(template):
    last_only = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    tokenizer = template.tokenizer
    other = ChatTemplate(tokenizer)
    tokenizer.chat_template, saved = last_only, tokenizer.chat_template
    try:
        assert other.continuation([{"role": "user", "content": "hi"}], {"role": "assistant", "content": "there"},
                                  [{"role": "user", "content": "more"}], None, []) is None
    finally:
        tokenizer.chat_template = saved


def run_plan(contexts, body):
    return asyncio.run(contexts.plan(("r", "1"), body, "http://upstream/v1"))


def answer(prompt, sampled, content, tool_calls=None):
    message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return {"prompt_token_ids": prompt, "choices": [{"index": 0, "message": message, "token_ids": sampled}]}


def test_a_call_continues_the_earlier_call_whose_messages_and_reply_it_repeats(template):
    contexts = ExactContexts(lambda url: (template, "test"))
    first = {"messages": [{"role": "user", "content": "hi"}]}
    plan = run_plan(contexts, first)
    assert plan.context == FIRST and not plan.exact
    prompt, sampled = ids(template, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), ids(template, "there")
    contexts.remember(("r", "1"), plan, first, answer(prompt, sampled, "there"))

    # The agent's SDK re-sends the reply with extra null fields and its text as a list of parts: the same reply.
    reply = {"role": "assistant", "content": [{"type": "text", "text": "there"}], "refusal": None}
    second = {"messages": [*first["messages"], reply, {"role": "user", "content": "more"}]}
    plan = run_plan(contexts, second)
    assert plan.context == EXACT
    assert plan.prompt_ids == prompt + sampled + ids(template, "<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                                                               "<|im_start|>assistant\n")
    edited = {"messages": [*first["messages"], {"role": "assistant", "content": "x"}, {"role": "user", "content": "4"}]}
    assert (run_plan(contexts, edited).context, run_plan(contexts, edited).reason) == (REBUILT, EDITED)
    other = {"messages": [{"role": "user", "content": "guess"}, reply, {"role": "user", "content": "4"}]}
    assert run_plan(contexts, other).reason == NEW_CONVERSATION
    tools = [{"type": "function", "function": {"name": "guess"}}]
    assert run_plan(contexts, {**second, "tools": tools}).reason == TOOLS_CHANGED
    assert "response_format" in run_plan(contexts, {**second, "response_format": {"type": "json_object"}}).reason
    contexts.drop(("r", "1"))
    assert run_plan(contexts, second).context == FIRST


def test_a_context_kept_after_the_answer_is_there_for_the_next_call_and_starts_from_its_rendering(template):
    """remember_later keeps the context once the loop is done with the call; a call that comes before (an agent
    faster than the loop) finds it kept first. The rendering kept for the next call is the template's own."""
    contexts = ExactContexts(lambda url: (template, "test"))
    attempt, first = ("r", "1"), {"messages": [{"role": "user", "content": "hi"}]}
    prompt, sampled = ids(template, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"), ids(template, "there")
    second = {"messages": [*first["messages"], {"role": "assistant", "content": "there"},
                           {"role": "user", "content": "more"}]}
    third = {"messages": [*second["messages"], {"role": "assistant", "content": "x"}, {"role": "user", "content": "4"}]}

    async def conversation():
        plan = await contexts.plan(attempt, first, "u")
        contexts.remember_later(attempt, plan, first, answer(prompt, sampled, "there"))
        assert contexts.attempts() == [attempt] and not contexts._turns  # pending: not kept yet
        plan = await contexts.plan(attempt, second, "u")  # at once: the pending context is kept first
        assert plan.context == EXACT
        contexts.remember_later(attempt, plan, second, answer(plan.prompt_ids, ids(template, "x"), "x"))
        await asyncio.sleep(0)  # a turn of the loop: kept, with the rendering the next call starts from
        (turn,) = contexts._turns[attempt][-1]
        assert turn.before == template.render([*second["messages"], turn.reply], None, False)
        plan = await contexts.plan(attempt, third, "u")
        assert plan.context == EXACT
        assert plan.prompt_ids[len(turn.context):] == template.continuation(
            second["messages"], turn.reply, third["messages"][-1:], None, ids(template, "x"))
        contexts.remember_later(attempt, plan, third, answer(plan.prompt_ids, [4], "4"))
        contexts.drop(attempt)  # the attempt ended before its pending context was kept: nothing is
        await asyncio.sleep(0)
        assert contexts.attempts() == []

    asyncio.run(conversation())


def test_tool_calls_compare_by_name_and_arguments_not_by_spelling():
    call = {"id": "a", "type": "function", "function": {"name": "guess", "arguments": '{"number": 4, "x": 1}'}}
    respelled = {"id": "b", "function": {"name": "guess", "arguments": '{"x":1,"number":4}'}}
    assert message_key({"role": "assistant", "content": None, "tool_calls": [call]}) == \
        message_key({"role": "assistant", "content": "", "tool_calls": [respelled]})
    changed = {"function": {"name": "guess", "arguments": '{"number": 5, "x": 1}'}}
    assert message_key({"role": "assistant", "tool_calls": [call]}) != \
        message_key({"role": "assistant", "tool_calls": [changed]})


def test_memory_is_bounded_per_attempt_and_in_attempts(template):
    contexts = ExactContexts(lambda url: (template, "test"), max_turns=2, max_attempts=2)
    body = {"messages": [{"role": "user", "content": "hi"}]}
    for attempt in [("a", "1"), ("b", "1"), ("c", "1")]:
        for _ in range(3):
            plan = asyncio.run(contexts.plan(attempt, body, "u"))
            contexts.remember(attempt, plan, body, answer([1], [2], "x"))
    assert contexts.attempts() == [("b", "1"), ("c", "1")]
    assert all(len(turns) == 2 for turns in contexts._turns.values())
    assert isinstance(contexts._turns[("c", "1")], deque)


def test_the_token_path_asks_for_completions_and_answers_in_chat(template):
    body = {"model": "m", "messages": [], "max_completion_tokens": 5, "top_logprobs": 2, "logprobs": True,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5, "stop": ["x"],
            "tools": [], "tool_choice": "auto"}
    assert completion_request(body, [1, 2]) == {"model": "m", "prompt": [1, 2], "max_tokens": 5, "logprobs": 2,
                                                "temperature": 0.5, "stop": ["x"]}
    tools = [{"type": "function", "function": {"name": "guess", "parameters": {"required": ["number"]}}}]
    plan = type("P", (), {"tools": tools, "opening": "", "template": template})()
    response = {"id": "cmpl-1", "object": "text_completion", "model": "m", "usage": {"prompt_tokens": 2},
                "choices": [{"index": 0, "text": "[guess(number=4)]", "finish_reason": "stop", "token_ids": [7, 8],
                             "prompt_token_ids": [1, 2],
                             "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0],
                                          "top_logprobs": [{"a": -0.5}, {"b": -1.0}]}}]}
    chat = chat_answer(response, plan)
    assert chat["object"] == "chat.completion" and chat["prompt_token_ids"] == [1, 2]
    [choice] = chat["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"number": 4}
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == [-0.5, -1.0] and choice["token_ids"] == [7, 8]
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": None}]


def test_the_agent_gets_log_probs_on_the_token_path_only_when_it_asked():
    from agl_core.gateway.contexts import as_asked

    chat = {"id": "c", "prompt_token_ids": [1], "choices": [{"index": 0, "message": {}, "token_ids": [2],
                                                            "logprobs": {"content": [{"logprob": -1.0}]}}]}
    assert as_asked(chat, {"logprobs": True}) is chat
    slim = as_asked(chat, {})
    assert slim["choices"][0]["logprobs"] is None and slim["choices"][0]["token_ids"] == [2]
    assert chat["choices"][0]["logprobs"]  # the span's copy is untouched


# ------------------------------------------------------------ through a real gateway, the test endpoint behind it


def two_turns(endpoint, tokenizer: str | None):
    """A real gateway (exact contexts on, ``tokenizer`` set or not) over the test endpoint; two chat turns of one
    rollout with the real openai client; its spans."""
    import openai

    from agl_core.builtin.memory_store import MemoryStore
    from agl_core.config import GatewayConfig
    from agl_core.data import Task
    from agl_core.gateway import Gateway
    from agl_core.rollout.store import NewRollout

    store = MemoryStore()
    store.enqueue([NewRollout("r1", Task(id="t", input={}))])
    lease = store.dequeue("w", lease_s=60).lease
    server = Gateway(store, GatewayConfig(tokenizer=tokenizer), upstreams=[endpoint.url]).serve()
    try:
        client = openai.OpenAI(base_url=Gateway.base_url(server.url, "r1", "1", lease), api_key="unused",
                               max_retries=0)
        messages = [{"role": "user", "content": "hi"}]
        reply = client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=4, top_logprobs=2, logprobs=True)
    finally:
        server.stop()
    return sorted(store._entries["r1"].spans, key=lambda s: s.sequence_id)


def test_the_token_path_is_vllms_completions_with_a_token_prompt(endpoint, template):
    first, second = two_turns(endpoint, template.source)
    assert (first.attributes["context"], second.attributes["context"]) == (FIRST, EXACT)
    sent = endpoint.requests[-1]
    assert isinstance(sent["prompt"], list) and sent["return_token_ids"] is True and sent["logprobs"] == 2
    assert "messages" not in sent and sent["max_tokens"] == 4
    assert list(second.prompt_token_ids) == sent["prompt"]
    context = list(first.prompt_token_ids) + list(first.response_token_ids)
    assert sent["prompt"][:len(context)] == context
    assert second.attributes["response"]["choices"][0]["message"]["content"] == "echo"  # the test endpoint echoes, cut at max_tokens


def test_without_a_tokenizer_the_call_goes_as_text_and_says_why(endpoint, caplog):
    """The test endpoint lists no model directory (no ``root``) and no tokenizer is set: text, counted, logged."""
    first, second = two_turns(endpoint, None)
    assert second.attributes["context"] == REBUILT
    assert "rollout.gateway.tokenizer" in second.attributes["context_reason"]
    assert "messages" in endpoint.requests[-1]
    assert any("exact contexts" in record.getMessage() for record in caplog.records)
