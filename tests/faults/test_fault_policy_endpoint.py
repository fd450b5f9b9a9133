"""Fault: bad requests, an oversized body and a trickling client against the embedded policy endpoint.

The reproduction of the issue: a call with ``seed`` >= 2**64 or
``temperature=1e-300`` passed the endpoint's checks and then failed every
good call batched with it. Now each bad call is refused at the door with a
400 naming its field, every good call sent at the same time succeeds, and a
huge or slow body costs the server nothing.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from agl_core.http.rules import POLICY_TOKEN_ENV
from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import restore_torch_threads, tiny_section  # noqa: F401 (an autouse fixture)

MESSAGES = [{"role": "user", "content": "guess a number"}]
GOOD_CALLS = 30
BAD = [  # (fields of a bad call, the field its 400 must name)
    ({"seed": 2**64}, "'seed'"),
    ({"temperature": 1e-300}, "'temperature'"),
    ({"temperature": float("nan")}, "'temperature'"),  # sent as the JSON literal NaN
    ({"top_p": float("nan")}, "'top_p'"),
    ({"messages": [{"role": "user", "content": [{"text": 5}]}]}, "'messages[0].content[0].text'"),
]
MAX_BODY_BYTES = 4096
BODY_TIMEOUT_S = 1.0


@pytest.fixture
def endpoint(tmp_path, monkeypatch):
    """The root URL of the real policy endpoint over a tiny model, with a small body limit and timeout."""
    monkeypatch.delenv(POLICY_TOKEN_ENV, raising=False)
    section = tiny_section(serving={"max_body_bytes": MAX_BODY_BYTES, "body_timeout_s": BODY_TIMEOUT_S})
    backend = create(TorchConfig.model_validate(section), tmp_path, seed=0, with_critic=False)
    backend.start_serving("policy")
    yield backend
    backend.stop_serving()


def post_chat(client: httpx.Client, fields: dict) -> httpx.Response:
    body = {"model": "policy", "messages": MESSAGES, "max_tokens": 4, **fields}
    return client.post("/v1/chat/completions", content=json.dumps(body),
                       headers={"content-type": "application/json"})


def test_bad_calls_fail_alone_while_good_calls_batched_with_them_succeed(endpoint):
    calls = [({"seed": i} if i % 2 else {}, None) for i in range(GOOD_CALLS)]
    for k, bad in enumerate(BAD):  # spread among the good ones
        calls.insert(7 * k, bad)
    replies: dict[int, httpx.Response | Exception] = {}
    start = threading.Barrier(len(calls))
    with httpx.Client(base_url=endpoint.endpoint.url, timeout=60,
                      limits=httpx.Limits(max_connections=len(calls))) as client:

        def call(i: int) -> None:
            try:
                start.wait(30)
                replies[i] = post_chat(client, calls[i][0])
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                replies[i] = exc

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(calls))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert len(replies) == len(calls)
    for i, (fields, named) in enumerate(calls):
        reply = replies[i]
        assert isinstance(reply, httpx.Response), reply
        if named is None:
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["token_ids"]
        else:
            assert reply.status_code == 400, (fields, reply.text)
            assert named in reply.json()["error"]["message"]
    assert endpoint.endpoint.batches() < GOOD_CALLS  # good calls did share batches


def test_an_oversized_body_is_refused_and_the_server_still_answers(endpoint):
    with httpx.Client(base_url=endpoint.endpoint.url, timeout=60) as client:
        huge = post_chat(client, {"user": "x" * (16 * MAX_BODY_BYTES)})
        assert huge.status_code == 413
        assert "max_body_bytes" in huge.json()["error"]["message"]
        assert post_chat(client, {}).status_code == 200


def trickle(port: int, length: int = 200, interval_s: float = 0.2, limit_s: float = 10.0) -> tuple[bytes, int]:
    """POST a body of ``length`` bytes one byte per ``interval_s`` until the server answers or closes.

    Returns what the server sent and how many body bytes went out; gives up after ``limit_s`` seconds.
    """
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     f"content-type: application/json\r\ncontent-length: {length}\r\n\r\n".encode())
        sent, deadline = 0, time.monotonic() + limit_s
        while sent < length and time.monotonic() < deadline:
            if select.select([sock], [], [], interval_s)[0]:
                break  # the server answered, or closed the connection
            try:
                sock.sendall(b" ")
            except OSError:
                break
            sent += 1
        try:
            return sock.recv(4096), sent
        except OSError:
            return b"", sent


def test_a_trickling_body_is_cut_off_and_the_server_serves_others_meanwhile(endpoint):
    answer: list[tuple[bytes, int]] = []
    slow = threading.Thread(target=lambda: answer.append(trickle(urlsplit(endpoint.url).port)))
    slow.start()
    with httpx.Client(base_url=endpoint.endpoint.url, timeout=60) as client:
        assert post_chat(client, {}).status_code == 200  # while the slow client holds its connection
        slow.join(30)
        assert answer, "the trickling client got no answer within its time limit"
        received, sent = answer[0]
        assert received == b"" or received.startswith(b"HTTP/1.1 408"), received[:200]
        assert sent < 200  # cut off before the whole body was sent
        assert post_chat(client, {}).status_code == 200


def test_agl_train_refuses_to_serve_the_policy_off_loopback_without_a_token(agl, run_dir, monkeypatch):
    """Before, ``plugins.torch.serving.host=0.0.0.0`` served any caller, bypassing the gateway's token."""
    monkeypatch.delenv(POLICY_TOKEN_ENV, raising=False)
    out = agl.run("train", agl.GUESS_NUMBER, f"trainer.run_dir={run_dir}", "plugins.torch.serving.host=0.0.0.0")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ("agl: error: the policy endpoint binds 0.0.0.0, which is not a loopback address: set "
            "plugins.torch.serving.token (or $AGL_POLICY_TOKEN)") in out.stderr
