"""The rollout store as an HTTP service: ``agl serve store --db PATH [--host H] [--port P] [--token T]``.

It serves the :class:`~agl_core.rollout.store.Store` protocol of one SQLite file
(agl-plugin-sqlite's store) to any number of trainers, gateways and runners
(:class:`agl_core.rollout.store_client.HttpStore` speaks it). It prints its URL on
stdout once it accepts connections and serves until SIGINT or SIGTERM; then
it finishes the requests in flight and closes the store (every span written).

**Wire format.** ``POST /v1/store/<method>`` with a JSON object of the
method's arguments, answered 200 with a JSON object:

====================  ============================================  ==============================
method                request                                       answer
====================  ============================================  ==============================
``enqueue``           ``rollouts: [{rollout_id, task, sample_index,  ``{}``
                      max_attempts, metadata, ahead}]``
``dequeue``           ``worker_id, lease_s, wait_s``                ``attempt: {rollout_id,
                                                                    attempt_id, task, sample_index,
                                                                    metadata, lease} | null``
``heartbeat``         ``rollout_id, attempt_id, lease_s, lease``    ``ok``
``finish``            ``rollout_id, attempt_id, status,             ``ok``
                      final_reward, error, lease, spans?,
                      leases?`` (spans waiting for upload ride
                      on it, written first, as by ``add_spans``)
``cancel``            ``rollout_ids | null, reason``                ``count``
``requeue_expired``   ``{}``                                        ``count``
``attempt_state``     ``rollout_id, attempt_id``                    ``state: {rollout_status,
                                                                    current, metadata} | null``
``admit``             ``rollout_id, attempt_id, n, lease,           ``state: {...} | null,
                      spans?, leases?`` (spans waiting for upload   sequence_ids: [int]``
                      ride on it, written first, as by
                      ``add_spans``)
``next_sequence_id``  ``rollout_id``                                ``sequence_id``
``add_spans``         ``spans: [Span], leases: [{rollout_id,        ``count`` (once in the file)
                      attempt_id, lease}]``
``wait``              ``rollout_ids, timeout_s``                    ``done: [rollout_id]``
``get_rollouts``      ``rollout_ids``                               ``rollouts: [Rollout]``
``query``             ``statuses | null``                           ``rollouts: [Rollout]``
``release``           ``rollout_ids``                               ``{}``
====================  ============================================  ==============================

Tasks, spans and rollouts are their pydantic models as JSON. ``GET /healthz``
answers ``{"ok": true}`` (with the file's path for a caller with the token).
Errors use the format of :func:`agl_core.http.rules.error_response`: 400 for
a body that is not the method's (naming the field) or that the store refuses
(a rollout id already queued, a status that is not terminal, a span no
reader could read back: nested deeper than
:data:`~agl_core.http.recordable.MAX_SPAN_DEPTH` or holding a lone surrogate,
named by its path), 401 without the token, 404 of type ``unknown_rollout``
for the protocol's KeyError (another 404 names the unknown method), 409 of
type ``lease`` for the protocol's LeaseError (a lease token that is not the
running attempt's; spans of an unknown or ended attempt, or conflicting with
a span held under their sequence id), 413 for a body over the limit, 500
for a failure of the store.

**Choices.** The service keeps the rules of every server of the project
(:mod:`agl_core.http.rules`). Store calls run on the event loop, where a
hop to a thread and back would cost more than their SQLite transaction or
two (spans are written at once, one transaction per upload: the clients
batch them). A long poll (:data:`WAITING_METHODS`) is tried there too, and
waits on a pool of :data:`THREADS` threads only when what it waits for is
not there yet; it is cut at :data:`LONG_POLL_S` (the client asks again until
its own deadline), so a client that died mid-poll holds a thread for seconds at
most, and a pool this size lets that many runners poll at once. A span
upload is answered once its spans are in the file, so an acknowledged span
survives a kill -9 of the service. The store counts sequence ids here for
every client and reserves them in the file in blocks
(:data:`RESERVE_SEQUENCE_IDS`), so that a restarted service never hands out
an id a client may still be uploading a span under; with spans unique by
(rollout, attempt, sequence id) in the file, a retried upload writes nothing
twice.

**Calls overtaken by their rollout's end.** A gateway admits each model call
here (``admit``: the attempt's state and the call's ids in one round trip),
answers the agent, and uploads the call's spans in the background; so the
runner's ``finish`` may arrive before the last call's spans. The service
remembers the ids it admitted and not yet received: ``finish`` waits for
them (at most :data:`SPAN_WAIT_S`; a gateway that died mid-call leaves a
rollout without that call, which then ends ``failed``, logged), unless the
attempt ``timed_out``. That
keeps one round trip per call on the agent's path, where a gateway that
flushed each call before answering paid two. Only stores reached through
this service need it: in one process the gateway writes to the reader's
store. When calls follow each other, the spans waiting for upload ride on
the next ``admit`` of the same client instead of a request of their own, and
those a runner added (an emitted reward) ride on its ``finish``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import Request

from agl_core.data import Span, Task
from agl_core.http.limits import ServerLimits
from agl_core.http.rules import (RequestError, check_authorization, error_body, error_response, health_response,
                                 parse_json_object, read_body, require_token_off_loopback, token_from)
from agl_core.http.recordable import MAX_SPAN_DEPTH
from agl_core.http.server import ServerThread, stop_on_signals
from agl_core.rollout.store import (FAILED, SUCCEEDED, TIMED_OUT, AttemptState, LeaseError, NewRollout, Store,
                                    lost_spans_error)
from agl_core.rollout.store_client import LEASE, TOKEN_ENV, UNKNOWN_ROLLOUT, Rollouts

log = logging.getLogger("agl_core.rollout.store_server")

LONG_POLL_S = 5.0
"""The longest a ``dequeue`` or ``wait`` request waits here; the client asks again until its deadline."""
THREADS = 256
"""Store calls running at once (long polls included)."""
MAX_BODY_BYTES = 64 * 2**20
BODY_TIMEOUT_S = 60.0
"""The longest a client may take to send a request's body (408 after)."""
RESERVE_SEQUENCE_IDS = 256
PREFIX = "/v1/store/"
WAITING_METHODS = {"dequeue": "wait_s", "wait": "timeout_s"}
"""Methods that may wait (long polls), and the field that says how long: they wait on the pool."""
SPAN_WAIT_S = 5.0
"""The longest ``finish`` waits for the spans of calls admitted for the attempt."""
MAX_ADMIT = 1024
SPAN_BODY_LEVELS = 2
"""Levels a request body wraps its spans in (``{"spans": [span]}``): a body may nest that much deeper than a span."""


# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _NewRollout(_Body):
    rollout_id: str
    task: Task
    sample_index: int = Field(0, ge=0)
    max_attempts: int = Field(1, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    ahead: bool = False


class _Enqueue(_Body):
    rollouts: list[_NewRollout]


class _Dequeue(_Body):
    worker_id: str
    lease_s: float = Field(gt=0, allow_inf_nan=False)
    wait_s: float = Field(0.0, ge=0, allow_inf_nan=False)


class _AttemptKey(_Body):
    rollout_id: str
    attempt_id: str


class _Heartbeat(_AttemptKey):
    lease_s: float = Field(gt=0, allow_inf_nan=False)
    lease: str | None = None


class _Cancel(_Body):
    rollout_ids: list[str] | None
    reason: str


class _Nothing(_Body):
    pass


class _RolloutKey(_Body):
    rollout_id: str


class _LeaseOf(_AttemptKey):
    lease: str | None


class _CarriesSpans(_Body):
    """A call (``admit``, ``finish``) that carries the spans waiting for upload in its client: written first."""

    spans: list[Span] = Field(default_factory=list)
    leases: list[_LeaseOf] = Field(default_factory=list)


class _Finish(_AttemptKey, _CarriesSpans):
    status: str
    final_reward: float | None = None
    error: str | None = None
    lease: str | None = None


class _Spans(_Body):
    spans: list[Span]
    leases: list[_LeaseOf] = Field(default_factory=list)


class _Admit(_AttemptKey, _CarriesSpans):
    n: int = Field(ge=1, le=MAX_ADMIT)
    lease: str | None = None


class _Wait(_Body):
    rollout_ids: list[str]
    timeout_s: float = Field(ge=0, allow_inf_nan=False)


class _Ids(_Body):
    rollout_ids: list[str]


class _Query(_Body):
    statuses: list[str] | None = None


# ---------------------------------------------------------------- methods: (store, body) -> answer


def _enqueue(store: Store, body: _Enqueue) -> dict[str, Any]:
    store.enqueue([NewRollout(r.rollout_id, r.task, r.sample_index, r.max_attempts, r.metadata, r.ahead)
                   for r in body.rollouts])
    return {}


def _dequeue(store: Store, body: _Dequeue) -> dict[str, Any]:
    attempt = store.dequeue(body.worker_id, body.lease_s, min(body.wait_s, LONG_POLL_S))
    if attempt is None:
        return {"attempt": None}
    return {"attempt": {"rollout_id": attempt.rollout_id, "attempt_id": attempt.attempt_id,
                        "task": attempt.task.model_dump(mode="json"), "sample_index": attempt.sample_index,
                        "metadata": attempt.metadata, "lease": attempt.lease}}


def _state(state: AttemptState | None) -> dict[str, Any] | None:
    return None if state is None else {"rollout_status": state.rollout_status, "current": state.current,
                                       "metadata": state.metadata}


def _admit(store: Store, body: _Admit) -> dict[str, Any]:
    state, sequence_ids = store.admit(body.rollout_id, body.attempt_id, body.n, lease=body.lease)
    return {"state": _state(state), "sequence_ids": sequence_ids}


def _add_spans(store: Store, body: _Spans) -> dict[str, Any]:
    try:
        store.add_spans(body.spans, leases={(held.rollout_id, held.attempt_id): held.lease for held in body.leases})
    except KeyError as exc:  # spans of an unknown rollout: refused as those of an unknown attempt
        raise LeaseError(str(exc.args[0]) if exc.args else "spans of an unknown rollout") from None
    store.flush()  # acknowledged once in the file: the client may then forget them
    return {"count": len(body.spans)}


def _release(store: Store, body: _Ids) -> dict[str, Any]:
    store.release(body.rollout_ids)
    return {}


def _get_rollouts(store: Store, rollout_ids: list[str]) -> bytes:
    """The answer's JSON; from the store's own JSON when it keeps its spans as JSON (agl-plugin-sqlite's does)."""
    as_json = getattr(store, "get_rollouts_json", None)
    return as_json(rollout_ids) if as_json is not None else _rollouts(store.get_rollouts(rollout_ids))


def _rollouts(rollouts: list) -> bytes:
    return Rollouts.model_construct(rollouts=rollouts).model_dump_json().encode()


METHODS: dict[str, tuple[type[_Body], Callable[[Store, Any], dict[str, Any] | bytes]]] = {
    "enqueue": (_Enqueue, _enqueue),
    "dequeue": (_Dequeue, _dequeue),
    "heartbeat": (_Heartbeat, lambda s, b: {"ok": s.heartbeat(b.rollout_id, b.attempt_id, b.lease_s,
                                                              lease=b.lease)}),
    "finish": (_Finish, lambda s, b: {"ok": s.finish(b.rollout_id, b.attempt_id, b.status, b.final_reward,
                                                     b.error, lease=b.lease)}),
    "cancel": (_Cancel, lambda s, b: {"count": s.cancel(b.rollout_ids, b.reason)}),
    "requeue_expired": (_Nothing, lambda s, b: {"count": s.requeue_expired()}),
    "attempt_state": (_AttemptKey, lambda s, b: {"state": _state(s.attempt_state(b.rollout_id, b.attempt_id))}),
    "admit": (_Admit, _admit),
    "next_sequence_id": (_RolloutKey, lambda s, b: {"sequence_id": s.next_sequence_id(b.rollout_id)}),
    "add_spans": (_Spans, _add_spans),
    "wait": (_Wait, lambda s, b: {"done": sorted(s.wait(b.rollout_ids, min(b.timeout_s, LONG_POLL_S)))}),
    "get_rollouts": (_Ids, lambda s, b: _get_rollouts(s, b.rollout_ids)),
    "query": (_Query, lambda s, b: _rollouts(s.query(b.statuses))),
    "release": (_Ids, _release),
}


def _final(method: str, body: Any, answer: dict[str, Any]) -> bool:
    """Whether a waiting method's answer without waiting is final: what it waits for is there, or it may not wait."""
    if method == "dequeue":
        return answer["attempt"] is not None or body.wait_s == 0
    return len(answer["done"]) == len(set(body.rollout_ids)) or body.timeout_s == 0


JSON_HEADERS = [(b"content-type", b"application/json")]


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str:
    return next((value.decode("latin-1") for key, value in headers if key == name), "")


def _json(answer: dict[str, Any] | bytes) -> bytes:
    return answer if isinstance(answer, bytes) else json.dumps(answer).encode()


def _refusal(method: str, exc: Exception) -> tuple[int, bytes]:
    """(status, JSON error) of a store call that failed with ``exc``."""
    if isinstance(exc, RequestError):
        return exc.status, error_body(exc.status, str(exc))
    if isinstance(exc, LeaseError):  # the protocol's "the caller does not hold this attempt"
        return 409, error_body(409, str(exc), kind=LEASE)
    if isinstance(exc, KeyError):  # the protocol's "a rollout the store does not hold"
        return 404, error_body(404, str(exc.args[0]) if exc.args else "unknown rollout", kind=UNKNOWN_ROLLOUT)
    if isinstance(exc, ValueError):  # the store refuses the request (a rollout id already queued, ...)
        return 400, error_body(400, str(exc))
    log.error("store method %s failed", method, exc_info=exc)  # the request fails alone; the service goes on
    return 500, error_body(500, f"{type(exc).__name__}: {exc}")


def _parse(method: str, model: type[_Body], raw: bytes) -> _Body:
    """The body as ``model``, or the RequestError (400) that names each field that is wrong."""
    try:
        return model.model_validate_json(raw)  # parsed and checked in one pass (a third of the time)
    except ValidationError:
        pass  # the path below says what is wrong in the words of every server of the project
    body = parse_json_object(raw, max_depth=MAX_SPAN_DEPTH + SPAN_BODY_LEVELS)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = ["{}: {}".format(".".join(map(str, err["loc"])) or "body",
                                    "unknown field" if err["type"] == "extra_forbidden" else err["msg"])
                    for err in exc.errors()]
        raise RequestError(400, f"{method}: {'; '.join(problems)}") from None


# ---------------------------------------------------------------- the service


class _AwaitedSpans:
    """Sequence ids admitted through the service whose spans have not arrived, by rollout and attempt.

    Kept on the event loop's thread only (``admit``, ``add_spans`` and
    ``finish`` run there), so it needs no lock.
    """

    def __init__(self) -> None:
        self._awaited: dict[str, dict[str, set[int]]] = {}
        self._all_arrived: dict[tuple[str, str], asyncio.Event] = {}

    def admitted(self, rollout_id: str, attempt_id: str, sequence_ids: list[int]) -> None:
        if sequence_ids:
            self._awaited.setdefault(rollout_id, {}).setdefault(attempt_id, set()).update(sequence_ids)

    def arrived(self, spans: list[Span]) -> None:
        for span in spans:
            ids = self._awaited.get(span.rollout_id, {}).get(span.attempt_id)
            if ids is not None:
                ids.discard(span.sequence_id)
                if not ids and (event := self._all_arrived.get((span.rollout_id, span.attempt_id))):
                    event.set()

    def pending(self, rollout_id: str, attempt_id: str) -> bool:
        """Whether spans of the attempt's admitted calls are still to come."""
        return bool(self._awaited.get(rollout_id, {}).get(attempt_id))

    async def wait(self, rollout_id: str, attempt_id: str, timeout_s: float) -> set[int]:
        """Wait until the attempt's awaited spans arrived (or ``timeout_s``); forget them; return those missing."""
        if self.pending(rollout_id, attempt_id) and timeout_s > 0:
            event = self._all_arrived.setdefault((rollout_id, attempt_id), asyncio.Event())
            try:
                await asyncio.wait_for(event.wait(), timeout_s)
            except TimeoutError:
                pass
            finally:
                self._all_arrived.pop((rollout_id, attempt_id), None)
        return self.forget_attempt(rollout_id, attempt_id)

    def forget_attempt(self, rollout_id: str, attempt_id: str) -> set[int]:
        """Forget the attempt's awaited spans; return them (those that never came)."""
        attempts = self._awaited.get(rollout_id, {})
        missing = attempts.pop(attempt_id, set())
        if not attempts:
            self._awaited.pop(rollout_id, None)
        return missing

    def forget(self, rollout_ids: list[str] | None) -> None:
        for rollout_id in list(self._awaited) if rollout_ids is None else rollout_ids:
            self._awaited.pop(rollout_id, None)


class StoreService:
    """The ASGI app (:attr:`app`) serving ``store``; ``token``, when set, is required of every caller.

    :meth:`close` waits for the store calls in flight; the caller closes the store.
    """

    def __init__(self, store: Store, token: str | None = None, *, max_body_bytes: int = MAX_BODY_BYTES,
                 body_timeout_s: float = BODY_TIMEOUT_S, limits: ServerLimits | None = None):
        self.store, self.token, self.max_body_bytes = store, token, max_body_bytes
        self.body_timeout_s, self.limits = body_timeout_s, limits or ServerLimits()
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="agl-store")
        self._awaited = _AwaitedSpans()
        self.app = self

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app (HTTP only: it has nothing to set up). Two routes, so no router, and no request or response
        objects on the store's route: Starlette's stack cost more than the store call."""
        if scope["type"] != "http":
            return
        path, verb = scope["path"], scope["method"]
        if path.startswith(PREFIX) and verb == "POST":
            status, content = await self._call(scope, receive, path[len(PREFIX):])
            await send({"type": "http.response.start", "status": status,
                        "headers": [*JSON_HEADERS, (b"content-length", b"%d" % len(content))]})
            await send({"type": "http.response.body", "body": content})
            return
        if path == "/healthz" and verb == "GET":
            response = health_response(Request(scope, receive), self.token,
                                       {"db": str(getattr(self.store, "path", ""))})
        else:
            response = error_response(404 if verb in ("GET", "POST") else 405, f"no route {verb} {path}")
        await response(scope, receive, send)

    async def _call(self, scope: dict[str, Any], receive: Any, method: str) -> tuple[int, bytes]:
        """(status, JSON answer) of a store method."""
        try:
            body = self._checked(method, scope["headers"], await self._read(scope, receive))
            answer = self._run_now(method, body)
            if answer is None:
                answer = await self._run_waiting(method, body)
        except Exception as exc:  # noqa: BLE001 - each kind of failure has its answer
            return _refusal(method, exc)
        return 200, _json(answer)

    def _checked(self, method: str, headers: list[tuple[bytes, bytes]], raw: bytes) -> _Body:
        """The body of a call of ``method`` by a caller that may make it; a RequestError (401, 404, 400) if not."""
        if self.token is not None:
            check_authorization(_header(headers, b"authorization"), self.token)
        if method not in METHODS:
            raise RequestError(404, f"no store method {method!r}; methods: {', '.join(METHODS)}")
        return _parse(method, METHODS[method][0], raw)

    def _run_now(self, method: str, body: Any) -> dict[str, Any] | bytes | None:
        """The answer of ``method``, run at once on the loop; None when it must wait (:meth:`_run_waiting`)."""
        run = METHODS[method][1]
        if method in WAITING_METHODS:  # tried at once; waited for on the pool if nothing is there yet
            answer = run(self.store, body.model_copy(update={WAITING_METHODS[method]: 0.0}))
            return answer if _final(method, body, answer) else None
        if isinstance(body, _CarriesSpans) and body.spans:  # spans that rode on the call: written first, come what may
            self._keep_books("add_spans", body, _add_spans(self.store, body))
        if method == "finish":  # after the spans of the calls admitted for the attempt (not for a timed-out one's)
            if body.status != TIMED_OUT and self._awaited.pending(body.rollout_id, body.attempt_id):
                return None
            self._awaited.forget_attempt(body.rollout_id, body.attempt_id)
        answer = run(self.store, body)
        self._keep_books(method, body, answer)
        return answer

    async def _run_waiting(self, method: str, body: Any) -> dict[str, Any] | bytes:
        """The answer of a call :meth:`_run_now` could not give at once: a long poll waits on the pool, a
        ``finish`` for its attempt's spans (at most :data:`SPAN_WAIT_S`)."""
        run = METHODS[method][1]
        if method in WAITING_METHODS:
            return await asyncio.get_running_loop().run_in_executor(self._pool, run, self.store, body)
        missing = await self._awaited.wait(body.rollout_id, body.attempt_id, SPAN_WAIT_S)
        if missing:
            log.warning("rollout %s attempt %s ended without the spans of calls %s, admitted %g s ago or more "
                        "(their gateway stopped?): it ends failed", body.rollout_id, body.attempt_id,
                        sorted(missing), SPAN_WAIT_S)
            if body.status == SUCCEEDED:  # trained on without those calls, it would teach what did not happen
                body = body.model_copy(update={"status": FAILED, "error": lost_spans_error(
                    len(missing), f"they did not arrive within {SPAN_WAIT_S:g} s of the attempt's end")})
        answer = run(self.store, body)
        self._keep_books(method, body, answer)
        return answer

    async def _read(self, scope: dict[str, Any], receive: Any) -> bytes:
        """The request body, within the service's size (413) and time (408) limits."""
        return await read_body(Request(scope, receive), self.max_body_bytes, "the store service's body limit",
                               self.body_timeout_s)

    def _keep_books(self, method: str, body: Any, answer: dict[str, Any] | bytes) -> None:
        """Note the calls admitted and the spans arrived; forget released or cancelled rollouts."""
        if method == "admit":
            self._awaited.admitted(body.rollout_id, body.attempt_id, answer["sequence_ids"])
        elif method == "add_spans":
            self._awaited.arrived(body.spans)
        elif method in ("release", "cancel"):
            self._awaited.forget(body.rollout_ids)

    def server(self, host: str = "127.0.0.1", port: int = 0, *, setting: str | None = None) -> ServerThread:
        """A server of this service on ``host:port``, to start."""
        return ServerThread(self.app, host, port, name="the store service", setting=setting, limits=self.limits)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def main(args) -> int:
    """``agl serve store``: serve ``args.db`` on ``args.host:args.port`` until SIGINT/SIGTERM; 0 when stopped.

    Prints the URL (one line, flushed) once the service accepts connections.
    A file that cannot be a store, an address that cannot be bound, or an
    address off loopback without a token is a ValueError (ConfigError).
    """
    try:
        from agl_plugin_sqlite import SqliteStore
    except ImportError as exc:
        raise ValueError(f"agl serve store keeps its rollouts in SQLite: pip install agl-plugin-sqlite "
                         f"({exc})") from None
    token = token_from(args.token, TOKEN_ENV)
    require_token_off_loopback("the store service", args.host, token, f"--token (or ${TOKEN_ENV})")
    store = SqliteStore(args.db, reserve_sequence_ids=RESERVE_SEQUENCE_IDS, batch_spans=False)
    stop = stop_on_signals()
    service = StoreService(store, token, limits=ServerLimits(max_connections=args.max_connections))
    try:
        server = service.server(args.host, args.port, setting="--port")
        try:
            server.start()
            print(server.url, flush=True)
            gc.freeze()  # torch came with agl_core.data: the collector need not walk its objects again
            while not stop.wait(1.0):
                pass
        finally:
            server.stop()  # lets the requests in flight finish
    finally:
        service.close()
        store.close()
    return 0
