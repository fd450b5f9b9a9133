"""Serve an ASGI app with uvicorn on a background thread of this process.

The gateway and the test policy endpoint run next to the trainer this way.
Binding the socket here (port 0: the OS picks a free port) makes the URL known
before the server starts, so callers never race for a port. Every server of
the project runs this way (uvicorn on uvloop and httptools), with the limits
of :mod:`agl_core.http.limits` on what one client may hold.
"""

from __future__ import annotations

import errno
import signal
import socket
import sys
import threading
import time
from typing import Any

import uvicorn

from agl_core.config import ConfigError
from agl_core.http.limits import ServerLimits, protocol_with, raise_fd_limit

SHUTDOWN_S = 10
"""How long a stopping server waits for the requests in flight before it cancels them."""


class ServerThread:
    """A uvicorn server for ``app`` on ``host:port``, run by a daemon thread, within ``limits``
    (:class:`~agl_core.http.limits.ServerLimits`: connections, header bytes and seconds, keep-alive).

    ``start()`` returns once the server accepts connections (or raises after
    ``timeout_s``); ``stop()`` asks it to exit and joins the thread. An address
    that cannot be bound (a port in use, a host not of this machine) is a
    :class:`ConfigError` naming ``host:port`` and ``setting``, the recipe key
    that chose them, when given.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, name: str = "agl-http", *,
                 setting: str | None = None, limits: ServerLimits | None = None):
        self.host, self.name = host, name
        self.limits = limits or ServerLimits()
        raise_fd_limit()
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind((host, port))
        except OSError as exc:
            self._socket.close()
            key = f"{setting}: " if setting else ""
            hint = "; choose another port (0: any free one)" if exc.errno == errno.EADDRINUSE else ""
            raise ConfigError(f"{key}{name} cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
        self.port: int = self._socket.getsockname()[1]
        # uvloop roughly halves the per-request cost; asyncio where it does not exist (Windows). No proxy headers:
        # the services are reached directly, and a client's X-Forwarded-For would be believed from loopback.
        loop = "uvloop" if sys.platform != "win32" else "asyncio"
        config = uvicorn.Config(app, loop=loop, http=protocol_with(self.limits), lifespan="auto", ws="none",
                                server_header=False, proxy_headers=False, log_level="warning", access_log=False,
                                timeout_keep_alive=self.limits.keep_alive_s,
                                timeout_graceful_shutdown=SHUTDOWN_S, backlog=4096)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port``, the address clients use."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start(); a server thread must not die silently
            self._error = exc

    def start(self, timeout_s: float = 10.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"{self.name} failed to start on {self.url}: {self._error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} did not start on {self.url} within {timeout_s} s")
            time.sleep(0.005)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set: a service's main thread waits on it, then closes cleanly."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    return stop
