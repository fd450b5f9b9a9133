"""The policy servers behind the gateway: which one serves a rollout, and forwarding with retries.

The gateway talks to them with aiohttp's client (:func:`upstream_session`):
kept-alive connections, an answer's headers bounded (aiohttp's 8 KiB per
line), its body read as it comes with flow control (the socket is not read
while 64 KiB wait for a slow reader), one deadline per call from its send to
the end of its answer (``rollout.gateway.upstream_timeout_s``, past which the
call raises :class:`TimeoutError`), and at most ``max_bytes`` of body
(``rollout.gateway.max_upstream_bytes``: :class:`UpstreamTooLarge`).
Any other failure (refused, reset, closed mid-answer, not HTTP) raises
:class:`UpstreamError` naming it.
"""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass

import aiohttp

IDLE_S = 4.0
"""How long an idle upstream connection is kept: less than the 5 s after which uvicorn (vLLM's server) closes one,
so that a call rarely finds its kept-alive connection closed under it."""
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 30.0


class Upstreams:
    """The base URLs of the policy servers (``http://host:port/v1``), each rollout pinned to one.

    The pin is a stable hash of the rollout id, so every call of a rollout
    reaches the same server and reuses its prefix cache.
    """

    def __init__(self, urls: list[str] = ()):
        self.urls: tuple[str, ...] = ()
        self.set(urls)

    def set(self, urls: list[str]) -> None:
        # One assignment of a new tuple: readers on the server thread never see a half-updated list.
        self.urls = tuple(url.rstrip("/") for url in urls)

    def pick(self, rollout_id: str) -> str | None:
        """The base URL that serves ``rollout_id``; None when there are no servers."""
        urls = self.urls
        if not urls:
            return None
        return urls[zlib.crc32(rollout_id.encode()) % len(urls)]


_DRAINING: set[asyncio.Task] = set()


class UpstreamError(Exception):
    """A call that got no usable answer: the server refused the connection, reset or closed it, or did not speak
    HTTP."""


class UpstreamTooLarge(UpstreamError):
    """An answer longer than the gateway reads (``rollout.gateway.max_upstream_bytes``)."""


def upstream_session(timeout_s: float, max_connections: int, headers: dict[str, str] | None = None
                     ) -> aiohttp.ClientSession:
    """The gateway's client for its policy servers, to make on its event loop (see the module docstring)."""
    connector = aiohttp.TCPConnector(limit=max_connections, keepalive_timeout=IDLE_S)
    return aiohttp.ClientSession(connector=connector, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s),
                                 raise_for_status=False)


class Response:
    """An upstream answer whose body is read as it comes: :attr:`status`, :attr:`headers`, :attr:`content_type`,
    :meth:`readany`, :meth:`read`, at most ``max_bytes`` of it. :meth:`release` (or leaving ``async with``) always:
    the connection goes back to the pool when the answer was read to its end and is closed otherwise (a server still
    streaming stops)."""

    def __init__(self, response: aiohttp.ClientResponse, max_bytes: int):
        self._response, self.max_bytes = response, max_bytes
        self.status, self.headers = response.status, response.headers
        self._read = 0

    @property
    def content_type(self) -> str:
        """The media type of ``Content-Type``, lower-case and without parameters."""
        return self._response.content_type.lower()

    async def readany(self) -> bytes:
        """The body's bytes that have arrived since the last read, waiting for some; ``b""`` at its end."""
        try:
            data = await self._response.content.readany()
        except aiohttp.ClientPayloadError as exc:
            raise UpstreamError(f"the answer broke off: {exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(str(exc) or type(exc).__name__) from None
        self._read += len(data)
        if self._read > self.max_bytes:
            self._response.close()
            raise UpstreamTooLarge(f"the answer exceeds {self.max_bytes} bytes "
                                   f"(rollout.gateway.max_upstream_bytes)")
        return data

    async def read(self) -> bytes:
        """The rest of the body, whole."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    def release(self, drain: bool = False) -> None:
        """Done with the answer. ``drain``: the caller read all it wants of a body whose end is near (a stream's
        last event came, the end of its framing may not have): the rest is read in the background, so that the
        connection goes back to the pool, as it does at once for an answer read to its end; without ``drain``, an
        unfinished answer's connection is closed."""
        if drain and not self._response.content.at_eof():
            task = asyncio.get_running_loop().create_task(self._drain())
            _DRAINING.add(task)  # the loop keeps only a weak reference to a task
            task.add_done_callback(_DRAINING.discard)
        else:
            self._response.release()

    async def _drain(self) -> None:
        try:
            while await self.readany():
                pass
        except (UpstreamError, TimeoutError):
            pass
        finally:
            self._response.release()

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


async def post(session: aiohttp.ClientSession, url: str, body: bytes, max_bytes: int) -> Response:
    """POST ``body`` (JSON) to ``url``; the answer once its headers arrived (its body still to read).

    A kept-alive connection the server closed before answering is tried once more on a new one. Raises
    :class:`TimeoutError` past the session's deadline, :class:`UpstreamError` when no answer came.
    """
    for again in (True, False):
        try:
            response = await session.post(url, data=body, headers={"Content-Type": "application/json"})
            return Response(response, max_bytes)
        except TimeoutError:
            raise
        except aiohttp.ServerDisconnectedError as exc:
            if not again:
                raise UpstreamError(f"the policy server closed the connection before answering: {exc}") from None
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamError(f"cannot connect to {url}: {exc.os_error.strerror or exc}") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # aiohttp's InvalidURL is one
            raise UpstreamError(f"{url!r} is not an http(s) URL: {exc}") from None
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class Forwarded:
    """The upstream's final answer (``status``, raw ``body``) after ``tries`` tries; ``error`` if none came."""

    status: int
    body: bytes
    tries: int
    error: str | None = None


@dataclass(frozen=True)
class Opened:
    """An upstream answer with a success status whose body is still to be read (a stream), after ``tries`` tries."""

    response: Response
    tries: int


async def post_with_retries(session: aiohttp.ClientSession, url: str, body: bytes, max_retries: int,
                            backoff_s: float, max_bytes: int) -> Forwarded:
    """POST ``body`` to ``url`` and read the whole answer; retries as :func:`open_with_retries`."""
    opened = await open_with_retries(session, url, body, max_retries, backoff_s, max_bytes)
    return opened if isinstance(opened, Forwarded) else await read_whole(opened, url)


async def read_whole(opened: Opened, url: str) -> Forwarded:
    """The answer of ``opened`` read whole (and released); a 504 or 502 :class:`Forwarded` when that fails."""
    try:
        async with opened.response as response:
            return Forwarded(response.status, await response.read(), opened.tries)
    except TimeoutError:
        return Forwarded(504, b"", opened.tries, f"the policy server {url} did not answer in time")
    except UpstreamTooLarge as exc:
        return Forwarded(502, b"", opened.tries, f"the policy server {url}: {exc}")
    except UpstreamError as exc:
        return Forwarded(502, b"", opened.tries, f"the policy server {url} broke off its answer: {exc}")


async def open_with_retries(session: aiohttp.ClientSession, url: str, body: bytes, max_retries: int,
                            backoff_s: float, max_bytes: int) -> Opened | Forwarded:
    """POST ``body`` to ``url``; retry 429/5xx answers and refused connections with exponential backoff.

    An answer with a status below 400 comes back :class:`Opened`, its body
    unread (the caller reads it, then releases it); any other final answer
    comes back read, as :class:`Forwarded`. Honors ``Retry-After`` (seconds,
    at most 30). A timeout is not retried: the server is busy, and resending
    would add to its load.
    """
    tries = 0
    while True:
        tries += 1
        retry_after = None
        try:
            response = await post(session, url, body, max_bytes)
            if response.status < 400:
                return Opened(response, tries)
            async with response:
                payload = await response.read()
            if response.status not in RETRY_STATUSES or tries > max_retries:
                return Forwarded(response.status, payload, tries)
            retry_after = _seconds(response.headers.get("Retry-After"))
        except TimeoutError:
            return Forwarded(504, b"", tries, f"the policy server {url} did not answer in time")
        except UpstreamTooLarge as exc:
            return Forwarded(502, b"", tries, f"the policy server {url}: {exc}")
        except UpstreamError as exc:
            if tries > max_retries:
                return Forwarded(502, b"", tries, f"cannot reach the policy server {url}: {exc}")
        delay = backoff_s * 2 ** (tries - 1)
        await asyncio.sleep(max(delay, retry_after) if retry_after is not None else delay)


def _seconds(value: str | None) -> float | None:
    try:
        return min(float(value), MAX_RETRY_AFTER_S) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff
