"""Exact contexts end to end: the embedded endpoint behind a real gateway, real openai/anthropic clients, the
trajectory aggregator: a continued conversation goes upstream as token ids, and the tokens trained are the tokens
sampled, turn after turn (agl_core.gateway.contexts)."""

from __future__ import annotations

import json
import threading

import pytest
from anthropic import Anthropic
from openai import OpenAI

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Rollout, Task
from agl_core.gateway import Gateway
from agl_core.rollout.context_record import EDITED, EXACT, FIRST, REBUILT
from agl_core.rollout.runner import context_metrics
from agl_core.rollout.store import NewRollout
from agl_plugin_traces.trajectory import trajectory_batch

from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import tiny_section

GUESS = {"type": "function", "function": {"name": "guess", "description": "Guess the secret.", "parameters": {
    "type": "object", "properties": {"number": {"type": "integer"}}, "required": ["number"]}}}
VOCABULARY = ["1", "2", "3", "4", "5", "6", "7", "guess", "a", "number", "higher", "lower", "[", "(", "=", ")]",
              "tools", ":", ")"]
ROLLOUTS = [f"r{i}" for i in range(4)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    section = tiny_section()
    section["model"]["build"]["vocabulary"] = VOCABULARY
    backend = create(TorchConfig.model_validate(section), tmp_path_factory.mktemp("contexts"), seed=0,
                     with_critic=False)
    backend.start_serving("policy")
    yield backend
    backend.stop_serving()


LEASES: dict[str, str] = {}
"""The lease token of each rollout's running attempt, as the runner hands it to the agent."""


def dequeue(store, n=1):
    for _ in range(n):
        attempt = store.dequeue("w", lease_s=60)
        LEASES[attempt.rollout_id] = attempt.lease


@pytest.fixture
def gateway(served):
    store = MemoryStore()
    store.enqueue([NewRollout(r, Task(id="t", input={})) for r in ROLLOUTS])
    dequeue(store, len(ROLLOUTS))
    server = Gateway(store, GatewayConfig(), upstreams=[served.url]).serve()
    yield store, server
    server.stop()


def openai_client(server, rollout="r0"):
    return OpenAI(base_url=Gateway.base_url(server.url, rollout, "1", LEASES[rollout]), api_key="unused", max_retries=0, timeout=60)


def calls(store, rollout="r0"):
    return sorted((s for s in store._entries[rollout].spans if s.kind == "llm_call"), key=lambda s: s.sequence_id)


def assert_trained_as_sampled(spans):
    """One merged row whose response tokens with mask 1 are, in order, exactly the tokens each call sampled."""
    rollout = Rollout(rollout_id="r", task_id="t", status="succeeded", final_reward=1.0, spans=spans)
    batch, metrics, _ = trajectory_batch([rollout], max_prompt_length=64, max_response_length=512)
    assert metrics["training/n_unmerged_rollouts"] == 0 and len(batch) == 1
    mask = batch["response_mask"][0].bool()
    trained = batch["responses"][0][mask].tolist()
    assert trained == [t for s in spans for t in s.response_token_ids]
    # ... and the context the model saw before each sample is the row itself, token for token.
    row = batch["prompts"][0][batch["attention_mask"][0][:64].bool()].tolist() + batch["responses"][0].tolist()
    for span in spans:
        prompt = list(span.prompt_token_ids)
        assert row[:len(prompt)] == prompt


def play(client, messages, turns, **kwargs):
    for turn in range(turns):
        reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=3, seed=turn, **kwargs)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "higher"}]
    return messages


def test_a_multi_turn_chat_goes_upstream_as_the_tokens_it_sampled(served, gateway):
    store, server = gateway
    play(openai_client(server), [{"role": "user", "content": "guess a number"}], turns=4)
    spans = calls(store)
    assert [s.attributes["context"] for s in spans] == [FIRST, EXACT, EXACT, EXACT]
    for before, after in zip(spans, spans[1:]):
        context = list(before.prompt_token_ids) + list(before.response_token_ids)
        assert list(after.prompt_token_ids[:len(context)]) == context
    assert_trained_as_sampled(spans)
    rollout = Rollout(rollout_id="r0", task_id="t", status="succeeded", spans=spans)
    assert context_metrics([rollout]) == {"rollout/n_context_exact": 3.0, "rollout/n_context_rebuilt": 0.0}


def test_a_reply_cut_by_max_tokens_is_closed_by_the_template_not_re_rendered(served, gateway):
    """The model's cut reply stays as sampled; the template's end-of-turn follows it; then the new message."""
    store, server = gateway
    play(openai_client(server), [{"role": "user", "content": "guess a number"}], turns=2)
    first, second = calls(store)
    end = served.tokenizer.convert_tokens_to_ids("<|end|>")
    context = list(first.prompt_token_ids) + list(first.response_token_ids)
    closing = [] if context[-1] == end else [end]
    new = served.tokenizer.apply_chat_template([{"role": "user", "content": "higher"}], add_generation_prompt=True,
                                               return_dict=False)
    assert list(second.prompt_token_ids) == context + closing + list(new)


def test_tool_calls_and_their_results_keep_the_exact_context(served, gateway):
    store, server = gateway
    client = openai_client(server)
    messages = [{"role": "user", "content": "guess a number"}]
    for turn in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[GUESS], seed=turn,
                                               tool_choice="required", max_tokens=3)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "higher"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "invalid"})
    spans = calls(store)
    assert [s.attributes["context"] for s in spans] == [FIRST, EXACT, EXACT]
    assert any(s.attributes["response"]["choices"][0]["message"].get("tool_calls") for s in spans)
    assert_trained_as_sampled(spans)


def test_a_streamed_call_keeps_the_exact_context_and_streams_the_same_answer(served, gateway):
    store, server = gateway
    client = openai_client(server)
    messages = play(client, [{"role": "user", "content": "guess a number"}], turns=1)
    chunks = list(client.chat.completions.create(model="policy", messages=messages, max_tokens=3, seed=7,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    spans = calls(store)
    assert [s.attributes["context"] for s in spans] == [FIRST, EXACT]
    assert text == spans[-1].attributes["response"]["choices"][0]["message"]["content"]
    assert len(chunks) > 2  # relayed as sampled, a chunk per token: not one whole answer cut in two
    assert_trained_as_sampled(spans)


def test_a_streamed_tool_call_on_the_token_path_is_parsed_at_its_end(served, gateway):
    store, server = gateway
    client = openai_client(server)
    messages = [{"role": "user", "content": "guess a number"}]
    for turn in range(3):
        calls_made: dict[int, dict] = {}
        content = ""
        for chunk in client.chat.completions.create(model="policy", messages=messages, tools=[GUESS], seed=turn,
                                                    tool_choice="required", max_tokens=3, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for call in choice.delta.tool_calls or ():
                    slot = calls_made.setdefault(call.index, {"id": call.id, "type": "function",
                                                              "function": {"name": "", "arguments": ""}})
                    slot["function"]["name"] += call.function.name or ""
                    slot["function"]["arguments"] += call.function.arguments or ""
        message = {"role": "assistant", "content": content or None}
        if calls_made:
            message["tool_calls"] = [calls_made[k] for k in sorted(calls_made)]
        messages.append(message)
        messages += ([{"role": "tool", "tool_call_id": c["id"], "content": "higher"} for c in message["tool_calls"]]
                     if calls_made else [{"role": "user", "content": "invalid"}])
    spans = calls(store)
    assert [s.attributes["context"] for s in spans] == [FIRST, EXACT, EXACT]
    recorded = [s.attributes["response"]["choices"][0]["message"] for s in spans]
    assert any(m.get("tool_calls") for m in recorded)
    for message, sent in zip(recorded, [m for m in messages if m["role"] == "assistant"]):
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or ()] \
            == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in sent.get("tool_calls") or ()]
    assert_trained_as_sampled(spans)


def test_the_anthropic_and_responses_routes_keep_exact_contexts(served, gateway):
    store, server = gateway
    anthropic = Anthropic(base_url=Gateway.base_url(server.url, "r1", "1", LEASES["r1"])[:-len("/v1")], api_key="unused",
                          max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "guess a number"}]
    for _ in range(3):
        reply = anthropic.messages.create(model="policy", max_tokens=3, messages=messages)
        messages += [{"role": "assistant", "content": [block.model_dump() for block in reply.content]},
                     {"role": "user", "content": "higher"}]
    assert [s.attributes["context"] for s in calls(store, "r1")] == [FIRST, EXACT, EXACT]
    assert_trained_as_sampled(calls(store, "r1"))

    client = openai_client(server, "r2")
    previous = None
    for text in ("guess a number", "higher", "lower"):
        response = client.responses.create(model="policy", input=text, previous_response_id=previous,
                                           max_output_tokens=3)
        previous = response.id
    assert [s.attributes["context"] for s in calls(store, "r2")] == [FIRST, EXACT, EXACT]
    assert_trained_as_sampled(calls(store, "r2"))


def test_an_agent_that_edits_its_history_falls_back_to_text_and_is_counted(served, gateway):
    store, server = gateway
    client = openai_client(server)
    messages = play(client, [{"role": "user", "content": "guess a number"}], turns=2)
    messages[1] = {"role": "assistant", "content": "4"}  # the agent rewrote the model's first reply
    client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "a number"}], max_tokens=2)
    spans = calls(store)
    assert [s.attributes["context"] for s in spans] == [FIRST, EXACT, REBUILT, REBUILT]
    assert spans[2].attributes["context_reason"] == EDITED
    assert spans[3].attributes["context_reason"] != EDITED  # another conversation, told apart
    rollout = Rollout(rollout_id="r0", task_id="t", status="succeeded", spans=spans)
    assert context_metrics([rollout])["rollout/n_context_rebuilt"] == 2.0


def test_concurrent_rollouts_keep_their_own_contexts(served, gateway):
    store, server = gateway
    errors = []

    def agent(rollout):
        try:
            play(openai_client(server, rollout), [{"role": "user", "content": f"guess {rollout[-1]}"}], turns=3)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=agent, args=(r,)) for r in ROLLOUTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for rollout in ROLLOUTS:
        spans = calls(store, rollout)
        assert [s.attributes["context"] for s in spans] == [FIRST, EXACT, EXACT]
        assert_trained_as_sampled(spans)


def test_a_retried_call_continues_the_same_context(served, gateway):
    """An agent that sends the same request again (its client retried) gets the same exact prompt."""
    store, server = gateway
    client = openai_client(server)
    messages = play(client, [{"role": "user", "content": "guess a number"}], turns=1)
    for _ in range(2):
        client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
    first, retried, again = calls(store)
    assert retried.attributes["context"] == again.attributes["context"] == EXACT
    assert list(retried.prompt_token_ids) == list(again.prompt_token_ids)
    assert_trained_as_sampled([first, again])


def test_exact_contexts_can_be_switched_off(served):
    store = MemoryStore()
    store.enqueue([NewRollout("r0", Task(id="t", input={}))])
    dequeue(store)
    server = Gateway(store, GatewayConfig(exact_contexts=False), upstreams=[served.url]).serve()
    try:
        play(openai_client(server), [{"role": "user", "content": "guess a number"}], turns=2)
    finally:
        server.stop()
    assert all("context" not in s.attributes for s in calls(store))
    assert json.dumps(calls(store)[-1].attributes["request"]["messages"])  # recorded as before
