"""Tool calls on the embedded backend: tools rendered by the chat template, calls parsed back into ``tool_calls``,
and a tool-call round trip through the gateway recorded as one trajectory, with the real openai client."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.gateway.tool_calls import (HERMES, PYTHONIC, forced_opening, parse_forced_call, parse_tool_calls,
                                         template_messages, tool_format)
from agl_core.rollout.store import NewRollout

from agl_plugin_torch.backend import create
from agl_plugin_torch.modeling import CHAT_TEMPLATE
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import tiny_section

GUESS = {"type": "function", "function": {"name": "guess", "description": "Guess the secret.", "parameters": {
    "type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
VOCABULARY = ["1", "2", "3", "4", "5", "6", "7", "guess", "a", "number", "higher", "lower", "[", "(", "=", ")]",
              "tools", ":", ")"]


# ------------------------------------------------------------ the formats, on their own

def test_hermes_calls_are_parsed_and_the_text_around_them_is_content():
    text = ('Let me look. <tool_call>{"name": "guess", "arguments": {"number": 4}}</tool_call>'
            '<tool_call>{"name": "guess", "parameters": {"number": 5}}</tool_call>')
    content, calls = parse_tool_calls(text, [GUESS])
    assert content == "Let me look."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("guess", {"number": 4}), ("guess", {"number": 5})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_pythonic_calls_are_parsed_even_with_a_word_tokenizers_spaces():
    content, calls = parse_tool_calls(' [ guess ( number = 4 ), guess(number="x y")]', [GUESS])
    assert content is None
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"number": 4}, {"number": "x y"}]


@pytest.mark.parametrize("text", [
    "<tool_call>{not json}</tool_call>",            # a block that does not parse stays text
    '<tool_call>{"arguments": {}}</tool_call>',     # no name
    "[other(number=4)]",                            # not an offered tool
    "[guess(4)]",                                   # positional arguments are not the format
    "[guess(number=4)] and more",                   # the whole answer must be the list
    "[guess(number=x)]",                            # not a literal
    "guess 4",
])
def test_text_that_is_not_a_call_stays_content(text):
    assert parse_tool_calls(text, [GUESS]) == (text, [])


def test_the_format_is_the_templates_and_a_forced_call_opens_in_it():
    assert tool_format(CHAT_TEMPLATE) == PYTHONIC and tool_format("{{ '<tool_call>' }}") == HERMES
    assert forced_opening(GUESS["function"], PYTHONIC) == "[guess(number="
    assert forced_opening(GUESS["function"], HERMES) == '<tool_call>{"name": "guess", "arguments": {"number": '
    assert forced_opening({"name": "f"}, PYTHONIC) == "[f("


@pytest.mark.parametrize("fmt, text, arguments", [
    (PYTHONIC, "4 )]", {"number": 4}),        # the model closed the call itself
    (PYTHONIC, "4", {"number": 4}),           # it stopped inside the call: the backend closes it
    (PYTHONIC, "4 )] higher", None),          # text after the call: no call
    (PYTHONIC, ")]", None),                   # no value
    (HERMES, "4}}</tool_call>", {"number": 4}),
    (HERMES, "4", {"number": 4}),
    (HERMES, "4, \"x\": [", None),
])
def test_a_forced_call_is_closed_when_the_model_stopped_inside_it(fmt, text, arguments):
    opening = forced_opening(GUESS["function"], fmt)
    content, calls = parse_forced_call(opening, text, fmt, [GUESS])
    if arguments is None:
        assert (content, calls) == (opening + text, [])
    else:
        assert content is None and [json.loads(c["function"]["arguments"]) for c in calls] == [arguments]


def test_tool_call_arguments_reach_the_template_as_objects_and_bad_ones_are_named():
    messages = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "guess", "arguments": '{"number": 4}'}}]}]
    assert template_messages(messages)[0]["tool_calls"][0]["function"]["arguments"] == {"number": 4}
    messages[0]["tool_calls"][0]["function"]["arguments"] = "{4"
    with pytest.raises(Exception, match=r"'messages\[0\].tool_calls\[0\].function.arguments' is not JSON"):
        template_messages(messages)


# ------------------------------------------------------------ served, with the real openai client

@pytest.fixture
def served(tmp_path):
    section = tiny_section()
    section["model"]["build"]["vocabulary"] = VOCABULARY
    backend = create(TorchConfig.model_validate(section), tmp_path, seed=0, with_critic=False)
    backend.start_serving("policy")
    yield backend
    backend.stop_serving()


def first_call(client, messages, **kwargs):
    """Sample (seeded, 32 choices a request) until the random model writes a call and its closing ``)]`` itself
    (not closed by the backend): the first such choice."""
    for seed in range(0, 40 * 32, 32):  # choice i of a request is seeded seed + i: no seed twice
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[GUESS], seed=seed,
                                               n=32, max_tokens=2, logprobs=True, **kwargs)
        for choice in reply.choices:
            if choice.message.tool_calls and choice.logprobs.content[-1].token == ")]":
                return reply, choice
    raise AssertionError("the model wrote no whole call in 1280 samples")


def test_tools_are_rendered_by_the_chat_template_and_a_named_choice_opens_the_call(served):
    client = OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "guess a number"}]
    reply, choice = first_call(client, messages, tool_choice={"type": "function", "function": {"name": "guess"}})
    tokenizer = served.tokenizer
    rendered = tokenizer.apply_chat_template(messages, tools=[GUESS], add_generation_prompt=True, return_dict=False)
    opening = tokenizer.encode("[guess(number=", add_special_tokens=False)
    assert reply.model_extra["prompt_token_ids"] == rendered + opening
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "guess" and set(json.loads(call.function.arguments)) == {"number"}
    # Choices that wrote no whole call are text: the opening and what the model wrote after it.
    texts = [c.message.content for c in reply.choices if not c.message.tool_calls]
    assert all(text.startswith("[guess(number=") for text in texts)


def test_a_tool_call_round_trip_through_the_gateway_is_one_trajectory(served):
    store = MemoryStore()
    store.enqueue([NewRollout("r1", Task(id="t", input={}))])
    lease = store.dequeue("w", lease_s=60).lease
    server = Gateway(store, GatewayConfig(), upstreams=[served.url]).serve()
    try:
        client = OpenAI(base_url=Gateway.base_url(server.url, "r1", "1", lease), api_key="unused", max_retries=0,
                        timeout=60)
        messages = [{"role": "user", "content": "guess a number"}]
        _, choice = first_call(client, messages, tool_choice="required")
        call = choice.message.tool_calls[0]
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "higher"}]
        client.chat.completions.create(model="policy", messages=messages, tools=[GUESS], max_tokens=2)
    finally:
        server.stop()
    spans = [s for s in store._entries["r1"].spans if s.kind == "llm_call" and "error" not in s.attributes]
    called = next(s for s in spans if (s.attributes["response"]["choices"][0]["message"].get("tool_calls")
                                       or [{}])[0].get("id") == call.id)
    last = spans[-1]
    context = list(called.prompt_token_ids) + list(called.response_token_ids)
    assert list(last.prompt_token_ids[:len(context)]) == context  # the call as the model wrote it, then the result
    assert served.tokenizer.decode(last.prompt_token_ids[len(context):], skip_special_tokens=True).split() == \
        ["higher"]


def test_a_choice_the_backend_cannot_enforce_is_a_400_naming_it(served):
    client = OpenAI(base_url=served.url, api_key="unused", max_retries=0, timeout=60)
    other = {"type": "function", "function": {"name": "other"}}
    with pytest.raises(openai.BadRequestError, match="'tool_choice': 'required' with several tools"):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                       tools=[GUESS, other], tool_choice="required")
    with pytest.raises(openai.BadRequestError, match=r"'messages\[0\].tool_calls\[0\].function.arguments'"):
        client.chat.completions.create(model="policy", messages=[
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "guess", "arguments": "{4"}}]}])


# ------------------------------------------------------------ the example: a tool-using agent trained on a CPU

def test_the_tool_recipe_trains_a_streaming_tool_using_agent(tmp_path, monkeypatch):
    """examples/guess_number/recipe_tools.yaml at reduced size: streamed tool calls, recorded, trained on."""
    from pathlib import Path

    from agl_core.cli import main

    repo = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(repo)  # the recipe's paths are relative to the repository root
    run_dir = tmp_path / "run"
    code = main(["train", "examples/guess_number/recipe_tools.yaml", f"trainer.run_dir={run_dir}",
                 "trainer.total_steps=1", "trainer.test_freq=1", "trainer.save_freq=0", "trainer.progress=false",
                 "rollout.n=4", "algorithm.ppo_mini_batch_size=8"])
    assert code == 0
    last = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["rollout/n_succeeded"] == 28 and last["rollout/n_failed"] == 0
    assert last["training/n_calls"] >= 28 and last["training/n_calls_error"] == 0
    assert last["training/n_calls_incomplete"] == 0
    assert last["training/rollout_logprob_diff/max"] < 1e-4  # the streamed calls' log-probs are the trainer's
    assert 0 <= last["val/reward/mean"] <= 1
