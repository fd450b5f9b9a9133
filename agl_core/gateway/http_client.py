"""The gateway's HTTP/1.1 client for its policy servers: a POST of JSON, its answer read whole or as it comes.

Every model call through the gateway is one POST to a policy server on a
kept-alive connection, so this client keeps only what that needs, on
asyncio and httptools (the parser uvicorn and the store client use):

- a pool of idle connections per server, without limit (as the gateway's
  agents are bounded by the runner, not here); a request on a kept-alive
  connection that the server closed without a byte of answer is sent again
  on another connection (servers close idle connections: uvicorn after 5 s);
- the answer's status and headers as soon as they arrive
  (:meth:`HttpClient.post`), then its body whole (:meth:`Response.read`) or a
  read at a time (:meth:`Response.readany`, for a stream), chunked,
  length-delimited or ended by the server closing; the socket stops being read
  while more than ``HIGH_WATER`` bytes wait for a slow reader;
- one deadline per request, from its send to the end of its answer
  (``timeout_s``): past it the connection is dropped and the waiting call
  raises :class:`TimeoutError`;
- any other failure (refused, reset, closed mid-answer, not HTTP) raises
  :class:`UpstreamError` naming it.

Why not aiohttp, which the gateway used before: measured side by side
against the test endpoint (sequential chat calls, one process), its client
took 460-500 µs a call and this one 310-340 µs; the difference is on every
call's path and on every streamed call's first token (``docs/design-decisions.md``).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import urllib.parse

import httptools

HIGH_WATER = 2**18
"""Bytes of an answer waiting for its reader beyond which the connection stops reading."""


class UpstreamError(Exception):
    """A request that got no usable answer: the server refused the connection, reset or closed it, or did not
    speak HTTP."""


@functools.lru_cache(maxsize=256)
def _target(url: str) -> tuple[tuple[str, int, bool], str, bytes]:
    """``url`` as (host, port, TLS), the request target, and the Host header line."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UpstreamError(f"{url!r} is not an http(s) URL")
    tls = parts.scheme == "https"
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return (parts.hostname, parts.port or (443 if tls else 80), tls), path, f"Host: {parts.netloc}\r\n".encode()


class Response:
    """One answer: :attr:`status`, :attr:`headers` (names lower-case), :attr:`content_type`, and its body through
    :meth:`read` or :meth:`readany`. :meth:`release` (or leaving ``async with``) always: it gives the connection
    back when the answer was read to its end and closes it otherwise (a server still streaming stops), unless told
    to drain it."""

    def __init__(self, status: int, headers: dict[str, str], connection: _Connection):
        self.status, self.headers = status, headers
        self._connection: _Connection | None = connection

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower-case and without parameters (``application/octet-stream``
        when absent, as HTTP says)."""
        value = self.headers.get("content-type")
        return value.split(";", 1)[0].strip().lower() if value else "application/octet-stream"

    async def readany(self) -> bytes:
        """The body's bytes that have arrived since the last read, waiting for some; ``b""`` at its end."""
        connection = self._connection
        if connection is None:
            return b""
        return await connection.read_some()

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self, drain: bool = False) -> None:
        """Done with the answer. ``drain``: the caller read all it wants of a body whose end is near (a stream's
        last event came, the end of its framing may not have): the connection waits for that end, then goes back
        to the pool, as it does at once for an answer read to its end; without ``drain``, an unfinished answer's
        connection is closed."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.release(drain)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class HttpClient:
    """POSTs to policy servers; ``headers`` (a dict) go with every request; ``timeout_s`` bounds each request
    from its send to the end of its answer. :meth:`close` drops every connection."""

    def __init__(self, timeout_s: float, headers: dict[str, str] | None = None):
        self.timeout_s = timeout_s
        self._headers = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items()).encode()
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = collections.defaultdict(list)
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, content_type: str = "application/json") -> Response:
        """Send ``body`` to ``url``; the answer once its headers arrived (its body still to read).

        Raises :class:`TimeoutError` past the deadline, :class:`UpstreamError`
        when no answer came.
        """
        key, path, host = _target(url)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        request = (b"POST " + path.encode() + b" HTTP/1.1\r\n" + host + self._headers
                   + b"Content-Type: " + content_type.encode() + b"\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        idle = self._idle[key]
        while idle:  # a kept-alive connection; one the server closed since is sent again on a new one
            connection = idle.pop()
            if connection.closed:
                continue
            try:
                return await connection.send(request, deadline)
            except _NotRead:
                continue
        connection = await self._connect(key, url, deadline)
        try:
            return await connection.send(request, deadline)
        except _NotRead as exc:
            raise UpstreamError(str(exc)) from None

    async def _connect(self, key: tuple[str, int, bool], url: str, deadline: float) -> _Connection:
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout_at(deadline):
                _, connection = await loop.create_connection(lambda: _Connection(self, key), host, port,
                                                             ssl=self._tls if tls else None)
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {url}: {exc.strerror or exc}") from None
        return connection

    async def close(self) -> None:
        for connection in list(self._open):
            connection.abort(UpstreamError("the gateway's client closed"))
        self._idle.clear()


class _NotRead(Exception):
    """A kept-alive connection closed before any byte of the answer: the request may be sent again."""


class _Connection(asyncio.Protocol):
    """One connection to a policy server: one request at a time, its answer parsed as it arrives."""

    def __init__(self, client: HttpClient, key: tuple[str, int, bool]):
        self.client, self.key = client, key
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False  # it answered a request before this one
        self._waiter: asyncio.Future | None = None  # the headers' future, then a reader's
        self._timer: asyncio.TimerHandle | None = None
        self._header_list: list[tuple[bytes, bytes]] = []
        self._response: Response | None = None
        self._body: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._complete = False  # the whole answer arrived
        self._keep_alive = False  # and the server keeps the connection open after it
        self._draining = False  # released with drain: the rest of the answer is read and dropped
        self._error: BaseException | None = None
        self._got_bytes = False

    # ------------------------------------------------------------ the caller's side

    async def send(self, request: bytes, deadline: float) -> Response:
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        self._timer = loop.call_at(deadline, self._time_out)
        self.transport.write(request)
        try:
            return await self._waiter
        except _NotRead:
            self._cancel_timer()
            raise
        except BaseException:
            self._cancel_timer()
            self.abort(None)
            raise

    async def read_some(self) -> bytes:
        while not self._body:
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        data = self._body.popleft() if len(self._body) == 1 else b"".join(self._body)
        self._drop_body()
        return data

    def release(self, drain: bool) -> None:
        """Back to the idle pool once its answer arrived whole and the server keeps it alive; else closed, or,
        with ``drain``, left to finish arriving (unread) before its deadline, then pooled or closed the same way."""
        self._drop_body()
        if not self._complete and drain and not self.closed:
            self._draining = True
            return
        self._cancel_timer()
        if self._complete and self._keep_alive and not self.closed:
            self.reused, self._complete, self._got_bytes, self._response = True, False, False, None
            self.client._idle[self.key].append(self)
        else:
            self.abort(None)

    def _drop_body(self) -> None:
        """Forget the body read so far (taken by the reader, or not wanted), and read the socket again."""
        self._body.clear()
        self._buffered = 0
        if self._paused and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def abort(self, error: BaseException | None) -> None:
        if error is not None:
            self._fail(error)
        if not self.closed:
            self.closed = True
            self.transport.abort()

    # ------------------------------------------------------------ asyncio

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.client._open.add(self)

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort(UpstreamError("the policy server switched protocols"))
        except httptools.HttpParserError as exc:
            self.abort(UpstreamError(f"the policy server's answer is not HTTP/1.1: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.client._open.discard(self)
        if self._response is None:
            if self.reused and not self._got_bytes:
                self._fail(_NotRead("the policy server closed a kept-alive connection"))
            else:
                self._fail(UpstreamError(f"the policy server closed the connection before answering"
                                         f"{f': {exc}' if exc else ''}"))
        elif not self._complete:
            if self._delimited_by_close():
                self._complete = True
                self._wake()
            else:
                self._fail(UpstreamError(f"the policy server closed the connection mid-answer"
                                         f"{f': {exc}' if exc else ''}"))

    # ------------------------------------------------------------ httptools

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in self._header_list}
        self._header_list = []
        status = self.parser.get_status_code()
        if status < 200:  # 100 Continue and other interim answers: the real one follows
            return
        self._response = Response(status, headers, self)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(self._response)

    def on_body(self, body: bytes) -> None:
        if self._draining:
            return
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._response is None:  # an interim answer ended
            return
        self._complete = True
        self._keep_alive = self.parser.should_keep_alive()  # the parser forgets it for the next message
        self._cancel_timer()
        if self._draining:
            self._draining = False
            self.release(False)
        else:
            self._wake()

    # ------------------------------------------------------------ inside

    def _delimited_by_close(self) -> bool:
        headers = self._response.headers
        return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "").lower()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)

    def _time_out(self) -> None:
        self._timer = None
        self.abort(TimeoutError("the policy server did not answer in time"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
