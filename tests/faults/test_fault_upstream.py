"""Fault: a policy server that never ends its answer. The gateway reads at most ``rollout.gateway.max_upstream_bytes``
of it: a whole call fails with a 502 naming the limit (not a 504 at the call's timeout), a streamed call ends with an
error event naming it; the call's span is recorded as failed, and the gateway goes on serving.

The upstream is a real socket server on 127.0.0.1 that answers every request with an endless body, framed each way
HTTP allows (chunked, a declared length it never reaches, ended by closing) and as an endless event stream.
"""

from __future__ import annotations

import itertools
import json
import socket
import threading

import httpx
import pytest

from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.store import NewRollout
from agl_plugin_sqlite.store import SqliteStore

MESSAGE = [{"role": "user", "content": "ping"}]
LIMIT_KEY = "rollout.gateway.max_upstream_bytes"


class EndlessUpstream:
    """Answers each request with ``head`` then ``piece`` forever (until the gateway lets go of the connection)."""

    def __init__(self, head: bytes, piece: bytes):
        self.head, self.piece = head, piece
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}/v1"
        self.sent: list[int] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        sent = 0
        with conn:
            try:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                head, _, body = request.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                while len(body) < length:
                    body += conn.recv(65536)
                conn.sendall(self.head)
                while sent < 2**31:
                    conn.sendall(self.piece)
                    sent += len(self.piece)
            except OSError:
                pass
        self.sent.append(sent)

    def close(self) -> None:
        self.listener.close()


def chunked(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


JSON_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
EVENT = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
ENDLESS = {  # (answer head, the piece repeated forever)
    "chunked json": (JSON_HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + chunked(b'{"choices":['),
                     chunked(b'{"index":0},' * 500)),
    "json of a length never reached": (JSON_HEAD + b"Content-Length: 1000000000000\r\n\r\n{\"a\":\"", b"a" * 8192),
    "json ended by closing": (JSON_HEAD + b"Connection: close\r\n\r\n[", b"1," * 4096),
    "chunked event stream": (SSE_HEAD + b"Transfer-Encoding: chunked\r\n\r\n", chunked(EVENT * 50)),
    "one endless event line": (SSE_HEAD + b"Connection: close\r\n\r\ndata: ", b"x" * 8192),
}


@pytest.fixture
def store(tmp_path):
    s = SqliteStore(tmp_path / "rollouts.sqlite")
    yield s
    s.close()


ids = itertools.count()


def running(store) -> tuple[str, str]:
    """A running attempt's rollout id and lease token."""
    rid = f"r{next(ids)}"
    store.enqueue([NewRollout(rid, Task(id=rid, input={}))])
    attempt = store.dequeue("worker", lease_s=300)
    assert attempt is not None
    return rid, attempt.lease


@pytest.mark.parametrize("limit", [4096, 3 * 2**20])
@pytest.mark.parametrize("shape", sorted(ENDLESS))
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_endless_upstream_answer_is_cut_at_max_upstream_bytes(store, shape, limit, stream):
    upstream = EndlessUpstream(*ENDLESS[shape])
    config = GatewayConfig(max_upstream_bytes=limit, upstream_timeout_s=600, max_retries=0)
    server = Gateway(store, config, upstreams=[upstream.url]).serve()
    try:
        rid, lease = running(store)
        url = Gateway.base_url(server.url, rid, "1", lease) + "/chat/completions"
        body = {"model": "p", "messages": MESSAGE, "stream": stream}
        with httpx.stream("POST", url, json=body, timeout=120) as answer:
            raw = answer.read()
        if stream and answer.status_code == 200:  # the stream had begun: it ends with an error event
            events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == 502 and LIMIT_KEY in error["message"] and str(limit) in error["message"]
        else:  # cut before the first byte went to the agent: the call fails whole
            assert answer.status_code == 502, raw[:300]
            message = json.loads(raw)["error"]["message"]
            assert LIMIT_KEY in message and str(limit) in message
        store.flush()
        (rollout,) = store.get_rollouts([rid])
        assert [LIMIT_KEY in (span.attributes.get("error") or "") for span in rollout.spans] == [True]
        assert httpx.get(server.url + "/healthz", timeout=10).status_code == 200
    finally:
        server.stop()
        upstream.close()
