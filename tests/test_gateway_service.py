"""The gateway as a service: its admin route, its clients, its settings from ``agl serve gateway``'s flags.

``agl serve gateway`` as a real process over a store service is exercised by tests/test_runner_service.py and
tests/faults/test_fault_runners.py.
"""

import httpx
import openai
import pytest

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import ConfigError, GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.gateway.client import check_gateway, set_policy
from agl_core.gateway.service import gateway_config
from agl_core.rollout.store import NewRollout
from agl_core.testing.endpoint import ByteTokenizer

TOKEN = "s3cret"
ADMIN = "the-trainers-own"


@pytest.fixture
def gateway():
    """A gateway with a token over a memory store holding one running rollout ``r1``."""
    store = MemoryStore()
    store.enqueue([NewRollout("r1", Task(id="t1", input={}), metadata={"mode": "train", "step": 1, "task_id": "t1",
                                                                       "sample_index": 0})])
    gw = Gateway(store, GatewayConfig(token=TOKEN, admin_token=ADMIN))
    gw.lease = store.dequeue("w", lease_s=60).lease
    server = gw.serve()
    gw.url, gw.memory = server.url, store
    yield gw
    server.stop()


def test_set_policy_points_the_gateway_at_the_policy_of_the_step(gateway, endpoint):
    now = set_policy(gateway.url, urls=[endpoint.url + "/"], weight_version=3,
                     sampling={"temperature": 0.5, "top_p": None, "max_tokens": 4}, seed=11, token=ADMIN)
    assert now == {"urls": [endpoint.url], "weight_version": 3, "sampling": {"temperature": 0.5, "max_tokens": 4},
                   "seed": 11}
    client = openai.OpenAI(base_url=Gateway.base_url(gateway.url, "r1", "1", gateway.lease), api_key=TOKEN,
                           max_retries=0)
    reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "apple"}])
    assert reply.choices[0].message.content == "echo"  # max_tokens=4 of the policy
    span, = gateway.memory._entries["r1"].spans
    assert span.attributes["weight_version"] == 3 and span.attributes["upstream"] == endpoint.url
    assert span.response_token_ids == ByteTokenizer().encode("echo")
    assert span.attributes["request"]["model"] == "policy"
    assert endpoint.requests[-1]["temperature"] == 0.5 and isinstance(endpoint.requests[-1]["seed"], int)
    check_gateway(gateway.url, TOKEN, connect_timeout_s=0)


@pytest.mark.parametrize("token", [None, "wrong", TOKEN])
def test_the_admin_route_refuses_a_missing_or_wrong_token_and_the_agents_token_and_changes_nothing(gateway, endpoint,
                                                                                                   token):
    gateway.upstreams.set([endpoint.url])
    gateway.weight_version = 1
    with pytest.raises(ValueError, match=rf"{gateway.url} answered PUT /v1/admin/policy with 401: missing or wrong"):
        set_policy(gateway.url, urls=["http://127.0.0.1:9/v1"], weight_version=2, token=token)
    assert gateway.upstreams.urls == (endpoint.url,) and gateway.weight_version == 1
    if token != TOKEN:
        with pytest.raises(ValueError, match=rf"the gateway at {gateway.url} refuses the token given"):
            check_gateway(gateway.url, token, connect_timeout_s=0)


def test_a_gateway_with_an_agents_token_and_no_admin_token_refuses_every_admin_call(endpoint, monkeypatch):
    monkeypatch.delenv("AGL_GATEWAY_ADMIN_TOKEN", raising=False)
    server = Gateway(MemoryStore(), GatewayConfig(token=TOKEN)).serve()
    try:
        for token in (None, TOKEN, ADMIN):
            with pytest.raises(ValueError, match="answered PUT /v1/admin/policy with 403: the admin routes need the "
                                                 "gateway's admin token"):
                set_policy(server.url, urls=[endpoint.url], weight_version=2, token=token)
    finally:
        server.stop()


@pytest.mark.parametrize("body, named", [
    ({"urls": "http://a/v1"}, "'urls' must be a list of URLs, got str"),
    ({"urls": ["http://a/v1", "ftp://b"]}, "'urls'[1] must be an http:// or https:// URL, got 'ftp://b'"),
    ({"weight_version": -1}, "'weight_version' must be in [0, "),
    ({"weight_version": "3"}, "'weight_version' must be an integer, got '3'"),
    ({"seed": 1.5}, "'seed' must be an integer"),
    ({"sampling": [1]}, "'sampling' must be an object, got list"),
    ({"sampling": {"temperature": -1}}, "'temperature' must be in [0.0, 100.0], got -1.0"),
    ({"upstreams": []}, "unknown field(s) 'upstreams'; allowed: 'urls', 'weight_version', 'sampling', 'seed'"),
])
def test_a_bad_policy_is_a_400_naming_the_field_and_changes_nothing(gateway, body, named):
    answer = httpx.put(f"{gateway.url}/v1/admin/policy", json=body, headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 400 and named in answer.json()["error"]["message"]
    assert (gateway.upstreams.urls, gateway.weight_version, gateway.sampling, gateway.seed) == ((), None, {}, None)


def test_a_gateway_that_does_not_answer_is_retried_then_named(caplog):
    with pytest.raises(ValueError, match=r"the gateway at http://127.0.0.1:9 does not answer .*gave up after 3 s"):
        set_policy("http://127.0.0.1:9", urls=[], weight_version=None, connect_timeout_s=3)
    assert sum("does not answer" in r.message and "retrying" in r.message for r in caplog.records) >= 2


@pytest.mark.parametrize("items, named", [
    (["max_n"], "--config 'max_n' is not of the form KEY=VALUE"),
    (["port=1"], "--config 'port=1': set port with --port"),
    (["max_connections=5"], "--config 'max_connections=5': set max_connections with --max-connections"),
    (["nope=1"], "--config 'nope=1': unknown gateway setting 'nope' (allowed: max_body_bytes,"),
    (["max_n=zero"], "--config max_n=zero: Input should be a valid integer"),
])
def test_bad_gateway_settings_name_the_item(items, named):
    with pytest.raises(ConfigError) as info:
        gateway_config(items, host="127.0.0.1", port=0, token=None)
    assert named in str(info.value)


def test_gateway_settings_from_flags_and_config_items():
    config = gateway_config(["max_n=16", "upstream_timeout_s=2.5", "max_upstream_bytes=4096"], host="127.0.0.1",
                            port=0, token="t", max_connections=7)
    assert (config.max_n, config.upstream_timeout_s, config.token) == (16, 2.5, "t")
    assert (config.max_upstream_bytes, config.max_connections) == (4096, 7)
