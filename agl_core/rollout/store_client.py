"""``HttpStore``: the :class:`~agl_core.rollout.store.Store` protocol, spoken to a store service over HTTP.

The service is ``agl serve store`` (:mod:`agl_core.rollout.store_server`, which
documents the wire format). Any trainer, runner, gateway or script uses it
by URL: ``HttpStore("http://10.0.0.5:8765", token=...)``, or the recipe's
``rollout.store: http`` with ``plugins.http_store.url`` (built-in plugin
:mod:`agl_core.builtin.http_store`).

- **Connections.** Each thread keeps one keep-alive connection of the
  standard library's ``http.client`` (a thread never waits for another's
  call; TLS for an ``https`` URL, checked against the system's certificate
  authorities). The connection is opened within ``connect_timeout_s`` (at
  most 10 s a try); a request's answer is waited for up to 60 s beyond the
  long poll it asks for. Every request is a small JSON POST, sent in one
  write (head and body: one packet, one wake-up of the service). ``http.client``
  was measured the fastest of the well-kept synchronous clients (urllib3
  and ``httpx.Client`` cost more per call): ``benchmarks/bench_http_parts.py``.
- **Retries.** A connection error, a timeout or a 502/503/504 is retried, at
  once the first time (a keep-alive connection the service closed), then with
  exponential backoff, for up to ``connect_timeout_s`` after the first
  failure; then a ConnectionError names the URL, the method and the last
  error. Other errors are not retried: 404 for a rollout the store does not
  hold is a KeyError (the protocol's, which the gateway relies on), 409 a
  :class:`~agl_core.rollout.store.LeaseError` (a lease token that is not the
  attempt's, spans of an ended attempt, a conflicting span), 400 a
  ValueError with the service's message, 401 a PermissionError.
- **Spans.** ``add_spans`` checks the spans (a span no store could write
  back faithfully is a ValueError at once, for the caller's call alone),
  queues them with their attempts' lease tokens (bounded: it blocks when
  ``max_pending`` wait) and returns; a background thread uploads them in
  batches and retries a batch until the service acknowledges it, which it
  does once they are in its SQLite file. An ``admit`` or a ``finish`` takes
  the spans waiting at that moment along (one request less per call when a
  gateway's calls follow each other, and per rollout when its runner added
  spans, such as an emitted reward); refused, it gives them back to the
  uploader and is asked again without them. ``flush()`` returns once every
  span added before it is acknowledged; ``get_rollouts`` and ``release``
  flush first, and ``finish`` is sent once the spans already on their way
  are acknowledged, so a rollout never ends before the spans its finisher
  added are durable and a process reads what it wrote. An upload
  that fails for good (the service gone past ``connect_timeout_s``, a 4xx,
  a 5xx such as a full disk) loses those spans alone: a refused batch is
  sent again span by span, and each attempt whose spans are lost is ended
  ``failed`` on the service (the uploader holds its lease token), logged;
  the next batch is uploaded as if nothing happened.
- **Calls repeated by a retry.** A request may reach the service and its
  answer be lost (the service killed after it applied it), so a retry may
  repeat it. Sequence ids make span uploads idempotent (the service keeps
  one span per rollout, attempt and sequence id). ``enqueue`` retried after
  it was applied is no error when the service holds exactly those rollouts;
  ``finish`` retried after it was applied returns True when the rollout
  ended with this attempt, status, reward and error. A repeated
  ``next_sequence_id`` skips an id (ids stay unique and ordered), and so
  does a repeated ``admit``, whose unused ids the service then waits for at
  the attempt's ``finish`` (up to its ``SPAN_WAIT_S``, logged); a lost
  ``dequeue`` answer leaves an attempt nobody runs, which expires with its
  lease like any lost worker's; the counts of a repeated ``cancel`` or
  ``requeue_expired`` leave out what the first try did.
- **Long polls.** ``dequeue(wait_s=...)`` and ``wait(timeout_s=...)`` are
  sent as a series of requests that the service bounds (a few seconds
  each), until the caller's deadline.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
import time
import urllib.parse
import weakref
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from agl_core.data import Rollout, Span, Task
from agl_core.http.recordable import check_span
from agl_core.http.rules import token_from
from agl_core.rollout.span_batcher import SpanBatcher
from agl_core.rollout.store import FAILED, Attempt, AttemptState, LeaseError, Leases, NewRollout, lost_spans_error

log = logging.getLogger("agl_core.rollout.store_client")

TOKEN_ENV = "AGL_STORE_TOKEN"
UNKNOWN_ROLLOUT = "unknown_rollout"
LEASE = "lease"
"""The error ``type`` of a 409 that is the protocol's LeaseError."""
"""The error ``type`` of a 404 that is the protocol's KeyError (any other 404 is a wrong URL)."""
REQUEST_TIMEOUT_S = 60.0
"""How long one request may take beyond the long poll it asks for before it is given up and retried
(the service's SQLite waits up to 30 s for a lock another process holds)."""
CONNECT_TIMEOUT_S = 10.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.05, 2.0
RETRIED_STATUSES = frozenset({502, 503, 504})


class Rollouts(BaseModel):
    """The answer of ``get_rollouts`` and ``query`` on the wire."""

    model_config = ConfigDict(extra="forbid")
    rollouts: list[Rollout]


class HttpStore:
    """The store served at ``url`` (``http://host:port``, as ``agl serve store`` prints it).

    ``token`` (default ``$AGL_STORE_TOKEN``) is sent as the bearer token.
    ``connect_timeout_s`` bounds how long a call keeps retrying a service
    that does not answer. Span uploads carry up to ``batch_size`` spans and
    about ``batch_bytes`` of JSON each; ``max_pending`` spans may wait for
    upload before ``add_spans`` blocks. See the module docstring for retries
    and what a retried call means.
    """

    def __init__(self, url: str, token: str | None = None, *, connect_timeout_s: float = 60.0,
                 batch_size: int = 256, batch_bytes: int = 4 * 2**20, max_pending: int = 20_000):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") \
                or parts.query or parts.fragment:
            raise ValueError(f"the store service URL {url!r} must be http(s)://host:port, as agl serve store "
                             f"prints it")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"the store service URL {url!r} has a bad port: {exc}") from None
        self.url = url.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        token = token_from(token, TOKEN_ENV)
        self._address = (parts.hostname, port)
        self._tls = ssl.create_default_context() if parts.scheme == "https" else None
        self._headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
        self._local = threading.local()
        self._connections: weakref.WeakSet[http.client.HTTPConnection] = weakref.WeakSet()
        self._connections_lock = threading.Lock()
        self._closed = False
        self._batch_bytes = batch_bytes
        self._uploader: SpanBatcher[tuple[Span, str | None]] = SpanBatcher(
            self._upload, self._spans_lost, name="agl-store-span-uploader", refusals=(LeaseError, ValueError),
                                     batch_size=batch_size, max_pending=max_pending)
        self._uploader.start()

    # ------------------------------------------------------------ the wire

    def _exchange(self, method: str, body: dict[str, Any] | bytes, wait_s: float = 0.0) -> tuple[int, bytes, bool]:
        """POST ``body`` to ``method``, retried as the module docstring says: (status, answer, whether retried)."""
        if self._closed:
            raise RuntimeError(f"the client of the store service at {self.url} is closed")
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        path = f"/v1/store/{method}"
        deadline, tries, backoff = None, 0, FIRST_BACKOFF_S
        while True:
            tries += 1
            try:
                status, raw = self._send(path, data, REQUEST_TIMEOUT_S + wait_s)
                if status not in RETRIED_STATUSES:
                    return status, raw, tries > 1
                last = f"HTTP {status}: {_message(raw)}"
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, cut or garbled
                self._drop_connection()
                last = f"{type(exc).__name__}: {exc}"
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.connect_timeout_s
            if now >= deadline:
                raise ConnectionError(f"the store service at {self.url} did not answer {method} for "
                                      f"{self.connect_timeout_s:g} s ({tries} tries; last: {last})")
            if tries > 1:  # the first retry goes at once: most often a keep-alive connection the service closed
                time.sleep(min(backoff, deadline - now))
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _send(self, path: str, data: bytes, timeout_s: float) -> tuple[int, bytes]:
        """POST ``data`` to ``path`` on this thread's connection (opened first if it is not): (status, body)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            host, port = self._address
            connect_timeout_s = min(CONNECT_TIMEOUT_S, self.connect_timeout_s)
            conn = self._local.conn = (
                _Connection(host, port, timeout=connect_timeout_s) if self._tls is None
                else _TlsConnection(host, port, timeout=connect_timeout_s, context=self._tls))
            with self._connections_lock:
                self._connections.add(conn)
        if conn.sock is None:  # new, or closed by a failure or by the service: connected within the connect timeout
            conn.connect()
        if conn.sock.gettimeout() != timeout_s:  # setting a timeout costs system calls; most requests ask the same
            conn.sock.settimeout(timeout_s)
        conn.request("POST", path, data, self._headers)
        response = conn.getresponse()  # an answer that ends the connection closes it: the next request reconnects
        return response.status, response.read()

    def _drop_connection(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()  # the next try connects afresh

    def _call(self, method: str, body: dict[str, Any] | bytes, wait_s: float = 0.0) -> bytes:
        """The service's answer to ``method``; its refusal as the exception the protocol promises."""
        status, raw, _ = self._exchange(method, body, wait_s)
        if status >= 300:
            raise self._error(method, status, raw)
        return raw

    def _error(self, method: str, status: int, raw: bytes) -> Exception:
        message, kind = _message(raw), None
        try:
            kind = json.loads(raw)["error"]["type"]
        except (ValueError, KeyError, TypeError):
            pass
        if status == 404 and kind == UNKNOWN_ROLLOUT:
            return KeyError(message)
        if status == 409 and kind == LEASE:
            return LeaseError(message)
        where = f"the store service at {self.url} ({method})"
        if status == 401:
            return PermissionError(f"{where} refused the request: {message}; set the token (HttpStore(token=...), "
                                   f"plugins.http_store.token or ${TOKEN_ENV})")
        if 400 <= status < 500:
            return ValueError(f"{where}: {message}")
        return RuntimeError(f"{where} failed: HTTP {status}: {message}")

    # ------------------------------------------------------------ queue and attempts

    def enqueue(self, rollouts: Sequence[NewRollout]) -> None:
        body = {"rollouts": [{"rollout_id": r.rollout_id, "task": r.task.model_dump(mode="json"),
                              "sample_index": r.sample_index, "max_attempts": r.max_attempts,
                              "metadata": r.metadata, "ahead": r.ahead} for r in rollouts]}
        status, raw, retried = self._exchange("enqueue", body)
        if status >= 300 and not (retried and status == 400 and self._holds(rollouts)):
            raise self._error("enqueue", status, raw)

    def _holds(self, rollouts: Sequence[NewRollout]) -> bool:
        """Whether the service holds exactly ``rollouts`` (an enqueue it applied before its answer was lost)."""
        held = {r.rollout_id: r for r in self.get_rollouts([r.rollout_id for r in rollouts])}
        return all((r.rollout_id in held and held[r.rollout_id].task_id == r.task.id
                    and held[r.rollout_id].sample_index == r.sample_index
                    and held[r.rollout_id].metadata == r.metadata) for r in rollouts)

    def dequeue(self, worker_id: str, lease_s: float, wait_s: float = 0.0) -> Attempt | None:
        deadline = time.monotonic() + wait_s
        while True:
            left = max(0.0, deadline - time.monotonic())
            answer = json.loads(self._call("dequeue", {"worker_id": worker_id, "lease_s": lease_s, "wait_s": left},
                                           wait_s=left))["attempt"]
            if answer is not None:
                return Attempt(answer["rollout_id"], answer["attempt_id"], Task.model_validate(answer["task"]),
                               answer["sample_index"], answer["metadata"], answer["lease"])
            if time.monotonic() >= deadline:
                return None

    def heartbeat(self, rollout_id: str, attempt_id: str, lease_s: float, *, lease: str | None = None) -> bool:
        body = {"rollout_id": rollout_id, "attempt_id": attempt_id, "lease_s": lease_s, "lease": lease}
        return json.loads(self._call("heartbeat", body))["ok"]

    def finish(self, rollout_id: str, attempt_id: str, status: str,
               final_reward: float | None = None, error: str | None = None, *, lease: str | None = None) -> bool:
        """One round trip, once the spans this process added are on their way: those waiting for upload ride on it
        (the service writes them first), so they are durable before the rollout is seen to end."""
        head = json.dumps({"rollout_id": rollout_id, "attempt_id": attempt_id, "status": status,
                           "final_reward": final_reward, "error": error, "lease": lease}).encode()
        code, raw, retried = self._carrying("finish", head, after_the_rest=True)
        if code >= 300:
            raise self._error("finish", code, raw)
        done = json.loads(raw)["ok"]
        if not done and retried:  # maybe the first try ended it and its answer was lost
            held = self.get_rollouts([rollout_id])
            done = bool(held) and (held[0].attempt_id, held[0].status, held[0].final_reward, held[0].error) == \
                (attempt_id, status, final_reward, error)
        return done

    def cancel(self, rollout_ids: Sequence[str] | None, reason: str) -> int:
        body = {"rollout_ids": None if rollout_ids is None else list(rollout_ids), "reason": reason}
        return json.loads(self._call("cancel", body))["count"]

    def requeue_expired(self) -> int:
        return json.loads(self._call("requeue_expired", {}))["count"]

    def attempt_state(self, rollout_id: str, attempt_id: str) -> AttemptState | None:
        state = json.loads(self._call("attempt_state", {"rollout_id": rollout_id, "attempt_id": attempt_id}))["state"]
        return None if state is None else AttemptState(state["rollout_status"], state["current"], state["metadata"])

    def admit(self, rollout_id: str, attempt_id: str, n: int, *,
              lease: str | None = None) -> tuple[AttemptState | None, list[int]]:
        """One round trip, which carries the spans waiting for upload; the service then makes :meth:`finish` of
        the attempt wait for these ids' spans."""
        head = json.dumps({"rollout_id": rollout_id, "attempt_id": attempt_id, "n": n, "lease": lease}).encode()
        status, raw, _ = self._carrying("admit", head)
        if status >= 300:
            raise self._error("admit", status, raw)
        answer = json.loads(raw)
        state = answer["state"]
        return (None if state is None else AttemptState(state["rollout_status"], state["current"], state["metadata"]),
                answer["sequence_ids"])

    def _carrying(self, method: str, head: bytes, *, after_the_rest: bool = False) -> tuple[int, bytes, bool]:
        """:meth:`_exchange` of ``method`` (its JSON body ``head``) with the spans waiting for upload riding on it
        (after those already on their way, with ``after_the_rest``). Refused, it is asked again without them;
        they go back to the uploader (first uploaded, with ``after_the_rest``), whose own upload reports a refusal.
        """

        def send(items: list[tuple[Span, str | None]]) -> tuple[int, bytes, bool]:
            answer = self._exchange(method, head[:-1] + b", " + _spans_fields(items) + b"}" if items else head)
            if items and answer[0] >= 300:
                raise _NotCarried
            return answer

        try:
            return self._uploader.carry(send, after_the_rest=after_the_rest)
        except _NotCarried:
            if after_the_rest:
                self.flush()
            return self._exchange(method, head)

    # ------------------------------------------------------------ spans

    def next_sequence_id(self, rollout_id: str) -> int:
        """The next id, counted by the service; KeyError for a rollout it does not hold."""
        return json.loads(self._call("next_sequence_id", {"rollout_id": rollout_id}))["sequence_id"]

    def add_spans(self, spans: Sequence[Span], *, leases: Leases | None = None) -> None:
        """Check the spans (ValueError naming what no store could record), then queue them for upload."""
        if self._closed:  # nobody would upload them
            raise RuntimeError(f"the client of the store service at {self.url} is closed")
        for span in spans:
            check_span(span)
        leases = leases or {}
        self._uploader.put([(span, leases.get((span.rollout_id, span.attempt_id))) for span in spans])

    def flush(self) -> None:
        self._uploader.flush()

    def _upload(self, items: list[tuple[Span, str | None]]) -> None:
        """Send the spans of ``items`` (the uploader's thread), in requests of about ``batch_bytes`` each, retried
        until acknowledged: the service answers once they are in its file. A refusal (409, 400) is raised: the
        uploader then sends the spans one by one, so that only those refused are lost."""
        part, dumped, size = [], [], 0
        for index, item in enumerate(items):
            part.append(item)
            dumped.append(item[0].model_dump_json().encode())
            size += len(dumped[-1])
            if size >= self._batch_bytes or index == len(items) - 1:
                self._call("add_spans", b"{" + _spans_fields(part, dumped) + b"}")
                part, dumped, size = [], [], 0

    def _spans_lost(self, items: list[tuple[Span, str | None]], error: BaseException) -> None:
        """Spans the service did not take: each attempt they belong to ends failed (logged), if it still runs."""
        text = f"the store service at {self.url} did not take them: {error}"
        attempts: dict[tuple[str, str], list[str | None]] = {}
        for span, lease in items:
            attempts.setdefault((span.rollout_id, span.attempt_id), []).append(lease)
        for (rollout_id, attempt_id), leases in attempts.items():
            log.error("%d span(s) of rollout %s attempt %s lost: %s", len(leases), rollout_id, attempt_id, text)
            body = {"rollout_id": rollout_id, "attempt_id": attempt_id, "status": FAILED, "final_reward": None,
                    "error": lost_spans_error(len(leases), text), "lease": leases[0]}
            try:  # not self.finish: it would wait for this thread's own flush
                self._call("finish", body)
            except Exception as exc:  # noqa: BLE001 - the attempt then ends as its runner says; logged
                log.error("cannot end rollout %s attempt %s as failed: %s", rollout_id, attempt_id, exc)

    # ------------------------------------------------------------ reading

    def wait(self, rollout_ids: Sequence[str], timeout_s: float) -> set[str]:
        deadline = time.monotonic() + timeout_s
        wanted = list(dict.fromkeys(rollout_ids))
        while True:
            left = max(0.0, deadline - time.monotonic())
            done = set(json.loads(self._call("wait", {"rollout_ids": wanted, "timeout_s": left},
                                             wait_s=left))["done"])
            if len(done) == len(wanted) or time.monotonic() >= deadline:
                return done

    def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout]:
        self.flush()
        return Rollouts.model_validate_json(self._call("get_rollouts", {"rollout_ids": list(rollout_ids)})).rollouts

    def query(self, statuses: Sequence[str] | None = None) -> list[Rollout]:
        body = {"statuses": None if statuses is None else list(statuses)}
        return Rollouts.model_validate_json(self._call("query", body)).rollouts

    def release(self, rollout_ids: Sequence[str]) -> None:
        self.flush()
        self._call("release", {"rollout_ids": list(rollout_ids)})

    def close(self) -> None:
        """Upload what is queued (retrying up to ``connect_timeout_s``), then close every connection."""
        try:
            self._uploader.stop()
        finally:
            self._closed = True
            with self._connections_lock:
                for conn in list(self._connections):
                    conn.close()
                self._connections.clear()


class _OneWrite:
    """An ``http.client`` connection that sends each request in one write, when its answer is asked for.

    ``http.client`` writes a request's head and body apart; with the TCP_NODELAY
    it sets, they leave as two packets and wake the service twice. Its public
    ``send`` is the one way it writes, ``putrequest`` begins every request
    (what a failed one left unsent is dropped there) and ``getresponse`` ends
    the sending.
    """

    _unsent: list[bytes]

    def putrequest(self, *args: Any, **kwargs: Any) -> None:
        self._unsent = []
        super().putrequest(*args, **kwargs)

    def send(self, data: bytes) -> None:
        self._unsent.append(data)

    def getresponse(self) -> http.client.HTTPResponse:
        data, self._unsent = b"".join(self._unsent), []
        if data:
            super().send(data)
        return super().getresponse()


class _Connection(_OneWrite, http.client.HTTPConnection):
    pass


class _TlsConnection(_OneWrite, http.client.HTTPSConnection):
    pass


class _NotCarried(Exception):
    """An ``admit`` or ``finish`` the service refused with spans riding on it: asked again without them."""


def _spans_fields(items: list[tuple[Span, str | None]], dumped: list[bytes] | None = None) -> bytes:
    """``"spans": [...], "leases": [...]``: the fields of a span upload (each span as ``model_dump_json`` writes
    it, or as ``dumped`` holds it so, and the lease token of each attempt they belong to)."""
    leases = {(span.rollout_id, span.attempt_id): lease for span, lease in items}
    spans = dumped if dumped is not None else [span.model_dump_json().encode() for span, _ in items]
    return (b'"spans":[' + b",".join(spans) + b'],"leases":'
            + json.dumps([{"rollout_id": r, "attempt_id": a, "lease": lease}
                          for (r, a), lease in leases.items()]).encode())


def _message(raw: bytes) -> str:
    """The message of an error answer (the project's servers answer ``{"error": {"message": ...}}``)."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace") or "(no body)"
