"""The gateway over real HTTP on 127.0.0.1: the openai client in, the test policy endpoint behind, spans out."""

import threading
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from agl_plugin_sqlite import SqliteStore

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.gateway.server import call_seed
from agl_core.gateway.upstream import Upstreams
from agl_core.http.server import ServerThread
from agl_core.rollout.store import NewRollout
from agl_core.rollout.store_client import HttpStore
from agl_core.rollout.store_server import RESERVE_SEQUENCE_IDS, StoreService
from agl_core.testing.endpoint import ByteTokenizer, TestEndpoint, response_logprob

TOKENIZER = ByteTokenizer()
LEASES: dict[str, str] = {}
"""The lease token of each rollout's running attempt, as the tests' runner (the fixtures) dequeued it."""


@pytest.fixture
def store():
    s = MemoryStore()
    s.enqueue([NewRollout("r1", Task(id="t1", input={}), metadata={"agent_name": "echoer"})])
    LEASES.clear()
    LEASES["r1"] = s.dequeue("w", lease_s=60).lease
    yield s
    s.close()


@pytest.fixture
def serve():
    servers = []

    def start(store, upstreams, seed=None, **config):
        gateway = Gateway(store, GatewayConfig(**{"retry_backoff_s": 0.01, **config}),
                          sampling={"temperature": 0.7, "max_tokens": 64}, upstreams=upstreams, seed=seed)
        servers.append(gateway.serve())
        return gateway, servers[-1]

    yield start
    for server in servers:
        server.stop()


def client(server, rollout="r1", attempt="1", api_key="unused"):
    return openai.OpenAI(base_url=base_url(server.url, rollout, attempt), api_key=api_key, max_retries=0)


def base_url(url, rollout="r1", attempt="1"):
    return Gateway.base_url(url, rollout, attempt, LEASES.get(rollout, "no-lease"))


def spans(store, rollout="r1"):
    return store._entries[rollout].spans


def test_a_chat_call_is_recorded_with_exact_token_ids(endpoint, store, serve):
    gateway, server = serve(store, [endpoint.url])
    gateway.weight_version = 7
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = client(server).chat.completions.create(model="policy", messages=messages, temperature=0.2)
    assert reply.choices[0].message.content == "echo: hi"

    sent = endpoint.requests[-1]
    assert sent["return_token_ids"] is True and sent["logprobs"] is True
    assert sent["temperature"] == 0.2 and sent["max_tokens"] == 64  # the agent's choice wins, defaults fill in

    (span,) = spans(store)
    response_ids = TOKENIZER.encode("echo: hi")
    assert span.kind == "llm_call" and (span.rollout_id, span.attempt_id, span.sequence_id) == ("r1", "1", 0)
    assert span.prompt_token_ids == TOKENIZER.encode(TOKENIZER.chat_prompt(messages))
    assert span.response_token_ids == response_ids
    assert span.response_logprobs == [response_logprob(t, i) for i, t in enumerate(response_ids)]
    attrs = span.attributes
    assert attrs["request"] == {"model": "policy", "messages": messages, "temperature": 0.2}
    assert attrs["response"]["choices"][0]["message"]["content"] == "echo: hi"
    # the per-token fields are the span's own; the recorded response does not repeat them
    assert "prompt_token_ids" not in attrs["response"]
    assert {"logprobs", "token_ids"}.isdisjoint(attrs["response"]["choices"][0])
    assert attrs["upstream"] == endpoint.url and attrs["status_code"] == 200 and attrs["upstream_tries"] == 1
    assert attrs["agent_name"] == "echoer" and attrs["weight_version"] == 7 and "error" not in attrs
    assert span.start_time <= span.end_time


def test_completions_with_n_choices_give_one_span_each(endpoint, store, serve):
    _, server = serve(store, [endpoint.url])
    reply = client(server).completions.create(model="policy", prompt="abc", n=2, max_tokens=4)
    assert [c.text for c in reply.choices] == ["echo", "echo"] and reply.choices[0].finish_reason == "length"
    assert endpoint.requests[-1]["logprobs"] == 0
    recorded = spans(store)
    assert [(s.sequence_id, s.attributes["choice_index"]) for s in recorded] == [(0, 0), (1, 1)]
    assert all(s.prompt_token_ids == TOKENIZER.encode("abc") for s in recorded)
    assert all(s.response_token_ids == TOKENIZER.encode("echo") for s in recorded)


def test_the_request_is_stored_once_and_each_span_holds_its_own_choice(endpoint, store, serve):
    """Storage grows linearly with n: one request per call, one choice per span (n² before)."""
    _, server = serve(store, [endpoint.url], max_n=40)
    client(server).completions.create(model="policy", prompt="abc", n=40, max_tokens=4)
    first, *others = spans(store)
    assert first.attributes["request"]["n"] == 40 and "request_sequence_id" not in first.attributes
    assert all("request" not in s.attributes and s.attributes["request_sequence_id"] == first.sequence_id
               for s in others)
    assert [[c["index"] for c in s.attributes["response"]["choices"]] for s in (first, *others)] == [
        [i] for i in range(40)]
    assert len(others) == 39 and all(s.response_token_ids == TOKENIZER.encode("echo") for s in others)


def test_calls_of_a_rollout_are_ordered(endpoint, store, serve):
    _, server = serve(store, [endpoint.url])
    llm = client(server)
    for word in ("one", "two", "three"):
        llm.chat.completions.create(model="policy", messages=[{"role": "user", "content": word}])
    assert [(s.sequence_id, s.response_token_ids) for s in spans(store)] == [
        (i, TOKENIZER.encode(f"echo: {w}")) for i, w in enumerate(("one", "two", "three"))]


@pytest.mark.parametrize("path, body, status, message", [
    ("r1/attempt/1/v1/chat/completions", b"{not json", 400, "not valid JSON"),
    ("r1/attempt/1/v1/chat/completions", b"[1, 2]", 400, "must be a JSON object"),
    ("r1/attempt/1/v1/chat/completions", b'{"model": "m"}', 400, "'messages' must be a non-empty list"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": []}', 400, "'messages' must be a non-empty list"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', 400,
     "'n' must be in [1, 64], got 0"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "n": 100000}', 400,
     "'n' must be in [1, 64], got 100000"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}', 400,
     "'max_tokens' must be in [1, "),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     400, "'temperature' must be a finite number"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}',
     400, "'top_p' must be a finite number"),
    ("r1/attempt/1/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "temperature": 1e-300}', 400, "'temperature' must be 0"),
    ("r1/attempt/1/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551616}', 400, "'seed' must be in"),
    ("r1/attempt/1/v1/completions", b'{"prompt": "x", "logprobs": 21}', 400, "'logprobs' must be in [0, 20]"),
    ("r1/attempt/1/v1/chat/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ("r1/attempt/1/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "nested too deeply"),
    ("r1/attempt/1/v1/completions", b'{"prompt": [1, 2, 3]}', 400, "'prompt' must be a string"),
    ("nope/attempt/1/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 404,
     "unknown rollout 'nope'"),
    ("r1/attempt/2/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}]}', 409,
     "attempt '2' of rollout 'r1' is not running"),
])
def test_malformed_requests_get_4xx_and_nothing_is_written(endpoint, store, serve, path, body, status, message):
    _, server = serve(store, [endpoint.url])
    rollout, _, rest = path.partition("/attempt/")
    attempt, _, route = rest.partition("/v1/")
    response = httpx.post(f"{base_url(server.url, rollout, attempt)}/{route}", content=body, timeout=10)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert spans(store) == [] and endpoint.calls == 0 and store.next_sequence_id("r1") == 0


def test_an_oversized_body_is_refused_whether_declared_or_streamed(endpoint, store, serve):
    _, server = serve(store, [endpoint.url], max_body_bytes=2048)
    url = f"{base_url(server.url)}/chat/completions"
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * 4096 + b'"}]}'
    declared = httpx.post(url, content=big, timeout=10)
    chunked = httpx.post(url, content=iter([big[:1000], big[1000:]]), timeout=10)  # no Content-Length
    for response in (declared, chunked):
        assert response.status_code == 413 and "exceeds 2048 bytes" in response.json()["error"]["message"]
    assert spans(store) == [] and endpoint.calls == 0


def test_429_and_5xx_are_retried_with_backoff(endpoint, store, serve):
    _, server = serve(store, [endpoint.url], max_retries=3)
    endpoint.fail_next.extend([503, 429, 500])
    reply = client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert reply.choices[0].message.content == "echo: x"
    (span,) = spans(store)
    assert span.attributes["upstream_tries"] == 4 and "error" not in span.attributes
    assert endpoint.calls == 4


def test_an_upstream_error_after_retries_reaches_the_agent_and_is_recorded(endpoint, store, serve):
    _, server = serve(store, [endpoint.url], max_retries=1)
    endpoint.fail_next.extend([500, 502, 503])
    with pytest.raises(openai.InternalServerError):
        client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    (span,) = spans(store)
    assert span.attributes["error"] == "the policy server answered 502" and span.attributes["upstream_tries"] == 2
    assert span.response_token_ids == []


def test_a_client_error_of_the_upstream_is_not_retried(endpoint, store, serve):
    _, server = serve(store, [endpoint.url])
    endpoint.fail_next.append(400)
    with pytest.raises(openai.BadRequestError, match="injected failure 400"):
        client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert endpoint.calls == 1 and spans(store)[0].attributes["error"] == "the policy server answered 400"


def test_an_unreachable_or_missing_upstream_is_an_error_span(store, serve):
    gateway, server = serve(store, [], max_retries=1)
    with pytest.raises(openai.InternalServerError, match="no policy server"):
        client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    gateway.upstreams.set(["http://127.0.0.1:9/v1"])  # the discard port: connection refused
    with pytest.raises(openai.InternalServerError, match="cannot reach the policy server"):
        client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
    assert [s.attributes["status_code"] for s in spans(store)] == [503, 502]
    assert all(s.attributes["error"] for s in spans(store))


def test_an_upstream_without_token_ids_is_flagged_not_retokenized(store, serve):
    async def plain(request):
        return JSONResponse({"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]})

    upstream = ServerThread(Starlette(routes=[Route("/v1/chat/completions", plain, methods=["POST"])])).start()
    try:
        _, server = serve(store, [upstream.url + "/v1"])
        reply = client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "hello"
    finally:
        upstream.stop()
    (span,) = spans(store)
    assert "no token ids" in span.attributes["error"] and span.response_token_ids == []


def test_off_loopback_the_gateway_requires_its_token(endpoint, store, serve, monkeypatch):
    monkeypatch.delenv("AGL_GATEWAY_TOKEN", raising=False)
    with pytest.raises(ValueError, match="not a loopback address: set rollout.gateway.token"):
        Gateway(store, GatewayConfig(host="0.0.0.0"))
    _, server = serve(store, [endpoint.url], host="0.0.0.0", token="s3cret")
    local = server.url.replace("0.0.0.0", "127.0.0.1")
    url = f"{base_url(local)}/chat/completions"
    body = {"messages": [{"role": "user", "content": "x"}]}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        response = httpx.post(url, json=body, headers=headers, timeout=10)
        assert response.status_code == 401 and "bearer token" in response.json()["error"]["message"]
    assert spans(store) == [] and endpoint.calls == 0
    llm = openai.OpenAI(base_url=base_url(local), api_key="s3cret", max_retries=0)
    assert llm.chat.completions.create(model="m", messages=body["messages"]).choices[0].message.content == "echo: x"
    assert len(spans(store)) == 1


def test_healthz_shows_its_upstreams_only_to_callers_with_the_token(endpoint, store, serve):
    _, server = serve(store, [endpoint.url], host="0.0.0.0", token="s3cret")
    url = f"http://127.0.0.1:{server.port}/healthz"
    assert httpx.get(url, timeout=10).json() == {"ok": True}
    assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}, timeout=10).json() == {
        "ok": True, "upstreams": [endpoint.url]}


def test_the_upstream_token_is_sent_to_the_policy_servers(store, serve, monkeypatch):
    seen = []

    async def answer(request):
        seen.append(request.headers.get("authorization"))
        return JSONResponse({"error": {"message": "no"}}, status_code=400)

    upstream = ServerThread(Starlette(routes=[Route("/v1/chat/completions", answer, methods=["POST"])])).start()
    try:
        monkeypatch.setenv("AGL_POLICY_TOKEN", "from-env")
        for config, expected in (({}, "Bearer from-env"), ({"upstream_token": "t0k"}, "Bearer t0k")):
            _, server = serve(store, [upstream.url + "/v1"], **config)
            with pytest.raises(openai.BadRequestError):
                client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
            assert seen[-1] == expected
    finally:
        upstream.stop()


def test_the_token_can_come_from_the_environment(store, monkeypatch):
    monkeypatch.setenv("AGL_GATEWAY_TOKEN", "from-env")
    assert Gateway(store, GatewayConfig(host="0.0.0.0")).token == "from-env"


def test_each_rollout_is_pinned_to_one_upstream(store, serve):
    endpoints = [TestEndpoint(), TestEndpoint()]
    servers = [ep.serve() for ep in endpoints]
    try:
        store.enqueue([NewRollout(f"p{i}", Task(id="t", input={})) for i in range(8)])
        attempts = [store.dequeue("w", 60) for _ in range(8)]
        LEASES.update({attempt.rollout_id: attempt.lease for attempt in attempts})
        _, gateway_server = serve(store, [s.url + "/v1" for s in servers])
        for attempt in attempts:
            llm = client(gateway_server, attempt.rollout_id, attempt.attempt_id)
            for _ in range(3):
                llm.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        for attempt in attempts:
            assert len({s.attributes["upstream"] for s in spans(store, attempt.rollout_id)}) == 1
        assert all(ep.calls > 0 for ep in endpoints)  # and the rollouts are spread over both
    finally:
        for server in servers:
            server.stop()


def test_the_pin_is_a_stable_hash():
    upstreams = Upstreams(["http://a/v1/", "http://b/v1"])
    assert upstreams.urls == ("http://a/v1", "http://b/v1")
    assert [upstreams.pick(f"r{i}") for i in range(50)] == [Upstreams(["http://a/v1", "http://b/v1"]).pick(f"r{i}")
                                                           for i in range(50)]
    assert {upstreams.pick(f"r{i}") for i in range(50)} == {"http://a/v1", "http://b/v1"}
    assert Upstreams().pick("r") is None


def test_a_call_in_flight_when_its_rollout_is_consumed_is_answered_not_recorded(endpoint, store, serve):
    _, server = serve(store, [endpoint.url])
    endpoint.delay_s = 1.0  # time to consume the rollout while the call is in flight
    answers = []
    call = threading.Thread(target=lambda: answers.append(client(server).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "slow"}])))
    call.start()
    deadline = time.monotonic() + 10
    while endpoint.calls == 0:  # until the call reached the policy server
        assert time.monotonic() < deadline, "the call never reached the policy server"
        time.sleep(0.01)
    store.finish("r1", "1", "timed_out", lease=LEASES["r1"])
    store.release(["r1"])
    call.join(10)
    assert answers[0].choices[0].message.content == "echo: slow"
    assert store._entries == {}


def test_a_call_without_a_seed_gets_one_from_its_place_in_the_run(endpoint, store, serve):
    _, server = serve(store, [endpoint.url], seed=3)
    messages = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        client(server).chat.completions.create(model="policy", messages=messages)
    client(server).chat.completions.create(model="policy", messages=messages, seed=11)
    sent = [request.get("seed") for request in list(endpoint.requests)[-3:]]
    metadata = {"agent_name": "echoer"}  # no place keys: the rollout id stands for the place
    assert sent == [call_seed(3, metadata, "r1", "1", 0), call_seed(3, metadata, "r1", "1", 1), 11]
    assert sent[0] != sent[1]
    assert "seed" not in spans(store)[0].attributes["request"]  # the agent's own request is recorded as sent


def test_without_a_run_seed_calls_go_unseeded(endpoint, store, serve):
    _, server = serve(store, [endpoint.url])
    client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert "seed" not in endpoint.requests[-1]


def test_a_call_seed_depends_on_the_place_not_on_the_rollout_id():
    place = {"mode": "train", "step": 3, "task_id": "a", "sample_index": 1, "agent_name": "x"}
    assert call_seed(1, place, "train-3-0f0f", "1", 2) == call_seed(1, place, "train-3-a1a1", "1", 2)
    others = [call_seed(2, place, "r", "1", 2), call_seed(1, place, "r", "2", 2), call_seed(1, place, "r", "1", 3),
              call_seed(1, {**place, "step": 4}, "r", "1", 2), call_seed(1, {**place, "sample_index": 0}, "r", "1", 2)]
    assert len({call_seed(1, place, "r", "1", 2), *others}) == 6
    assert all(0 <= seed < 2**63 for seed in others)


def test_the_weight_version_the_policy_server_reports_is_recorded(endpoint, store, serve):
    gateway, server = serve(store, [endpoint.url])
    gateway.weight_version, endpoint.weight_version = 9, 4
    client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert spans(store)[0].attributes["weight_version"] == 4


def test_a_store_that_cannot_write_fails_the_call_with_503_naming_why(endpoint, store, serve, monkeypatch):
    def broken(spans, leases=None):
        raise RuntimeError("spans cannot be written to the SQLite store /x.sqlite: disk I/O error")

    monkeypatch.setattr(store, "add_spans", broken)
    _, server = serve(store, [endpoint.url])
    for _ in range(2):  # the gateway keeps answering
        with pytest.raises(openai.InternalServerError, match="cannot record this call: spans cannot be written"):
            client(server).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])


def test_over_a_store_service_a_finish_right_after_the_last_answer_sees_its_span(endpoint, serve, tmp_path):
    """Gateway, runner and trainer each with their own client of the store service, as in three processes: the
    gateway uploads a call's span after answering, and the service's finish waits for the spans it admitted."""
    backing = SqliteStore(tmp_path / "served.sqlite", reserve_sequence_ids=RESERVE_SEQUENCE_IDS, batch_spans=False)
    service = StoreService(backing)
    with service.server() as store_server:
        trainer, runner, for_gateway = (HttpStore(store_server.url) for _ in range(3))
        _, server = serve(for_gateway, [endpoint.url])
        trainer.enqueue([NewRollout(f"r{i}", Task(id="t", input={})) for i in range(20)])
        for i in range(20):
            attempt = runner.dequeue("w", lease_s=60)
            LEASES[attempt.rollout_id] = attempt.lease
            for turn in range(3):
                client(server, attempt.rollout_id, attempt.attempt_id).chat.completions.create(
                    model="policy", messages=[{"role": "user", "content": f"turn {turn}"}])
            assert runner.finish(attempt.rollout_id, attempt.attempt_id, "succeeded", final_reward=1.0,
                                 lease=attempt.lease)
            [rollout] = trainer.get_rollouts([attempt.rollout_id])
            assert [s.sequence_id for s in rollout.spans] == [0, 1, 2]
        for store in (trainer, runner, for_gateway):
            store.close()
    service.close()
    backing.close()


class ThreadAwareStore(MemoryStore):
    """A store whose own admit (as a SQLite or service store has) says which thread it ran on."""

    admits_at_once = False  # an admit that may wait, as those stores' do

    def __init__(self):
        super().__init__()
        self.admitted_on: list[str] = []

    def admit(self, rollout_id, attempt_id, n, *, lease=None):
        self.admitted_on.append(threading.current_thread().name)
        return super().admit(rollout_id, attempt_id, n, lease=lease)


def test_a_store_that_admits_at_once_admits_on_the_event_loop_any_other_store_off_it(endpoint, store, serve,
                                                                                       monkeypatch):
    admitted_on = []
    next_id = store.next_sequence_id  # called inside the memory store's admit, on the thread admit runs on
    monkeypatch.setattr(store, "next_sequence_id",
                        lambda rollout_id: admitted_on.append(threading.current_thread().name) or next_id(rollout_id))
    _, server = serve(store, [endpoint.url])
    client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert admitted_on == ["agl-gateway"]  # the server's thread: no hop to a worker for a dict update

    other = ThreadAwareStore()  # an admit that may wait: a worker thread runs it
    other.enqueue([NewRollout("r1", Task(id="t1", input={}))])
    LEASES["r1"] = other.dequeue("w", lease_s=60).lease
    _, server = serve(other, [endpoint.url])
    client(server).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert len(other.admitted_on) == 1 and other.admitted_on[0] != "agl-gateway"
    assert len(spans(other)) == 1
