"""The policy servers behind the gateway: which one serves a rollout, and forwarding with retries."""

from __future__ import annotations

import asyncio
import zlib
from dataclasses import dataclass

from agl_core.gateway.http_client import HttpClient, Response, UpstreamError

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


async def post_with_retries(client: HttpClient, url: str, body: bytes,
                            max_retries: int, backoff_s: float) -> Forwarded:
    """POST ``body`` to ``url`` and read the whole answer; retries as :func:`open_with_retries`."""
    opened = await open_with_retries(client, url, body, max_retries, backoff_s)
    if isinstance(opened, Forwarded):
        return opened
    try:
        async with opened.response as response:
            return Forwarded(response.status, await response.read(), opened.tries)
    except TimeoutError:
        return Forwarded(504, b"", opened.tries, f"the policy server {url} did not answer in time")
    except UpstreamError as exc:
        return Forwarded(502, b"", opened.tries, f"the policy server {url} broke off its answer: {exc}")


async def open_with_retries(client: HttpClient, url: str, body: bytes,
                            max_retries: int, backoff_s: float) -> Opened | Forwarded:
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
            response = await client.post(url, body)
            if response.status < 400:
                return Opened(response, tries)
            async with response:
                payload = await response.read()
            if response.status not in RETRY_STATUSES or tries > max_retries:
                return Forwarded(response.status, payload, tries)
            retry_after = _seconds(response.headers.get("Retry-After"))
        except TimeoutError:
            return Forwarded(504, b"", tries, f"the policy server {url} did not answer in time")
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
