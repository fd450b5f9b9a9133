"""What one client may hold of a server: connections, header bytes and seconds, requests read ahead.

Every HTTP server of the project is uvicorn on httptools
(:class:`agl_core.http.server.ServerThread`). uvicorn applies back-pressure
(a pipelined request waits, with the socket no longer read, until the answer
before it is written, and an answer waits while the client does not read
it), but httptools has no bound on a request's header section, in bytes or
in time, and uvicorn none on connections. :class:`LimitedHttpToolsProtocol`
adds them in uvicorn's own protocol class (passed as ``http=`` to
``uvicorn.Config``), the thinnest layer uvicorn offers:

- **connections**: past ``max_connections`` open at once, a new connection is
  answered 503 and closed at once (no request read);
- **header section**: the request line and headers of a request must arrive
  within ``header_timeout_s`` of its first byte (a new connection's
  included) and hold at most ``max_header_bytes``: a longer one (an endless
  header line included) is answered 431 once that many bytes are in, before
  it is buffered whole, a slower one 408; the connection is then closed;
- **requests read ahead**: a client that sends more than
  :data:`MAX_PIPELINED` requests ahead of the answers it has read is
  disconnected (uvicorn parses every request of a read at once: without a
  bound, one read of tiny pipelined requests held thousands of them);
- an idle kept-alive connection is closed after ``keep_alive_s`` (uvicorn's
  ``timeout_keep_alive``).

A request whose body is wholly read is marked so in its scope (the extension
:data:`~agl_core.http.rules.BODY_RECEIVED`): the app's body reader then needs
no timer for it.

:func:`raise_fd_limit` lifts the process's open-file limit to its hard limit,
so that the connection cap, not the file descriptors, is what a flood of
connections meets.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from agl_core.http.rules import BODY_RECEIVED, error_body

log = logging.getLogger("agl_core.http.limits")

MAX_PIPELINED = 16
"""Requests a connection may have read and queued behind the one being answered; more: it is closed."""


@dataclass(frozen=True)
class ServerLimits:
    """The limits of one server (see the module docstring); the defaults are those of every server of the project."""

    max_connections: int = 1024
    max_header_bytes: int = 64 * 2**10
    header_timeout_s: float = 10.0
    keep_alive_s: float = 60.0


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # an infinite hard limit some kernels refuse as a soft one
            log.warning("cannot raise the open-file limit from %s to %s: %s", soft, hard, exc)
    return soft


class _Refused(Exception):
    """Raised in a parser callback: the request is answered ``status`` and the connection closed."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits of :attr:`limits` (set by :func:`protocol_with`)."""

    limits: ClassVar[ServerLimits] = ServerLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._in_headers = False  # a request's header section has begun and is not complete
        self._between = True  # the next byte read is the first of a request (none is being read)
        self._header_bytes = 0
        self._headers_began_before = False  # the header section being read began in an earlier read
        self._header_timer: asyncio.TimerHandle | None = None
        self._closing = False

    # ------------------------------------------------------------ uvicorn's calls

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._closing = True
            body = error_body(503, f"the server holds its limit of {self.limits.max_connections} connections; "
                                   f"try again later")
            transport.write(_answer(503, body))
            transport.close()
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        self._unset_keepalive_if_required()
        began_here = self._between
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if not isinstance(exc.__context__, _Refused):
                raise
            self._refuse(exc.__context__.status, str(exc.__context__))
            return
        except httptools.HttpParserUpgrade:  # answered as plain HTTP; what follows is not HTTP: the connection ends
            self._closing = True
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.keep_alive = False
            else:
                self._refuse(400, "protocol upgrades (websockets) are not served here")
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, f"malformed HTTP request: {exc}")
            return
        if self._in_headers:
            # The bytes of this read all belong to the header section when the request began with the read;
            # a request that began after another in the same read is counted from the next read on.
            if began_here or self._headers_began_before:
                self._header_bytes += len(data)
            self._headers_began_before = True
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"the request's header section exceeds {self.limits.max_header_bytes} bytes")
                return
            if self._header_timer is None:  # armed only for a header section that spans reads: most arrive whole
                self._arm_header_timer()

    # ------------------------------------------------------------ httptools' calls

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers, self._between, self._header_bytes, self._headers_began_before = True, False, 0, False

    def on_headers_complete(self) -> None:
        parsed = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if parsed > self.limits.max_header_bytes:
            raise _Refused(431, f"the request's header section exceeds {self.limits.max_header_bytes} bytes")
        if len(self.pipeline) >= MAX_PIPELINED:
            log.warning("closing a connection from %s that sent more than %d requests ahead of their answers",
                        self.client, MAX_PIPELINED)
            raise _Refused(0, "too many requests ahead of their answers")
        self._in_headers = False
        self._disarm_header_timer()
        super().on_headers_complete()
        if self.cycle is not None:
            self.cycle.transport = _HeadWithBody(self.transport, self.loop)

    def on_message_complete(self) -> None:
        self._between = True
        if self.cycle is not None and not self.cycle.response_complete:  # the app may take the body without a timer
            self.cycle.scope.setdefault("extensions", {})[BODY_RECEIVED] = {}
        super().on_message_complete()

    # ------------------------------------------------------------ inside

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self._in_headers:
            self._refuse(408, f"the request's headers did not arrive within {self.limits.header_timeout_s:g} s")
        elif self._between and (self.cycle is None or self.cycle.response_complete) and not self.pipeline:
            self.transport.close()  # a new connection that sent nothing

    def _refuse(self, status: int, message: str) -> None:
        """Answer ``status`` (unless 0, or an answer is being written: it would cut into it) and close the
        connection."""
        self._closing = True
        self._disarm_header_timer()
        self.pipeline.clear()
        if status and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(_answer(status, error_body(status, message)))
        self.transport.close()


class _HeadWithBody:
    """The transport of one answer, whose head (status line and headers: uvicorn's first write) goes out with the
    first part of its body, in one write: a whole answer then wakes its client once, not twice. A head whose body
    does not follow in the same turn of the event loop (a stream's first part is not ready) goes out at its end."""

    __slots__ = ("_transport", "_loop", "_head", "_wrote")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop, self._head, self._wrote = transport, loop, None, False

    def write(self, data: bytes) -> None:
        if not self._wrote:
            self._wrote, self._head = True, data
            self._loop.call_soon(self._flush)
            return
        if self._head is not None:
            data, self._head = self._head + data, None
        self._transport.write(data)

    def _flush(self) -> None:
        if self._head is not None:
            head, self._head = self._head, None
            if not self._transport.is_closing():
                self._transport.write(head)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def protocol_with(limits: ServerLimits) -> type[LimitedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for a server of ``limits``."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


def _answer(status: int, body: bytes) -> bytes:
    """A whole JSON answer that closes the connection."""
    return (STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % len(body) + body)
