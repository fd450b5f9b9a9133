"""A lean HTTP/1.1 server for ASGI apps that answer many small requests: asyncio (uvloop) and httptools.

The store service answers a few hundred bytes of JSON per request, and a
rollout's life takes nine of them. Measured side by side on this project's
2-core machine (``benchmarks/bench_runners.py``'s store phase, one process
per server), uvicorn's own work per request is a sixth of the store's added
latency: it runs each request through its flow control and its default
headers, and writes an answer's headers and body apart, which wakes the
client twice. This server keeps what such a service needs, in one screen of
protocol code, on the parser uvicorn uses:

- HTTP/1.1 keep-alive (idle connections closed after ``keep_alive_s``),
  pipelined requests answered in order, HTTP/1.0 and ``Connection: close``;
- the request body read whole before the app runs: bounded
  (``max_body_bytes``: 413, before reading it when declared) and timed (the
  request within ``body_timeout_s`` of its first byte: 408);
  ``Expect: 100-continue`` answered; chunked request bodies decoded;
- an answer with its length in one write (headers and body together); an
  answer sent in parts (``more_body``) without a length is sent chunked;
- ``receive()`` after the body waits for the client to leave
  (``http.disconnect``), as ASGI promises;
- :meth:`LeanServer.run` serves until ``should_exit`` is set, then stops
  accepting, lets the requests in flight finish (up to ``shutdown_timeout_s``)
  and closes every connection.

- the ASGI lifespan protocol, for an app that speaks it;
- an app's fast path: an app with an ``answer_now(method, target, headers,
  body)`` method (``target``: the request's path and query as sent, not
  decoded) is asked first for each request read whole (when no earlier
  request of the connection is still being answered). It returns
  ``(status, JSON body)`` to answer at once, on the parser's call, or None
  to go the ASGI way. A store call is a few tens of microseconds of work;
  the task, the scope and the ASGI messages of the ASGI way cost as much
  again (measured: see ``docs/design-decisions.md``).

Not served: upgrades (the ``Upgrade`` header is ignored: the request is
answered as plain HTTP, then the connection closed), HTTP/2 and trailers.
"""

from __future__ import annotations

import asyncio
import collections
import http
import logging
import socket
import time
import urllib.parse
from typing import Any

import httptools

from agl_core.http_rules import error_body

log = logging.getLogger("agl_core.lean_server")

MAX_HEADER_BYTES = 64 * 2**10
MAX_PIPELINED = 32
"""Requests read ahead of the one being answered; reading pauses beyond them."""
SWEEP_S = 0.05
"""How often connections past their deadline (a request too slow to arrive, keep-alive ended) are closed. One sweep
of every connection instead of a timer set and cancelled per request: those timers cost about 10 us per request,
as much as the rest of the server's work on a store call answered by the fast path."""


class LeanServer:
    """Serves ``app`` on the sockets given to :meth:`run`; the interface of ``uvicorn.Server`` that
    :class:`agl_core.http_server.ServerThread` uses (``run(sockets)``, ``started``, ``should_exit``). ``loop`` names
    the event loop it runs, ``uvloop`` (a third less per request) or ``asyncio``, as uvicorn's setting of that name."""

    def __init__(self, app: Any, *, max_body_bytes: int, loop: str = "asyncio", body_timeout_s: float = 60.0,
                 keep_alive_s: float = 60.0, shutdown_timeout_s: float = 10.0):
        self.app, self.max_body_bytes, self.loop = app, max_body_bytes, loop
        self.answer_now = getattr(app, "answer_now", None)
        self.body_timeout_s, self.keep_alive_s, self.shutdown_timeout_s = body_timeout_s, keep_alive_s, \
            shutdown_timeout_s
        self.started = self.should_exit = False
        self.connections: set[_Connection] = set()

    def run(self, sockets: list[socket.socket]) -> None:
        """Serve on this thread until ``should_exit`` is set (see the module docstring for the stop)."""
        if self.loop == "uvloop":
            import uvloop
            loop = uvloop.new_event_loop()
        else:
            loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(sockets))
        finally:
            loop.close()

    async def _serve(self, sockets: list[socket.socket]) -> None:
        loop = asyncio.get_running_loop()
        lifespan = await _Lifespan.start(self.app)
        servers = [await loop.create_server(lambda: _Connection(self), sock=sock, backlog=4096) for sock in sockets]
        self.started = True
        while not self.should_exit:
            await asyncio.sleep(SWEEP_S)
            now = time.monotonic()
            for conn in [conn for conn in self.connections if conn.deadline is not None and conn.deadline <= now]:
                conn.expire()
        for server in servers:
            server.close()
        deadline = loop.time() + self.shutdown_timeout_s
        while any(conn.answering for conn in self.connections) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.transport.close()
        for server in servers:
            await server.wait_closed()
        if lifespan is not None:
            await lifespan.stop(self.shutdown_timeout_s)


class _Lifespan:
    """The ASGI lifespan protocol, for an app that speaks it (Starlette's do): startup before the first request,
    shutdown after the last. An app that does not (it returns or raises at once) simply gets none."""

    def __init__(self, app: Any):
        loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.started, self.stopped = loop.create_future(), loop.create_future()
        self.task = loop.create_task(app({"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"},
                                          "state": {}}, self.inbox.get, self._send))

    @classmethod
    async def start(cls, app: Any) -> _Lifespan | None:
        lifespan = cls(app)
        lifespan.inbox.put_nowait({"type": "lifespan.startup"})
        await asyncio.wait([lifespan.started, lifespan.task], return_when=asyncio.FIRST_COMPLETED)
        if not lifespan.started.done():
            if not lifespan.task.cancelled() and lifespan.task.exception() is not None:
                log.debug("the app does not speak the lifespan protocol: %r", lifespan.task.exception())
            return None
        lifespan.started.result()  # raises the app's startup failure: the server does not start
        return lifespan

    async def stop(self, timeout_s: float) -> None:
        self.inbox.put_nowait({"type": "lifespan.shutdown"})
        try:
            await asyncio.wait_for(asyncio.shield(self.stopped), timeout_s)
        except TimeoutError:
            log.warning("the app did not finish its shutdown within %g s", timeout_s)
            self.task.cancel()
        except RuntimeError as exc:  # the server stops all the same
            log.warning("%s", exc)

    async def _send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        failed = RuntimeError(f"the app's lifespan failed: {message.get('message', '')}")
        if kind == "lifespan.startup.complete":
            self.started.set_result(None)
        elif kind == "lifespan.startup.failed":
            self.started.set_exception(failed)
        elif kind == "lifespan.shutdown.complete":
            self.stopped.set_result(None)
        elif kind == "lifespan.shutdown.failed":
            self.stopped.set_exception(failed)


class _Request:
    """One request: what was parsed, and the ASGI ``receive``/``send`` of its answer."""

    __slots__ = ("conn", "url", "headers", "body", "header_bytes", "body_bytes", "method", "http_version",
                 "keep_alive", "body_sent", "status", "response_headers", "chunked", "started", "finished")

    def __init__(self, conn: _Connection):
        self.conn = conn
        self.url, self.headers, self.body = b"", [], []
        self.header_bytes = self.body_bytes = 0
        self.method, self.http_version, self.keep_alive = "GET", "1.1", True
        self.body_sent = False
        self.status: int | None = None
        self.response_headers: list[tuple[bytes, bytes]] = []
        self.chunked = self.started = self.finished = False

    def scope(self) -> dict[str, Any]:
        path, _, query = self.url.partition(b"?")
        conn = self.conn
        return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": self.http_version,
                "method": self.method, "scheme": "http", "path": _unquoted(path),
                "raw_path": path, "query_string": query, "root_path": "", "headers": self.headers,
                "client": conn.peer, "server": conn.local}

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": b"".join(self.body), "more_body": False}
        await self.conn.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        conn, kind = self.conn, message["type"]
        if kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.started, self.status = True, message["status"]
            self.response_headers = [(bytes(k).lower(), bytes(v)) for k, v in message.get("headers", ())]
            return
        if kind != "http.response.body":
            raise RuntimeError(f"an HTTP answer cannot send {kind!r}")
        if not self.started or self.finished:
            raise RuntimeError("http.response.body sent before http.response.start or after the last part")
        body, more = bytes(message.get("body", b"")), message.get("more_body", False)
        if self.method == "HEAD":
            body = b""
        if conn.gone.is_set():
            self.finished = not more
            return
        out = []
        if self.status is not None:  # the head goes with the first part
            has_length = any(k == b"content-length" for k, _ in self.response_headers)
            self.chunked = more and not has_length and self.method != "HEAD"
            extra = [] if has_length or self.chunked else [(b"content-length", b"%d" % len(body))]
            if self.chunked:
                extra.append((b"transfer-encoding", b"chunked"))
            out.append(_head(self.status, self.response_headers + extra, self.keep_alive))
            self.status = None
        if self.chunked:
            if body:
                out.append(b"%x\r\n%s\r\n" % (len(body), body))
            if not more:
                out.append(b"0\r\n\r\n")
        else:
            out.append(body)
        self.finished = not more
        conn.transport.write(b"".join(out))
        if more:
            await conn.writable.wait()


class _Connection(asyncio.Protocol):
    """One client connection: parses requests as bytes arrive and answers them one at a time, in order."""

    def __init__(self, server: LeanServer):
        self.server = server
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.peer = self.local = None
        self.parsing: _Request | None = None
        self.waiting: collections.deque[_Request] = collections.deque()
        self.answering: _Request | None = None
        self.gone, self.writable = asyncio.Event(), asyncio.Event()
        self.writable.set()
        self.deadline: float | None = None
        self.expiry_status: int | None = None
        self.reading = True

    # ---------------------------------------------------------------- the transport's calls

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small answers go out at once
        self.peer, self.local = (_host_port(transport.get_extra_info(key)) for key in ("peername", "sockname"))
        self.server.connections.add(self)
        self._time_out(self.server.keep_alive_s, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.gone.set()
        self.writable.set()
        self._time_out(None, None)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # the request was read whole and is answered; nothing after it
            self._refuse(400, "protocol upgrades (websockets) are not served here")
        except httptools.HttpParserCallbackError as exc:
            refusal = exc.__context__
            if not isinstance(refusal, _Refusal):
                raise
            self._refuse(refusal.status, str(refusal))
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")

    # ---------------------------------------------------------------- httptools' calls

    def on_message_begin(self) -> None:
        self.parsing = _Request(self)
        self._time_out(self.server.body_timeout_s, 408)

    def on_url(self, url: bytes) -> None:
        self._count_header_bytes(len(url))
        self.parsing.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        self.parsing.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        request, limit = self.parsing, self.server.max_body_bytes
        request.method = self.parser.get_method().decode("ascii")
        request.http_version = self.parser.get_http_version()
        for name, value in request.headers:
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                raise _Refusal(413, f"request body exceeds {limit} bytes")
            if name == b"expect" and value.lower() == b"100-continue":
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        request = self.parsing
        request.body_bytes += len(body)
        if request.body_bytes > self.server.max_body_bytes:
            raise _Refusal(413, f"request body exceeds {self.server.max_body_bytes} bytes")
        request.body.append(body)

    def on_message_complete(self) -> None:
        request, self.parsing = self.parsing, None
        request.keep_alive = self.parser.should_keep_alive()
        self._time_out(None, None)
        if self.server.answer_now is not None and self.answering is None and not self.waiting \
                and self._answered_now(request):
            return
        self.waiting.append(request)
        if len(self.waiting) > MAX_PIPELINED and self.reading:
            self.reading = False
            self.transport.pause_reading()
        self._answer_next()

    # ---------------------------------------------------------------- answering

    def _answered_now(self, request: _Request) -> bool:
        """Whether the app's fast path answered ``request`` (see the module docstring)."""
        body = b"".join(request.body)
        try:
            answer = self.server.answer_now(request.method, request.url, request.headers, body)
        except Exception:  # noqa: BLE001 - the request fails alone; the server goes on
            log.exception("the app's fast path failed on %s %s", request.method, request.url[:200])
            answer = 500, error_body(500, "internal error")
        if answer is None:
            request.body = [body]
            return False
        status, content = answer
        self.transport.write(_head(status, [*JSON, (b"content-length", b"%d" % len(content))], request.keep_alive)
                             + content)
        if request.keep_alive:
            self._time_out(self.server.keep_alive_s, None)
        else:
            self.transport.close()
        return True

    def _answer_next(self) -> None:
        if self.answering is None and self.waiting and not self.gone.is_set():
            self.answering = self.waiting.popleft()
            asyncio.get_running_loop().create_task(self._answer(self.answering))
            if not self.reading and len(self.waiting) <= MAX_PIPELINED // 2:
                self.reading = True
                self.transport.resume_reading()

    async def _answer(self, request: _Request) -> None:
        try:
            await self.server.app(request.scope(), request.receive, request.send)
        except Exception:  # noqa: BLE001 - the request fails alone; the server goes on
            log.exception("the app failed on %s %s", request.method, request.url[:200])
            if not request.started:
                await _plain(request, 500, "internal error")
        if not request.started:
            log.error("the app sent no answer to %s %s", request.method, request.url[:200])
            await _plain(request, 500, "the app sent no answer")
        self.answering = None
        if not request.finished or not request.keep_alive:  # a cut answer can only end with the connection
            self.transport.close()
            return
        self._answer_next()
        if self.answering is None and self.parsing is None:
            self._time_out(self.server.keep_alive_s, None)

    def _refuse(self, status: int, message: str) -> None:
        """Answer a request that cannot be read with ``status`` and close the connection (after the answers due)."""
        self._time_out(None, None)
        self.transport.pause_reading()
        self.waiting.clear()
        refused = _Request(self)
        refused.keep_alive = False
        if self.answering is None:
            asyncio.get_running_loop().create_task(self._refusal(refused, status, message))
        else:  # the answer in progress goes first; the connection closes after it
            self.answering.keep_alive = False

    async def _refusal(self, request: _Request, status: int, message: str) -> None:
        await _plain(request, status, message)
        self.transport.close()

    def _time_out(self, after_s: float | None, status: int | None) -> None:
        """From now, close the connection after ``after_s`` (answering ``status`` first, when given); None: never.
        The server's sweep closes it (:data:`SWEEP_S`)."""
        self.deadline = None if after_s is None else time.monotonic() + after_s
        self.expiry_status = status

    def expire(self) -> None:
        """The deadline passed: close the connection (after answering the status it was set with, if any)."""
        status, self.deadline = self.expiry_status, None
        if status is None or self.answering is not None:
            self.transport.close()
        else:
            self._refuse(status, f"the request was not received within {self.server.body_timeout_s:g} s")

    def _count_header_bytes(self, n: int) -> None:
        self.parsing.header_bytes += n
        if self.parsing.header_bytes > MAX_HEADER_BYTES:
            raise _Refusal(431, f"request headers exceed {MAX_HEADER_BYTES} bytes")


class _Refusal(Exception):
    """Raised in a parser callback: the request is answered ``status`` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


JSON = [(b"content-type", b"application/json")]
_STATUS_LINES: dict[int, bytes] = {}


def _head(status: int, headers: list[tuple[bytes, bytes]], keep_alive: bool) -> bytes:
    """An answer's status line and headers (``Connection: close`` added when the connection ends with it)."""
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase.encode()
        except ValueError:
            phrase = b""
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, phrase)
    if not keep_alive:
        headers = [*headers, (b"connection", b"close")]
    return line + b"".join(b"%s: %s\r\n" % header for header in headers) + b"\r\n"


def _unquoted(path: bytes) -> str:
    """ASGI's ``path``: the URL's path, percent-decoded."""
    text = path.decode("latin-1")
    return urllib.parse.unquote(text) if "%" in text else text


def _host_port(address: Any) -> tuple[str, int] | None:
    """ASGI's (host, port) of a socket address (IPv6 ones have four parts; a Unix socket's is a path)."""
    return tuple(address[:2]) if isinstance(address, tuple) else None


async def _plain(request: _Request, status: int, message: str) -> None:
    """A JSON error answer in the project's format (:func:`agl_core.http_rules.error_response`)."""
    body = error_body(status, message)
    await request.send({"type": "http.response.start", "status": status, "headers": JSON})
    await request.send({"type": "http.response.body", "body": body})
