"""Several policies: a call reaches its policy by model name or by its client's role; every span records it.

Real HTTP on 127.0.0.1: the official openai and anthropic clients in, the test policy endpoint behind
(it answers any model name and records the request it was sent), the memory store out.
"""

import anthropic
import openai
import pytest

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import ConfigError, GatewayConfig, validate_recipe
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.policies import route, selected, training_policies
from agl_core.rollout.agents import LLM
from agl_core.rollout.store import NewRollout

POLICIES = ["hinter", "guesser", "judge"]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def store():
    s = MemoryStore()
    s.enqueue([NewRollout("r1", Task(id="t1", input={}), metadata={"agent_name": "game"})])
    s.lease = s.dequeue("w", lease_s=60).lease  # the attempt's lease token, as the runner hands it to the agent
    yield s
    s.close()


@pytest.fixture
def gateway(endpoint, store):
    gw = Gateway(store, GatewayConfig(retry_backoff_s=0.01), sampling={"max_tokens": 16}, upstreams=[endpoint.url],
                 policies=POLICIES)
    server = gw.serve()
    gw.url = server.url
    yield gw
    server.stop()


def llm(gateway) -> LLM:
    return LLM(Gateway.base_url(gateway.url, "r1", "1", gateway.store.lease), "policy", "unused")


def openai_client(handle: LLM) -> openai.OpenAI:
    return openai.OpenAI(base_url=handle.base_url, api_key=handle.api_key, max_retries=0)


def spans(store):
    return store._entries["r1"].spans


def test_a_call_reaches_the_policy_its_model_names(endpoint, store, gateway):
    openai_client(llm(gateway)).chat.completions.create(model="guesser", messages=MESSAGES)
    assert endpoint.requests[-1]["model"] == "guesser"
    assert spans(store)[-1].attributes["policy"] == "guesser"


def test_a_role_client_reaches_its_policy_whatever_model_it_sends(endpoint, store, gateway):
    hinter = llm(gateway).for_role("hinter")
    assert hinter.model == "hinter" and hinter.base_url.endswith("/role/hinter/v1")
    openai_client(hinter).chat.completions.create(model="gpt-4o-mini", messages=MESSAGES)
    assert endpoint.requests[-1]["model"] == "hinter"  # sent upstream under the policy's name
    (span,) = spans(store)
    assert span.attributes["policy"] == "hinter"
    openai_client(hinter).completions.create(model="x", prompt="once")
    assert spans(store)[-1].attributes["policy"] == "hinter"


def test_a_streamed_call_names_its_policy(endpoint, store, gateway):
    stream = openai_client(llm(gateway).for_role("judge")).chat.completions.create(
        model="judge", messages=MESSAGES, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "echo: hi"
    assert endpoint.requests[-1]["model"] == "judge" and endpoint.requests[-1]["stream"] is True
    assert spans(store)[-1].attributes["policy"] == "judge"


def test_the_anthropic_and_responses_routes_name_a_policy(endpoint, store, gateway):
    role = llm(gateway).for_role("guesser")
    messages = anthropic.Anthropic(base_url=role.base_url.removesuffix("/v1"), api_key="unused", max_retries=0)
    reply = messages.messages.create(model="claude-x", max_tokens=16, messages=MESSAGES)
    assert reply.content[0].text == "echo: hi"
    assert endpoint.requests[-1]["model"] == "guesser" and spans(store)[-1].attributes["policy"] == "guesser"
    with messages.messages.stream(model="claude-x", max_tokens=16, messages=MESSAGES) as stream:
        assert "".join(stream.text_stream) == "echo: hi"
    assert spans(store)[-1].attributes["policy"] == "guesser"

    answer = openai_client(llm(gateway)).responses.create(model="hinter", input="hi")
    assert answer.output_text == "echo: hi"
    assert endpoint.requests[-1]["model"] == "hinter" and spans(store)[-1].attributes["policy"] == "hinter"
    answer = openai_client(role).responses.create(model="gpt-4o", input="hi")
    assert spans(store)[-1].attributes["policy"] == "guesser"


def test_a_call_naming_no_policy_is_refused_naming_the_policies(endpoint, store, gateway):
    sent = len(endpoint.requests)
    with pytest.raises(openai.NotFoundError) as err:
        openai_client(llm(gateway)).chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert "'gpt-4o' names no policy" in str(err.value) and "hinter, guesser, judge" in str(err.value)
    with pytest.raises(openai.NotFoundError) as err:
        openai_client(llm(gateway).for_role("critic")).chat.completions.create(model="hinter", messages=MESSAGES)
    assert "role 'critic' is not a policy" in str(err.value)
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=llm(gateway).base_url.removesuffix("/v1"), api_key="unused",
                            max_retries=0).messages.create(model="claude-x", max_tokens=8, messages=MESSAGES)
    assert len(endpoint.requests) == sent and spans(store) == []  # refused at the door: nothing sent, nothing stored


def test_a_run_of_one_policy_forwards_model_unchanged(endpoint, store):
    gw = Gateway(store, GatewayConfig(), upstreams=[endpoint.url])
    server = gw.serve()
    try:
        openai.OpenAI(base_url=Gateway.base_url(server.url, "r1", "1", store.lease), api_key="x", max_retries=0) \
            .chat.completions.create(model="anything", messages=MESSAGES)
    finally:
        server.stop()
    assert endpoint.requests[-1]["model"] == "anything" and spans(store)[-1].attributes["policy"] is None


def test_route_and_selection_rules():
    assert route([], "x", None) is None
    assert route(POLICIES, "hinter", "judge") == "judge"  # the client's role wins over the model it sends
    assert selected("hinter", None) and selected("hinter", ["hinter"]) and not selected("judge", ["hinter"])
    assert selected("solver_2", "solver_.*") and not selected("solver_2x1", "solver_\\d") and not selected(None, "x")
    recipe = validate_recipe({"policies": {"hinter": {}, "guesser": {"trainable": False}, "judge": {"base": True},
                                           "critic": {}},
                              "trainer": {"agent_match": "hinter|guesser|judge"}})
    assert training_policies(recipe.policies, recipe.trainer.agent_match) == ["hinter"]


@pytest.mark.parametrize("bad, says", [
    ({"policies": {"a/b": {}}}, "policy name 'a/b'"),
    ({"policies": {"j": {"base": True, "adapter": {"rank": 4}}}}, "a base policy"),
    ({"trainer": {"agent_match": ["x"]}}, "needs a policies section"),
    ({"policies": {"h": {}}, "trainer": {"agent_match": ["g"]}}, "names 'g'"),
    ({"policies": {"h": {}}, "trainer": {"agent_match": "("}}, "not a regular expression"),
    ({"policies": {"h": {}}, "trainer": {"agent_match": "g.*"}}, "matches none"),
])
def test_bad_policies_sections_are_refused_by_name(bad, says):
    with pytest.raises(ConfigError, match=says):
        validate_recipe(bad)
