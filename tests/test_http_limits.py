"""What agl_core.http.limits adds to uvicorn, on a real server on 127.0.0.1 and raw sockets: requests within the
limits served as uvicorn serves them, those past them refused. (tests/faults/test_fault_floods.py floods each service.)
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading

import pytest
from starlette.requests import Request

from agl_core.http.limits import MAX_PIPELINED, ServerLimits, raise_fd_limit
from agl_core.http.rules import BODY_RECEIVED, RequestError, read_body
from agl_core.http.server import ServerThread

head_seen = threading.Event()


async def app(scope, receive, send):
    """``/echo`` answers its path and query; ``/stream`` sends its head, waits for the client to have it, then a
    body."""
    if scope["type"] != "http":
        return
    await receive()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/stream":
        await asyncio.to_thread(head_seen.wait, 10)
        await send({"type": "http.response.body", "body": b"part", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.body", "body": (scope["path"] + "?" + scope["query_string"].decode()).encode()})


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


@pytest.fixture
def server():
    with ServerThread(app, limits=ServerLimits(max_connections=4)) as running:
        yield running


def test_pipelined_requests_up_to_the_bound_are_answered_in_order(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        requests = [b"GET /echo?%d HTTP/1.1\r\nHost: x\r\n\r\n" % i for i in range(MAX_PIPELINED)]
        sock.sendall(b"".join(requests) + b"GET /echo?last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answers = read_all(sock)
    assert answers.count(b"HTTP/1.1 200 OK") == MAX_PIPELINED + 1
    assert re.findall(rb"/echo\?(\w+)", answers) == [b"%d" % i for i in range(MAX_PIPELINED)] + [b"last"]


def test_more_requests_ahead_of_their_answers_close_the_connection(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n" + b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n" * 100)
        head_seen.set()
        answers = read_all(sock)  # ends: the server closed the connection
    head_seen.clear()
    assert answers.count(b"HTTP/1.1 200") <= MAX_PIPELINED + 1


def test_a_streamed_answer_s_head_goes_out_before_its_body(server):
    head_seen.clear()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(10)
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        first = sock.recv(65536)
        head_seen.set()
        rest = read_all(sock)
    assert first.startswith(b"HTTP/1.1 200") and b"part" not in first
    assert b"part" in rest


def test_a_header_section_over_the_limit_is_refused_with_431(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 * 2**10) + b"\r\n\r\n")
        assert read_all(sock).startswith(b"HTTP/1.1 431")


def test_an_upgrade_request_is_answered_as_plain_http_then_the_connection_closes(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\nnot http")
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200") and b"/echo?" in answer and answer.count(b"HTTP/1.1") == 1


def test_connections_past_the_cap_are_answered_503_and_closed(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as over:
            assert read_all(over).startswith(b"HTTP/1.1 503")
    finally:
        for sock in held:
            sock.close()


def test_the_open_file_limit_is_raised_to_the_hard_limit():
    import resource
    assert raise_fd_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[1]


def test_an_endless_header_line_of_a_request_pipelined_behind_another_is_refused(server):
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /echo?first HTTP/1.1\r\nHost: x\r\n\r\nGET /echo HTTP/1.1\r\nX-Endless: ")
        sent = 0
        sock.settimeout(5)
        with contextlib.suppress(OSError):  # the server closes it: a reset, or a send that no longer goes through
            while sent < 16 * 2**20:
                sent += sock.send(b"a" * 65536)
        assert sent < 16 * 2**20
        answers = b""
        with contextlib.suppress(OSError):
            answers = read_all(sock)
    assert answers == b"" or (answers.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 431" in answers), answers[:300]


def test_a_body_held_whole_is_marked_in_the_scope_and_a_late_one_is_still_read_in_time():
    """A request that arrives whole is marked (its body is read without a timer); one whose body comes later is not,
    is read whole all the same, and a body that never comes is still answered 408."""
    marks = []

    async def reader(scope, receive, send):
        if scope["type"] != "http":
            return
        marks.append(BODY_RECEIVED in scope.get("extensions", {}))
        try:
            body, status = await read_body(Request(scope, receive), 1024, "the test's limit", 0.5), 200
        except RequestError as exc:
            body, status = str(exc).encode(), exc.status
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    head = b"POST /r HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n"
    with ServerThread(reader) as running, socket.create_connection(("127.0.0.1", running.port)) as sock:
        sock.settimeout(10)
        sock.sendall(head + b"whole")
        assert sock.recv(65536).endswith(b"\r\n\r\nwhole")
        sock.sendall(head)
        threading.Event().wait(0.2)  # the app has begun and waits for the body
        sock.sendall(b"later")
        assert sock.recv(65536).endswith(b"\r\n\r\nlater")
        sock.sendall(head + b"par")  # the rest never comes
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408") and b"not received within 0.5 s" in answer
    assert marks == [True, False, False]
