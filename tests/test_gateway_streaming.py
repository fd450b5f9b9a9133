"""Streamed calls through the gateway over real HTTP on 127.0.0.1: the openai client with ``stream=True`` in,
the test policy endpoint (which streams token ids the way vLLM does) or a server that answers whole behind,
spans out: the same spans as a non-streamed call, and an incomplete one when the agent leaves mid-stream."""

import asyncio
import json
import time

import httpx
import openai
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway, streaming
from agl_core.gateway.capture import CHAT, COMPLETIONS
from agl_core.gateway.server import call_seed
from agl_core.gateway.streaming import CallStream, EventStreamResponse, SSEParser, StreamAssembly, chunks_of
from agl_core.http.server import ServerThread
from agl_core.rollout.store import NewRollout
from agl_core.testing.endpoint import ByteTokenizer, TestEndpoint

TOKENIZER = ByteTokenizer()
ROLLOUTS = ("plain", "streamed")

LEASES: dict[str, str] = {}
"""The lease token of each rollout's running attempt (the ``store`` fixture's)."""


@pytest.fixture
def store():
    s = MemoryStore()
    s.enqueue([NewRollout(r, Task(id="t1", input={}), metadata={"agent_name": "echoer"}) for r in ROLLOUTS])
    LEASES.clear()
    for _ in range(2):
        attempt = s.dequeue("w", lease_s=60)
        LEASES[attempt.rollout_id] = attempt.lease
    yield s
    s.close()


@pytest.fixture
def gateway(store, endpoint):
    gateway = Gateway(store, GatewayConfig(retry_backoff_s=0.01), sampling={"temperature": 0.7, "max_tokens": 64},
                      upstreams=[endpoint.url], seed=7)
    server = gateway.serve()
    yield gateway, server
    server.stop()


def client(server, rollout):
    return openai.OpenAI(base_url=Gateway.base_url(server.url, rollout, "1", LEASES.get(rollout, "no-lease")), api_key="unused",
                         max_retries=0)


def llm_spans(store, rollout):
    return [s for s in store._entries[rollout].spans if s.kind == "llm_call"]


def same_recording(plain, streamed):
    """The fields a trainer reads are identical; the request differs only by ``stream``."""
    assert [s.prompt_token_ids for s in streamed] == [s.prompt_token_ids for s in plain]
    assert [s.response_token_ids for s in streamed] == [s.response_token_ids for s in plain]
    assert [s.response_logprobs for s in streamed] == [s.response_logprobs for s in plain]
    for p, s in zip(plain, streamed):
        assert "error" not in s.attributes and "incomplete" not in s.attributes
        assert s.attributes["choice_index"] == p.attributes["choice_index"]
        assert s.attributes["response"]["choices"][0]["finish_reason"] == \
            p.attributes["response"]["choices"][0]["finish_reason"]


@pytest.mark.parametrize("n", [1, 3])
def test_a_streamed_chat_call_records_what_the_same_call_not_streamed_records(store, gateway, n):
    _, server = gateway
    messages = [{"role": "user", "content": "héllo"}]
    plain = client(server, "plain").chat.completions.create(model="m", messages=messages, n=n)
    stream = client(server, "streamed").chat.completions.create(
        model="m", messages=messages, n=n, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
            for i in range(n)}
    assert text == {i: plain.choices[i].message.content for i in range(n)}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # Token ids travel in the chunks, as vLLM streams them: the agent gets them too.
    assert chunks[0].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    same_recording(llm_spans(store, "plain"), llm_spans(store, "streamed"))
    assert llm_spans(store, "streamed")[0].attributes["request"]["stream"] is True


def test_a_streamed_completion_records_what_the_same_completion_not_streamed_records(store, gateway):
    _, server = gateway
    plain = client(server, "plain").completions.create(model="m", prompt="count to three", n=2)
    chunks = list(client(server, "streamed").completions.create(model="m", prompt="count to three", n=2,
                                                                  stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == 1) == plain.choices[1].text
    same_recording(llm_spans(store, "plain"), llm_spans(store, "streamed"))


def test_a_streamed_call_gets_the_seed_of_its_place_in_the_run_as_a_call_not_streamed(store, gateway, endpoint):
    _, server = gateway
    client(server, "plain").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    list(client(server, "streamed").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            stream=True))
    plain, streamed = list(endpoint.requests)[-2:]
    metadata = {"agent_name": "echoer"}
    assert plain["seed"] == call_seed(7, metadata, "plain", "1", 0)
    assert streamed["seed"] == call_seed(7, metadata, "streamed", "1", 0) and streamed["stream"] is True
    assert streamed["return_token_ids"] is True and streamed["logprobs"] is True


def test_an_agent_that_leaves_mid_stream_leaves_an_incomplete_span(store, gateway, endpoint):
    _, server = gateway
    endpoint.token_delay_s = 0.05
    long = "a long answer " * 3
    with client(server, "streamed").chat.completions.create(
            model="m", messages=[{"role": "user", "content": long}], stream=True) as stream:
        for count, _ in enumerate(stream):
            if count == 3:
                break  # the context manager closes the connection: the agent is gone
    deadline = time.time() + 5
    while not llm_spans(store, "streamed") and time.time() < deadline:
        time.sleep(0.02)
    [span] = llm_spans(store, "streamed")
    assert span.attributes["incomplete"] is True and "error" not in span.attributes
    assert 0 < len(span.response_token_ids) < len(TOKENIZER.encode("echo: " + long))
    assert len(span.response_logprobs) == len(span.response_token_ids)
    deadline = time.time() + 5
    while endpoint.streams_cut == 0 and time.time() < deadline:  # the gateway dropped the upstream stream too
        time.sleep(0.02)
    assert endpoint.streams_cut == 1


def test_refusals_come_before_the_stream_with_a_4xx_and_write_nothing(store, gateway):
    _, server = gateway
    with pytest.raises(openai.NotFoundError, match="unknown rollout"):
        list(client(server, "nope").chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                            stream=True))
    with pytest.raises(openai.BadRequestError, match="'messages'"):
        list(client(server, "streamed").chat.completions.create(model="m", messages=[], stream=True))
    with pytest.raises(openai.BadRequestError, match="'n'"):
        list(client(server, "streamed").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], n=10_000, stream=True))
    for extra, field in (({"stream": "yes"}, "'stream' must be true or false"),
                         ({"stream_options": "usage"}, "'stream_options' must be an object"),
                         ({"stream_options": {"include_usage": 1}}, "'stream_options.include_usage'")):
        with pytest.raises(openai.BadRequestError, match=field):
            client(server, "streamed").chat.completions.create(
                model="m", messages=[{"role": "user", "content": "x"}], extra_body=extra)
    assert llm_spans(store, "streamed") == []


def test_an_upstream_failing_before_its_stream_is_a_failed_call_and_an_errored_span(store, gateway, endpoint):
    _, server = gateway
    endpoint.fail_next.extend([400])
    with pytest.raises(openai.BadRequestError, match="injected failure"):
        list(client(server, "streamed").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True))
    [span] = llm_spans(store, "streamed")
    assert span.attributes["error"] == "the policy server answered 400"


def test_an_upstream_that_answers_whole_is_streamed_back_and_recorded_alike(store):
    """A policy server that ignores ``stream`` (answers JSON): the gateway cuts the answer into chunks."""
    endpoint = TestEndpoint()

    async def whole(request):
        body = await request.json()
        body.pop("stream", None)
        endpoint.requests.append(body)
        return await endpoint.chat_completions(_Replay(body))

    upstream = ServerThread(Starlette(routes=[Route("/v1/chat/completions", whole, methods=["POST"])])).start()
    gateway = Gateway(store, GatewayConfig(), upstreams=[upstream.url + "/v1"])
    server = gateway.serve()
    try:
        messages = [{"role": "user", "content": "hi"}]
        plain = client(server, "plain").chat.completions.create(model="m", messages=messages)
        chunks = list(client(server, "streamed").chat.completions.create(
            model="m", messages=messages, stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.choices[0].message.content
        assert chunks[-1].usage.total_tokens == plain.usage.total_tokens
        same_recording(llm_spans(store, "plain"), llm_spans(store, "streamed"))
    finally:
        server.stop()
        upstream.stop()


class _Replay:
    """A request whose body is given (the test endpoint's handler reads it with ``request.body()``)."""

    def __init__(self, body):
        self._raw = json.dumps(body).encode()

    async def body(self):
        return self._raw


def test_a_store_that_cannot_record_a_stream_ends_it_with_an_error_event(store, gateway, monkeypatch):
    _, server = gateway

    def broken(spans, leases=None):
        raise OSError("disk full")

    monkeypatch.setattr(store, "add_spans", broken)
    with pytest.raises(openai.APIError, match="disk full"):
        list(client(server, "streamed").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], stream=True))


def test_raw_events_are_openai_server_sent_events(store, gateway):
    _, server = gateway
    url = Gateway.base_url(server.url, "streamed", "1", LEASES["streamed"]) + "/chat/completions"
    with httpx.stream("POST", url, json={"model": "m", "messages": [{"role": "user", "content": "x"}],
                                         "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "chat.completion.chunk"


# ------------------------------------------------------------ the format functions, on their own

def test_the_sse_parser_reads_events_the_way_the_format_says_however_the_bytes_are_cut():
    stream = (b': a comment\n'
              b'data: {"a": 1}\n\n'
              b'event: x\ndata:{"b"\ndata: : 2}\r\n\r\n'
              b'data: [DONE]\n\n'
              b'data: {"late": 1}\n\n')
    for cut in range(1, len(stream)):
        parser = SSEParser()
        payloads = parser.feed(stream[:cut]) + parser.feed(stream[cut:])
        assert payloads == [b'{"a": 1}', b'{"b"\n: 2}'] and parser.done


@pytest.mark.parametrize("endpoint_name, response", [
    (CHAT, {"id": "c", "object": "chat.completion", "model": "m", "prompt_token_ids": [1, 2], "weight_version": 3,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ab"}, "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "a", "logprob": -1.0}]}, "token_ids": [5, 6]},
                        {"index": 1, "message": {"role": "assistant", "content": None, "tool_calls": [
                            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                         "finish_reason": "tool_calls", "logprobs": None, "token_ids": [7]}],
            "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}),
    (COMPLETIONS, {"id": "c", "object": "text_completion", "model": "m",
                   "choices": [{"index": 0, "text": "ab", "finish_reason": "length", "prompt_token_ids": [1],
                                "token_ids": [5, 6], "logprobs": {"tokens": ["a", "b"], "token_logprobs": [-1, -2],
                                                                  "top_logprobs": None, "text_offset": [0, 1]}}],
                   "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}),
])
def test_a_whole_answer_cut_into_chunks_assembles_back_into_itself(endpoint_name, response):
    assembly = StreamAssembly(endpoint_name)
    for chunk in chunks_of(endpoint_name, response, include_usage=True):
        assembly.add(json.loads(json.dumps(chunk)))
    assert assembly.response() == response


def test_a_stream_counts_as_a_call_in_flight_for_a_weight_sync_until_it_ends(store, gateway, endpoint):
    gw, server = gateway
    endpoint.token_delay_s = 0.02
    in_flight = []
    with client(server, "streamed").chat.completions.create(
            model="m", messages=[{"role": "user", "content": "a few tokens"}], stream=True) as stream:
        for count, _ in enumerate(stream):
            if count == 2:
                in_flight.append(gw.calls.in_flight)  # mid-stream: its weights must not change under it
    deadline = time.time() + 5
    while gw.calls.in_flight and time.time() < deadline:
        time.sleep(0.01)
    assert in_flight == [1] and gw.calls.in_flight == 0


# ------------------------------------------------------------ the relay, on its own

def relayed(endpoint_name, batches, sent=None):
    """The ASGI messages an :class:`EventStreamResponse` sends for a stream of ``batches`` (of chunk objects),
    appended to ``sent`` when given (where a test may add marks of its own)."""
    async def upstream():
        for number, batch in enumerate(batches):
            yield [json.dumps(chunk).encode() for chunk in batch], number == len(batches) - 1

    async def on_close(stream):
        pass

    async def never_disconnects():
        await asyncio.Event().wait()

    sent = [] if sent is None else sent

    async def send(message):
        sent.append(message)

    stream = CallStream(endpoint_name, upstream(), on_close)
    asyncio.run(EventStreamResponse(stream)(None, never_disconnects, send))
    return sent, stream


def events_of(message):
    return [json.loads(line[6:]) for line in message["body"].decode().split("\n\n") if line.startswith("data: {")]


def test_a_chat_streams_first_chunk_alone_waits_for_the_first_token_its_last_for_the_end():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": [1]}
    tokens = [{"choices": [{"index": 0, "delta": {"content": c}, "token_ids": [i]}]} for i, c in enumerate("abc")]
    sent, _ = relayed(CHAT, [[role], [tokens[0]], [tokens[1]], [tokens[2]]])
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 3
    assert events_of(sent[1]) == [role, tokens[0]]  # one write, one wake-up of the client, for both
    assert events_of(sent[2]) == [tokens[1]]
    # The chunks that came with the upstream's end go out with the gateway's, once the call is recorded.
    assert events_of(sent[3]) == [tokens[2]] and sent[3]["body"].endswith(b"data: [DONE]\n\n")
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]


def test_the_relay_gives_its_core_away_once_right_after_the_first_token_goes_out(monkeypatch):
    """The agent woken by the first token's write may wait on the relay's core: the relay yields it then, once."""
    tokens = [{"choices": [{"index": 0, "text": c, "token_ids": [i]}]} for i, c in enumerate("abcd")]
    log = []
    monkeypatch.setattr(streaming, "yield_core", lambda: log.append("yield"))
    relayed(COMPLETIONS, [[token] for token in tokens], log)
    assert [m if m == "yield" else m["type"] for m in log] == \
        ["http.response.start", "http.response.body", "yield"] + ["http.response.body"] * 3


def test_a_completions_first_chunk_holds_a_token_and_goes_out_at_once():
    tokens = [{"choices": [{"index": 0, "text": c, "token_ids": [i]}]} for i, c in enumerate("ab")]
    sent, _ = relayed(COMPLETIONS, [[tokens[0]], [tokens[1]]])
    assert [events_of(m) for m in sent[1:3]] == [[tokens[0]], [tokens[1]]]
    assert sent[2]["body"].endswith(b"data: [DONE]\n\n")


def test_a_stream_that_ends_before_a_second_chunk_sends_its_first_with_the_end():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    sent, stream = relayed(CHAT, [[role]])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert events_of(sent[1]) == [role] and sent[1]["body"].endswith(b"data: [DONE]\n\n")
    assert stream.ended and stream.assembly.chunks == 1


def test_a_stream_assembles_what_came_when_asked_and_the_rest_when_closed():
    chunks = [{"choices": [{"index": 0, "delta": {"content": c}, "token_ids": [i]}]} for i, c in enumerate("abc")]

    async def upstream():
        yield [json.dumps(chunk).encode() for chunk in chunks[:2]], False
        yield [json.dumps(chunks[2]).encode()], True

    async def on_close(stream):
        pass

    async def read():
        stream = CallStream(CHAT, upstream(), on_close)
        seen = []
        while await stream.next_batch():
            seen.append(stream.assembly.chunks)
            if len(seen) == 1:
                stream.assemble()  # as a relay does once it wrote a batch
        await stream.close()
        return seen, stream

    seen, stream = asyncio.run(read())
    assert seen == [0, 2]
    assert stream.assembly.response()["choices"][0]["token_ids"] == [0, 1, 2]


def test_a_chunk_that_is_not_json_stops_the_assembly_and_errs_the_stream_at_its_end():
    async def upstream():
        yield [b'{"choices": []}', b"not json"], False
        yield [b'{"choices": []}'], True

    async def on_close(stream):
        pass

    async def read():
        stream = CallStream(CHAT, upstream(), on_close)
        relayed_chunks = 0
        while batch := await stream.next_batch():
            relayed_chunks += len(batch)
        await stream.close()
        return relayed_chunks, stream

    relayed_chunks, stream = asyncio.run(read())
    assert relayed_chunks == 3  # the relay goes on: the error is the recording's
    assert stream.assembly.chunks == 1
    assert stream.error == "the policy server streamed a chunk that is not a JSON object"
