"""The rollout store as an HTTP service: ``agl serve store --db PATH [--host H] [--port P] [--token T]``.

It serves the :class:`~agl_core.store.Store` protocol of one SQLite file
(agl-plugin-sqlite's store) to any number of trainers, gateways and runners
(:class:`agl_core.store_client.HttpStore` speaks it). It prints its URL on
stdout once it accepts connections and serves until SIGINT or SIGTERM; then
it finishes the requests in flight and closes the store (every span written).

**Wire format.** ``POST /v1/store/<method>`` with a JSON object of the
method's arguments, answered 200 with a JSON object:

====================  ============================================  ==============================
method                request                                       answer
====================  ============================================  ==============================
``enqueue``           ``rollouts: [{rollout_id, task, sample_index,  ``{}``
                      max_attempts, metadata}]``
``dequeue``           ``worker_id, lease_s, wait_s``                ``attempt: {rollout_id,
                                                                    attempt_id, task, sample_index,
                                                                    metadata} | null``
``heartbeat``         ``rollout_id, attempt_id, lease_s``           ``ok``
``finish``            ``rollout_id, attempt_id, status,             ``ok``
                      final_reward, error``
``cancel``            ``rollout_ids | null, reason``                ``count``
``requeue_expired``   ``{}``                                        ``count``
``attempt_state``     ``rollout_id, attempt_id``                    ``state: {rollout_status,
                                                                    current, metadata} | null``
``next_sequence_id``  ``rollout_id``                                ``sequence_id``
``add_spans``         ``spans: [Span]``                             ``count`` (once in the file)
``wait``              ``rollout_ids, timeout_s``                    ``done: [rollout_id]``
``get_rollouts``      ``rollout_ids``                               ``rollouts: [Rollout]``
``query``             ``statuses | null``                           ``rollouts: [Rollout]``
``release``           ``rollout_ids``                               ``{}``
====================  ============================================  ==============================

Tasks, spans and rollouts are their pydantic models as JSON. ``GET /healthz``
answers ``{"ok": true}`` (with the file's path for a caller with the token).
Errors use the format of :func:`agl_core.http_rules.error_response`: 400 for
a body that is not the method's (naming the field) or that the store refuses
(a rollout id already queued, a status that is not terminal), 401 without the
token, 404 of type ``unknown_rollout`` for the protocol's KeyError (another
404 names the unknown method), 413 for a body over the limit, 500 for a
failure of the store.

**Choices.** The service keeps the rules of every server of the project
(:mod:`agl_core.http_rules`). Store calls block (SQLite locks, long polls),
so they run on a pool of :data:`THREADS` threads, never on the event loop;
a long poll is cut at :data:`LONG_POLL_S` (the client asks again until its
own deadline), so a client that died mid-poll holds a thread for seconds at
most, and a pool this size lets that many runners poll at once. A span
upload is answered once its spans are in the file, so an acknowledged span
survives a kill -9 of the service. The store counts sequence ids here for
every client and reserves them in the file in blocks
(:data:`RESERVE_SEQUENCE_IDS`), so that a restarted service never hands out
an id a client may still be uploading a span under; with spans unique by
(rollout, attempt, sequence id) in the file, a retried upload writes nothing
twice.
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
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl_core.data import Span, Task
from agl_core.http_rules import (RequestError, check_bearer, error_response, health_response, parse_json_object,
                                 read_body, require_token_off_loopback, token_from)
from agl_core.http_server import ServerThread, stop_on_signals
from agl_core.store import NewRollout, Store
from agl_core.store_client import TOKEN_ENV, UNKNOWN_ROLLOUT, Rollouts

log = logging.getLogger("agl_core.store_server")

LONG_POLL_S = 5.0
"""The longest a ``dequeue`` or ``wait`` request waits here; the client asks again until its deadline."""
THREADS = 256
"""Store calls running at once (long polls included)."""
MAX_BODY_BYTES = 64 * 2**20
BODY_TIMEOUT_S = 60.0
RESERVE_SEQUENCE_IDS = 256


# ---------------------------------------------------------------- request bodies


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _NewRollout(_Body):
    rollout_id: str
    task: Task
    sample_index: int = Field(0, ge=0)
    max_attempts: int = Field(1, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)


class _Enqueue(_Body):
    rollouts: list[_NewRollout]


class _Dequeue(_Body):
    worker_id: str
    lease_s: float = Field(gt=0, allow_inf_nan=False)
    wait_s: float = Field(0.0, ge=0, allow_inf_nan=False)


class _Heartbeat(_Body):
    rollout_id: str
    attempt_id: str
    lease_s: float = Field(gt=0, allow_inf_nan=False)


class _Finish(_Body):
    rollout_id: str
    attempt_id: str
    status: str
    final_reward: float | None = None
    error: str | None = None


class _Cancel(_Body):
    rollout_ids: list[str] | None
    reason: str


class _Nothing(_Body):
    pass


class _AttemptKey(_Body):
    rollout_id: str
    attempt_id: str


class _RolloutKey(_Body):
    rollout_id: str


class _Spans(_Body):
    spans: list[Span]


class _Wait(_Body):
    rollout_ids: list[str]
    timeout_s: float = Field(ge=0, allow_inf_nan=False)


class _Ids(_Body):
    rollout_ids: list[str]


class _Query(_Body):
    statuses: list[str] | None = None


# ---------------------------------------------------------------- methods: (store, body) -> answer


def _enqueue(store: Store, body: _Enqueue) -> dict[str, Any]:
    store.enqueue([NewRollout(r.rollout_id, r.task, r.sample_index, r.max_attempts, r.metadata)
                   for r in body.rollouts])
    return {}


def _dequeue(store: Store, body: _Dequeue) -> dict[str, Any]:
    attempt = store.dequeue(body.worker_id, body.lease_s, min(body.wait_s, LONG_POLL_S))
    if attempt is None:
        return {"attempt": None}
    return {"attempt": {"rollout_id": attempt.rollout_id, "attempt_id": attempt.attempt_id,
                        "task": attempt.task.model_dump(mode="json"), "sample_index": attempt.sample_index,
                        "metadata": attempt.metadata}}


def _attempt_state(store: Store, body: _AttemptKey) -> dict[str, Any]:
    state = store.attempt_state(body.rollout_id, body.attempt_id)
    return {"state": None if state is None else {"rollout_status": state.rollout_status, "current": state.current,
                                                 "metadata": state.metadata}}


def _add_spans(store: Store, body: _Spans) -> dict[str, Any]:
    store.add_spans(body.spans)
    store.flush()  # acknowledged once in the file: the client may then forget them
    return {"count": len(body.spans)}


def _release(store: Store, body: _Ids) -> dict[str, Any]:
    store.release(body.rollout_ids)
    return {}


def _rollouts(rollouts: list) -> bytes:
    return Rollouts.model_construct(rollouts=rollouts).model_dump_json().encode()


METHODS: dict[str, tuple[type[_Body], Callable[[Store, Any], dict[str, Any] | bytes]]] = {
    "enqueue": (_Enqueue, _enqueue),
    "dequeue": (_Dequeue, _dequeue),
    "heartbeat": (_Heartbeat, lambda s, b: {"ok": s.heartbeat(b.rollout_id, b.attempt_id, b.lease_s)}),
    "finish": (_Finish, lambda s, b: {"ok": s.finish(b.rollout_id, b.attempt_id, b.status, b.final_reward,
                                                     b.error)}),
    "cancel": (_Cancel, lambda s, b: {"count": s.cancel(b.rollout_ids, b.reason)}),
    "requeue_expired": (_Nothing, lambda s, b: {"count": s.requeue_expired()}),
    "attempt_state": (_AttemptKey, _attempt_state),
    "next_sequence_id": (_RolloutKey, lambda s, b: {"sequence_id": s.next_sequence_id(b.rollout_id)}),
    "add_spans": (_Spans, _add_spans),
    "wait": (_Wait, lambda s, b: {"done": sorted(s.wait(b.rollout_ids, min(b.timeout_s, LONG_POLL_S)))}),
    "get_rollouts": (_Ids, lambda s, b: _rollouts(s.get_rollouts(b.rollout_ids))),
    "query": (_Query, lambda s, b: _rollouts(s.query(b.statuses))),
    "release": (_Ids, _release),
}


def _parse(method: str, model: type[_Body], raw: bytes) -> _Body:
    """The body as ``model``, or the RequestError (400) that names each field that is wrong."""
    body = parse_json_object(raw)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = ["{}: {}".format(".".join(map(str, err["loc"])) or "body",
                                    "unknown field" if err["type"] == "extra_forbidden" else err["msg"])
                    for err in exc.errors()]
        raise RequestError(400, f"{method}: {'; '.join(problems)}") from None


# ---------------------------------------------------------------- the service


class StoreService:
    """The ASGI app (:attr:`app`) serving ``store``; ``token``, when set, is required of every caller.

    :meth:`close` waits for the store calls in flight; the caller closes the store.
    """

    def __init__(self, store: Store, token: str | None = None, *, max_body_bytes: int = MAX_BODY_BYTES):
        self.store, self.token, self.max_body_bytes = store, token, max_body_bytes
        self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="agl-store")
        self.app = Starlette(routes=[Route("/v1/store/{method}", self._call, methods=["POST"]),
                                     Route("/healthz", self._health, methods=["GET"])])

    async def _health(self, request: Request) -> Response:
        return health_response(request, self.token, {"db": str(getattr(self.store, "path", ""))})

    async def _call(self, request: Request) -> Response:
        method = request.path_params["method"]
        try:
            check_bearer(request, self.token)
            if method not in METHODS:
                raise RequestError(404, f"no store method {method!r}; methods: {', '.join(METHODS)}")
            model, run = METHODS[method]
            body = _parse(method, model, await read_body(request, self.max_body_bytes, "the store service's "
                                                         "body limit", BODY_TIMEOUT_S))
            answer = await asyncio.get_running_loop().run_in_executor(self._pool, run, self.store, body)
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        except KeyError as exc:  # the protocol's "a rollout the store does not hold"
            message = str(exc.args[0]) if exc.args else "unknown rollout"
            return JSONResponse({"error": {"message": message, "type": UNKNOWN_ROLLOUT, "code": 404}}, 404)
        except ValueError as exc:  # the store refuses the request (a rollout id already queued, ...)
            return error_response(400, str(exc))
        except Exception as exc:  # noqa: BLE001 - the request fails alone; the service goes on
            log.exception("store method %s failed", method)
            return error_response(500, f"{type(exc).__name__}: {exc}")
        content = answer if isinstance(answer, bytes) else json.dumps(answer).encode()
        return Response(content, media_type="application/json")

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
    store = SqliteStore(args.db, reserve_sequence_ids=RESERVE_SEQUENCE_IDS)
    stop = stop_on_signals()
    service = StoreService(store, token)
    try:
        server = ServerThread(service.app, args.host, args.port, name="the store service", setting="--port")
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
