"""Faults at the gateway: bursts, trickling and huge bodies, absurd requests. Real HTTP on 127.0.0.1.

The gateway runs on its server thread over a real SQLite store file, the test
policy endpoint behind it (a stand-in for a served model, as everywhere in the
CPU tests); the clients are real sockets, httpx and the ``openai`` client.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sqlite3
import time

import httpx
import openai
import pytest

from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.store import NewRollout
from agl_core.testing.endpoint import ByteTokenizer
from agl_plugin_sqlite.store import SqliteStore

MESSAGE = [{"role": "user", "content": "ping"}]


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(tmp_path / "rollouts.sqlite")
    yield s
    s.close()


@pytest.fixture
def gateway(endpoint, store):
    servers = []

    def start(**config):
        gw = Gateway(store, GatewayConfig(**config), sampling={"max_tokens": 16}, upstreams=[endpoint.url])
        servers.append(gw.serve())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


LEASES: dict[str, str] = {}
"""The lease token of each rollout's running attempt (:func:`running`'s)."""


def running(store, n: int) -> list[str]:
    """``n`` rollouts with a running attempt each ("1"); their ids."""
    ids = [f"r{i}" for i in range(n)]
    store.enqueue([NewRollout(rid, Task(id=rid, input={})) for rid in ids])
    for _ in ids:
        attempt = store.dequeue("worker", lease_s=300)
        LEASES[attempt.rollout_id] = attempt.lease
    return ids


def base_url(server, rollout_id: str) -> str:
    return Gateway.base_url(server.url, rollout_id, "1", LEASES[rollout_id])


def chat_url(server, rollout_id: str) -> str:
    return base_url(server, rollout_id) + "/chat/completions"


def test_a_burst_of_500_concurrent_calls_is_answered_and_recorded(gateway, store):
    server = gateway()
    ids = running(store, 500)

    async def burst():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(limits=limits, timeout=120) as client:
            return await asyncio.gather(*(
                client.post(chat_url(server, rid), json={"model": "policy", "messages": [
                    {"role": "user", "content": rid}]}) for rid in ids))

    answers = asyncio.run(burst())
    assert [a.status_code for a in answers] == [200] * 500
    assert [a.json()["choices"][0]["message"]["content"] for a in answers] == [f"echo: {rid}" for rid in ids]
    store.flush()
    for rollout in store.get_rollouts(ids):
        (span,) = rollout.spans
        assert span.response_token_ids == ByteTokenizer().encode(f"echo: {rollout.rollout_id}")[:16]


def test_slow_body_clients_are_cut_off_and_the_server_stays_up(gateway, store):
    server = gateway(body_timeout_s=1.0)
    (rid,) = running(store, 1)
    path = chat_url(server, rid).removeprefix(server.url)
    slow = []
    for _ in range(20):  # each declares 1,000 bytes and sends 10 of them
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 1000\r\n\r\n{{\"messages\"".encode())
        slow.append(sock)
    # While they trickle, an ordinary call goes through.
    llm = openai.OpenAI(base_url=base_url(server, rid), api_key="x", max_retries=0)
    assert llm.chat.completions.create(model="policy", messages=MESSAGE).choices[0].message.content == "echo: ping"
    deadline = time.monotonic() + 15
    for sock in slow:
        sock.settimeout(max(0.1, deadline - time.monotonic()))
        answer = sock.recv(65536)  # the 408 answer, or b"" when the server closed the connection
        assert answer == b"" or answer.startswith(b"HTTP/1.1 408"), answer[:80]
        sock.close()
    assert httpx.get(f"{server.url}/healthz", timeout=10).json()["ok"] is True
    (rollout,) = store.get_rollouts([rid])
    assert len(rollout.spans) == 1  # the cut-off bodies recorded nothing


def test_absurd_requests_get_a_400_and_the_gateway_stays_responsive(gateway, store, endpoint):
    server = gateway()
    (rid,) = running(store, 1)
    url = chat_url(server, rid)
    cases = {
        "'n' must be in [1, 64]": {"model": "p", "messages": MESSAGE, "n": 100_000},
        "'max_tokens' must be in [1,": {"model": "p", "messages": MESSAGE, "max_tokens": -5},
        "'temperature' must be a finite number": {"model": "p", "messages": MESSAGE, "temperature": float("nan")},
        "'top_p' must be a finite number": {"model": "p", "messages": MESSAGE, "top_p": float("inf")},
        "'seed' must be in": {"model": "p", "messages": MESSAGE, "seed": 2**64},
    }
    for message, body in cases.items():
        answer = httpx.post(url, content=json.dumps(body), timeout=10)  # json.dumps writes NaN/Infinity
        assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
    deep = httpx.post(url, content=b"[" * 100_000 + b"]" * 100_000, timeout=10)
    assert deep.status_code == 400 and deep.json()["error"]["message"].startswith("request body is nested too deeply")
    assert httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200
    assert endpoint.calls == 0  # nothing was forwarded
    store.flush()
    assert store.get_rollouts([rid])[0].spans == []


def test_what_a_call_stores_grows_linearly_with_n(tmp_path, endpoint):
    """Before, every choice's span held the whole answer: n=2000 wrote 345 MB for a 0.59 MB response."""
    sizes = {}
    for n in (100, 400):
        store = SqliteStore(tmp_path / f"n{n}.sqlite")
        try:
            gateway = Gateway(store, GatewayConfig(max_n=400), sampling={"max_tokens": 8}, upstreams=[endpoint.url])
            server = gateway.serve()
            (rid,) = running(store, 1)
            answer = httpx.post(chat_url(server, rid), json={"model": "p", "messages": MESSAGE, "n": n}, timeout=60)
            assert answer.status_code == 200 and len(answer.json()["choices"]) == n
            server.stop()
            store.flush()
        finally:
            store.close()
        with sqlite3.connect(tmp_path / f"n{n}.sqlite") as conn:
            count, size = conn.execute("SELECT count(*), sum(length(span)) FROM spans").fetchone()
        assert count == n
        sizes[n] = size
    assert sizes[400] / sizes[100] < 4.5  # linear (≈4); quadratic would be ≈16
