"""The lean HTTP/1.1 server (agl_core.lean_server): a real server on 127.0.0.1, real sockets and httpx."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest

from agl_core.http_server import ServerThread

LIMIT = 1000


async def app(scope, receive, send):
    """Echoes the request as JSON; ``/stream`` answers in three parts; ``/slow`` waits 0.3 s; ``/fail`` raises;
    ``/wait-disconnect`` reports when the client leaves."""
    message = await receive()
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("the app failed")
    if path == "/slow":
        await asyncio.sleep(0.3)
    if path == "/wait-disconnect":
        DISCONNECTS.append((await receive())["type"])
        return
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for part in (b"one ", b"two ", b"three"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    answer = {"method": scope["method"], "path": path, "query": scope["query_string"].decode(),
              "body": message["body"].decode(), "more_body": message["more_body"],
              "headers": {k.decode(): v.decode() for k, v in scope["headers"]}}
    await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(answer).encode()})


DISCONNECTS: list[str] = []


@pytest.fixture
def server():
    with ServerThread(app, lean_body_limit=LIMIT) as running:
        yield running


def connect(server) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


def read_answers(sock: socket.socket, n: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``n`` answers read off ``sock`` (status, headers, body), each framed by its content-length or chunks."""
    buf, answers = b"", []
    while len(answers) < n:
        head_end = buf.find(b"\r\n\r\n")
        if head_end < 0:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed after {len(answers)} answers; left: {buf!r}")
            buf += chunk
            continue
        lines = buf[:head_end].decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        rest = buf[head_end + 4:]
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(rest) < size:
                rest += sock.recv(65536)
            answers.append((status, headers, rest[:size]))
            buf = rest[size:]
        else:
            while not rest.endswith(b"0\r\n\r\n"):
                rest += sock.recv(65536)
            answers.append((status, headers, rest))
            buf = b""
    return answers


def closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_keep_alive_and_one_write_per_answer(server):
    with httpx.Client(base_url=server.url) as client:
        for i in range(3):
            answer = client.post(f"/echo%20me?i={i}", content=b'{"x": 1}', headers={"X-Test": "yes"})
            assert answer.status_code == 201
            assert answer.json() == {"method": "POST", "path": "/echo me", "query": f"i={i}", "body": '{"x": 1}',
                                     "more_body": False, "headers": answer.json()["headers"]}
            assert answer.json()["headers"]["x-test"] == "yes"
    sock = connect(server)
    sock.sendall(post("/a", b"x"))
    time.sleep(0.2)
    first = sock.recv(65536)  # headers and body came in one segment
    assert first.startswith(b"HTTP/1.1 201 Created\r\n") and first.endswith(b'"more_body": false, "headers": '
                                                                           b'{"host": "x", "content-length": "1"}}')
    sock.close()


def test_pipelined_requests_are_answered_in_order(server):
    sock = connect(server)
    sock.sendall(post("/slow", b"1") + post("/b", b"2") + post("/c", b"3"))
    answers = read_answers(sock, 3)
    assert [json.loads(body)["body"] for _, _, body in answers] == ["1", "2", "3"]
    sock.close()


def test_a_body_over_the_limit_is_413_and_closes(server):
    declared = connect(server)  # refused from its content-length, before it is sent
    declared.sendall(f"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode())
    [(status, _, body)] = read_answers(declared, 1)
    assert status == 413 and f"exceeds {LIMIT} bytes" in json.loads(body)["error"]["message"]
    assert closed(declared)
    chunked = connect(server)  # no length declared: refused once it is over
    chunk = b"y" * 600
    chunked.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2)
    [(status, _, _)] = read_answers(chunked, 1)
    assert status == 413 and closed(chunked)


def test_chunked_request_bodies_expect_continue_http10_and_connection_close(server):
    sock = connect(server)
    sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    [(status, _, body)] = read_answers(sock, 1)
    assert status == 201 and json.loads(body)["body"] == "abcde"
    sock.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
    sock.sendall(b"ok")
    [(status, _, body)] = read_answers(sock, 1)
    assert status == 201 and json.loads(body)["body"] == "ok"
    sock.sendall(post("/a", b"", "Connection: close\r\n"))
    [(status, headers, _)] = read_answers(sock, 1)
    assert status == 201 and headers["connection"] == "close" and closed(sock)
    old = connect(server)
    old.sendall(b"GET /a HTTP/1.0\r\n\r\n")
    [(status, _, body)] = read_answers(old, 1)
    assert status == 201 and json.loads(body)["method"] == "GET" and closed(old)


def test_malformed_requests_and_huge_headers_are_400_or_431_and_upgrades_plain_http(server):
    for request, status in [(b"NOT HTTP AT ALL\r\n\r\n", 400),
                            (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431)]:
        sock = connect(server)
        sock.sendall(request)
        [(got, _, body)] = read_answers(sock, 1)
        assert got == status and json.loads(body)["error"]["code"] == status
        assert closed(sock)
    upgrade = connect(server)  # the Upgrade header is ignored (RFC 9110 allows it): answered, then closed
    upgrade.sendall(b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    [(got, _, body)] = read_answers(upgrade, 1)
    assert got == 201 and json.loads(body)["path"] == "/u" and closed(upgrade)


def test_streamed_answers_are_chunked(server):
    with httpx.Client(base_url=server.url) as client, client.stream("POST", "/stream") as answer:
        assert answer.headers["transfer-encoding"] == "chunked"
        assert b"".join(answer.iter_bytes()) == b"one two three"


def test_an_app_that_fails_answers_500_and_the_connection_serves_on(server):
    with httpx.Client(base_url=server.url) as client:
        failed = client.post("/fail")
        assert failed.status_code == 500 and failed.json()["error"]["code"] == 500
        assert client.post("/a", content=b"next").json()["body"] == "next"


def test_receive_after_the_body_reports_the_client_leaving(server):
    DISCONNECTS.clear()
    sock = connect(server)
    sock.sendall(post("/wait-disconnect", b""))
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 5
    while not DISCONNECTS and time.monotonic() < deadline:
        time.sleep(0.01)
    assert DISCONNECTS == ["http.disconnect"]


def test_a_trickling_request_is_408_and_an_idle_connection_is_closed():
    with ServerThread(app, lean_body_limit=LIMIT) as running:
        running._server.body_timeout_s = running._server.keep_alive_s = 0.3
        trickle = connect(running)
        trickle.sendall(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc")
        [(status, _, body)] = read_answers(trickle, 1)
        assert status == 408 and "not received within 0.3 s" in json.loads(body)["error"]["message"]
        assert closed(trickle)
        idle = connect(running)
        idle.sendall(post("/a", b""))
        read_answers(idle, 1)
        assert closed(idle)  # within keep_alive_s of its last answer


def test_stop_lets_the_request_in_flight_finish():
    running = ServerThread(app, lean_body_limit=LIMIT).start()
    answers = []
    caller = threading.Thread(target=lambda: answers.append(httpx.post(running.url + "/slow", content=b"s")))
    caller.start()
    time.sleep(0.1)
    running.stop()
    caller.join(5)
    assert answers and answers[0].status_code == 201 and answers[0].json()["body"] == "s"
    with pytest.raises(httpx.ConnectError):
        httpx.post(running.url + "/a", timeout=2)


def test_an_app_that_speaks_the_lifespan_protocol_is_started_before_and_stopped_after_serving():
    events = []

    async def lifespan_app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await app(scope, receive, send)

    with ServerThread(lifespan_app, lean_body_limit=LIMIT) as running:
        assert events == ["lifespan.startup"]
        assert httpx.post(running.url + "/a", content=b"up").json()["body"] == "up"
    assert events == ["lifespan.startup", "lifespan.shutdown"]

    async def failing_startup(scope, receive, send):
        await receive()
        await send({"type": "lifespan.startup.failed", "message": "no database"})

    with pytest.raises(RuntimeError, match="no database"):
        ServerThread(failing_startup, lean_body_limit=LIMIT).start()


class FastPathApp:
    """The echo app with a fast path: ``/now`` is answered by ``answer_now`` (``/now-fail`` fails there), anything
    else goes the ASGI way."""

    def __init__(self):
        self.answered_now: list[bytes] = []

    def answer_now(self, method, path, headers, body):
        if path == b"/now-fail":
            raise RuntimeError("the fast path failed")
        if path != b"/now":
            return None
        self.answered_now.append(body)
        return 200, json.dumps({"now": body.decode(), "method": method}).encode()

    async def __call__(self, scope, receive, send):
        await app(scope, receive, send)


def test_an_apps_fast_path_answers_at_once_in_order_behind_slower_answers():
    fast = FastPathApp()
    with ServerThread(fast, lean_body_limit=LIMIT) as running:
        with httpx.Client(base_url=running.url) as client:
            answer = client.post("/now", content=b"quick")
            assert answer.status_code == 200 and answer.json() == {"now": "quick", "method": "POST"}
            assert answer.headers["content-type"] == "application/json"
            echoed = client.post("/other", content=b"asgi")  # None from the fast path: the ASGI app answers
            assert echoed.status_code == 201 and echoed.json()["body"] == "asgi"
            failed = client.post("/now-fail", content=b"x")
            assert failed.status_code == 500 and failed.json()["error"]["message"] == "internal error"
            assert client.post("/now", content=b"again").status_code == 200  # the connection serves on
        sock = connect(running)  # behind an answer in progress, requests wait their turn and go the ASGI way
        sock.sendall(post("/slow", b"1") + post("/now", b"2") + post("/now", b"3", "Connection: close\r\n"))
        answers = read_answers(sock, 3)
        assert [json.loads(body)["body"] for _, _, body in answers] == ["1", "2", "3"]
        assert answers[2][1]["connection"] == "close" and closed(sock)
        sock = connect(running)  # the fast path closes a connection that asked for it; what follows is not run
        sock.sendall(post("/now", b"4", "Connection: close\r\n") + post("/now", b"5"))
        [(status, headers, _)] = read_answers(sock, 1)
        assert status == 200 and headers["connection"] == "close" and closed(sock)
    assert fast.answered_now == [b"quick", b"again", b"4"]
