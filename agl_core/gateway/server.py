"""The gateway: an OpenAI-compatible HTTP front for the policy servers that records every call as a span.

Agents call ``{gateway}/rollout/{rollout_id}/attempt/{attempt_id}/lease/{lease}/v1``
as their base URL (the runner gives them it: the lease token is the
attempt's, from the store's ``dequeue``, so an agent's calls are recorded for
its own attempt only) (``POST .../chat/completions`` and ``POST .../completions``).
For each call the gateway checks the request, forwards it to the policy server
pinned to the rollout with token ids and log-probs asked for, writes one
``llm_call`` span per choice to the store, and returns the server's answer
unchanged. A request refused with a 4xx writes nothing.

Whoever runs the policy sets, each step, the servers to forward to, the
weight version of the spans, default sampling and the seed of the run: as
attributes in the trainer's process, or with ``PUT /v1/admin/policy`` on a
gateway served alone (:mod:`agl_core.gateway.service`): the admin token
(``rollout.gateway.admin_token``) is required, never the agents' token. A
gateway with neither token (loopback only) takes anyone's; one with an
agents' token and no admin token refuses every admin call (403).

It keeps the rules of every server of the project (:mod:`agl_core.http.rules`):
a token off loopback, bounded bodies, sampling parameters checked at the door
(``n`` at most ``max_n``), a 400 naming the field for anything else, and for
what no store could record (JSON nested deeper than
:data:`~agl_core.http.recordable.MAX_REQUEST_DEPTH` levels or holding a lone
surrogate, anywhere in the body), on every route. The
``model`` an agent names is forwarded as it is: the policy server decides
(the embedded backend serves any name, vLLM refuses names it does not serve).
In a run of several policies (the recipe's ``policies``) a call goes to the
policy its client's role (``…/role/<name>/v1``, ``llm.for_role``) or its
``model`` names, sent upstream as ``model``; a call naming none is a 404
naming the policies (:mod:`agl_core.policies`). Every span records its
``policy`` (None in a run of one).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router

from agl_core.config import GatewayConfig
from agl_core.data import Span
from agl_core.gateway.api_routes import TranslatedApis
from agl_core.gateway.capture import CHAT, COMPLETIONS, Captured, ask_for_tokens, capture, without_token_fields
from agl_core.gateway.client import ADMIN_POLICY, ADMIN_TOKEN_ENV, TOKEN_ENV
from agl_core.gateway.contexts import ChatChunks, ExactContexts, Plan, as_asked, chat_answer, completion_request
from agl_core.gateway.streaming import (EVENT_STREAM, CallStream, EventStreamResponse, check_stream_fields,
                                       chunks_of, dumps, include_usage, one_batch, sse_batches)
from agl_core.gateway.tools import check_tools
from agl_core.gateway.upstream import (Forwarded, Opened, Upstreams, open_with_retries, post_with_retries,
                                      read_whole, upstream_session)
from agl_core.gateway.weight_sync import CallGate
from agl_core.http.rules import (INT64_MAX, RequestError, check_bearer, check_sampling, error_response,
                                 health_response, integer, parse_json_object, policy_token, read_body,
                                 require_token_off_loopback, token_from)
from agl_core.http.limits import ServerLimits
from agl_core.http import recordable
from agl_core.http.recordable import NotRecordable
from agl_core.http.server import ServerThread
from agl_core.policies import route
from agl_core.rollout.store import AttemptState, LeaseError, Store

log = logging.getLogger("agl_core.gateway")
PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}/lease/{lease}/v1"
ROLE_PREFIX = "/rollout/{rollout_id}/attempt/{attempt_id}/lease/{lease}/role/{role}/v1"
"""The routes of a client made for one role (``llm.for_role``): each call is that role's policy's (agl_core.policies)."""


@dataclass(frozen=True)
class Answer:
    """The policy server's answer to a recorded call: its ``status``, ``response`` parsed, ``raw`` as it came."""

    status: int
    response: dict[str, Any]
    raw: bytes


class CallFailed(RequestError):
    """A call the policy server gave no usable answer to (its span is recorded as errored).

    ``raw`` is the policy server's own error body when it answered one (a
    4xx/5xx after retries), else None.
    """

    def __init__(self, status: int, message: str, raw: bytes | None = None):
        super().__init__(status, message)
        self.raw = raw


class Gateway:
    """The gateway of one run: an ASGI app over ``store`` and the policy servers in ``upstreams``.

    ``sampling`` holds the parameters added to calls that do not set them.
    With ``seed`` set, a call that sets no ``seed`` gets :func:`call_seed`
    of its place in the run. Every span records the ``weight_version`` of
    the weights that answered: the one the policy server reports in its
    answer (a field vLLM does not have), else the gateway's
    ``weight_version``, which the runner sets. :meth:`serve` runs it on a
    background thread.

    Each call costs the store one ``admit`` before it goes upstream; its spans
    are added after (a store service's client uploads them in the background,
    and the service makes the rollout's ``finish`` wait for the spans of the
    calls it admitted: :mod:`agl_core.rollout.store_server`).
    """

    def __init__(self, store: Store, config: GatewayConfig | None = None,
                 sampling: dict[str, Any] | None = None, upstreams: list[str] = (), seed: int | None = None,
                 policies: list[str] = ()):
        self.store = store
        self.policies = list(policies)  # the run's policy names (agl_core.policies.route); empty: one policy
        self._admit_on_loop = getattr(store, "admits_at_once", False)  # see _admitted
        self.config = config or GatewayConfig()
        self.token = token_from(self.config.token, TOKEN_ENV)
        self.admin_token = token_from(self.config.admin_token, ADMIN_TOKEN_ENV)
        require_token_off_loopback("the gateway", self.config.host, self.token,
                                   f"rollout.gateway.token (or ${TOKEN_ENV})")
        self.upstream_token = policy_token(self.config.upstream_token)
        self.sampling = {k: v for k, v in (sampling or {}).items() if v is not None}
        self.upstreams = Upstreams(list(upstreams))
        self.seed = seed
        self.weight_version: int | None = None
        self.calls = CallGate()  # paused around weight syncs
        self._store_failed = False  # logged once: every later call would say the same
        self._upstream_client: aiohttp.ClientSession | None = None
        self.contexts = ExactContexts.for_gateway(
            self.config.tokenizer, {"Authorization": f"Bearer {self.upstream_token}"} if self.upstream_token else None,
            self.config.upstream_timeout_s) if self.config.exact_contexts else None
        self.translated = TranslatedApis(self)  # /v1/messages and /v1/responses, over self.call
        # Starlette's router alone: its app would wrap each call in two middlewares whose work (a 500 for an
        # exception, a 404/405 answer) uvicorn and the router do the same, at a third of the routing's cost.
        self.app = Router(
            routes=[api_route
                    for prefix in (PREFIX, ROLE_PREFIX)
                    for api_route in (Route(f"{prefix}/chat/completions", self._chat, methods=["POST"]),
                                  Route(f"{prefix}/completions", self._completions, methods=["POST"]),
                                  Route(f"{prefix}/messages", self.translated.messages, methods=["POST"]),
                                  Route(f"{prefix}/responses", self.translated.responses, methods=["POST"]))] + [
                    Route(ADMIN_POLICY, self._set_policy, methods=["PUT"]),
                    Route("/healthz", self._health, methods=["GET"])],
            lifespan=self._lifespan)

    def serve(self) -> ServerThread:
        """Start serving on ``config.host:config.port``; the returned server knows its URL."""
        return ServerThread(self.app, self.config.host, self.config.port, name="agl-gateway",
                            setting="rollout.gateway.port",
                            limits=ServerLimits(max_connections=self.config.max_connections)).start()

    @staticmethod
    def base_url(server_url: str, rollout_id: str, attempt_id: str, lease: str, role: str | None = None) -> str:
        """The OpenAI base URL an agent uses for one attempt of one rollout, leased under ``lease`` (for one
        ``role``'s calls, when given)."""
        attempt = f"{server_url}/rollout/{rollout_id}/attempt/{attempt_id}/lease/{lease}"
        return f"{attempt}/v1" if role is None else f"{attempt}/role/{role}/v1"

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any):
        headers = {"Authorization": f"Bearer {self.upstream_token}"} if self.upstream_token else None
        self._upstream_client = upstream_session(self.config.upstream_timeout_s, self.config.max_connections,
                                                 headers)
        try:
            yield
        finally:
            await self._upstream_client.close()
            self._upstream_client = None

    # ------------------------------------------------------------ endpoints

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, CHAT)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, COMPLETIONS)

    async def _health(self, request: Request) -> Response:
        return health_response(request, self.token, {"upstreams": list(self.upstreams.urls)})

    async def _set_policy(self, request: Request) -> Response:
        """Set what the body names of ``urls``, ``weight_version``, ``sampling``, ``seed``; answer the policy now."""
        try:
            self._check_admin(request)
            body = parse_json_object(await read_body(request, self.config.max_body_bytes,
                                                     "rollout.gateway.max_body_bytes", self.config.body_timeout_s))
            policy = parse_policy(body, self.config.max_n)
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        if "urls" in policy:
            self.upstreams.set(policy["urls"])
        if "weight_version" in policy:
            self.weight_version = policy["weight_version"]
        if "sampling" in policy:
            self.sampling = {k: v for k, v in policy["sampling"].items() if v is not None}
        if "seed" in policy:
            self.seed = policy["seed"]
        return JSONResponse({"urls": list(self.upstreams.urls), "weight_version": self.weight_version,
                             "sampling": self.sampling, "seed": self.seed})

    def _check_admin(self, request: Request) -> None:
        """RequestError unless the caller may use the admin routes: the admin token when the gateway has one;
        anyone when it has no token at all (loopback only); nobody when only agents have a token."""
        if self.admin_token is not None:
            check_bearer(request, self.admin_token)
        elif self.token is not None:
            raise RequestError(403, f"the admin routes need the gateway's admin token, which is not set "
                                    f"(rollout.gateway.admin_token or ${ADMIN_TOKEN_ENV}); the agents' token "
                                    f"cannot call them")

    async def _handle(self, request: Request, endpoint: str) -> Response:
        rollout_id, attempt_id, lease = (request.path_params[key] for key in ("rollout_id", "attempt_id", "lease"))
        try:
            check_bearer(request, self.token)
            body = parse_json_object(await read_body(request, self.config.max_body_bytes,
                                                     "rollout.gateway.max_body_bytes",
                                                     self.config.body_timeout_s))
            role = request.path_params.get("role")
            if body.get("stream"):
                return EventStreamResponse(await self.open_stream(rollout_id, attempt_id, endpoint, body, role,
                                                                  lease=lease))
            answer = await self.call(rollout_id, attempt_id, endpoint, body, role, lease=lease)
        except CallFailed as exc:
            if exc.raw is not None:  # the policy server's own error answer, passed on as it came
                return Response(exc.raw, exc.status, media_type="application/json")
            return error_response(exc.status, str(exc))
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        return Response(answer.raw, answer.status, media_type="application/json")

    # ------------------------------------------------------------ the call

    async def call(self, rollout_id: str, attempt_id: str, endpoint: str, body: dict[str, Any],
                   role: str | None = None, *, lease: str | None = None) -> Answer:
        """Perform one model call of a running attempt and record its span(s): the entry point of every API.

        ``endpoint`` is :data:`CHAT` or :data:`COMPLETIONS`; ``body`` the
        OpenAI request of that endpoint as a dict (``stream`` is ignored: the
        call is made whole); ``lease`` the attempt's lease token. It is checked here (:meth:`check_request`), the
        attempt admitted, the request forwarded to the rollout's policy server
        with token ids and log-probs asked for (and the gateway's default
        sampling and call seed added), and one ``llm_call`` span per choice
        written to the store: the same spans whatever API the agent used.

        Returns the policy server's OpenAI-shaped :class:`Answer` (its token
        fields included). Raises :class:`RequestError` when the call is
        refused, with nothing written: 400 naming a bad field, 404 unknown
        rollout, 409 attempt not running or leased under another token; 502
        when the policy server's answer cannot be recorded; or 503 when the
        store cannot record it. Raises :class:`CallFailed` when the policy server gave no usable
        answer (its status, or 502/503/504); an errored span is written.
        Translations of other APIs (Anthropic Messages, OpenAI Responses) call
        this with the chat request they translate to and turn the answer or
        the error into their own shapes.

        In a run of several policies the call goes to the policy its client's
        ``role`` names, else the one its ``model`` names (sent upstream as the
        ``model``), and every span records it as ``policy``; a call naming none
        is refused with 404 naming the policies (:func:`agl_core.policies.route`).
        """
        body, policy = self._routed(body, role)
        self.check_request(endpoint, body)
        state, sequence_ids = await self._admitted(rollout_id, attempt_id, body.get("n") or 1, lease)
        plan = await self._plan(rollout_id, attempt_id, endpoint, body)
        # A weight sync holds new calls here and lets those in flight finish first (weight_sync.CallGate), so
        # the version read at admission is the one that serves the call, whenever its span is written.
        async with self.calls.admitted():
            start, weight_version = time.time(), self.weight_version
            upstream = self.upstreams.pick(rollout_id)
            converted = None  # the token path's answer, parsed and made a chat answer
            if upstream is None:
                forwarded = Forwarded(503, b"", 0, "the gateway has no policy server to forward to")
            else:
                url, upstream_body = self._forwarded_request(upstream, endpoint, body, plan, state, rollout_id,
                                                             attempt_id, sequence_ids[0])
                forwarded, converted = _as_chat(await post_with_retries(
                    self._upstream_client, url, recordable.dumps(upstream_body), self.config.max_retries,
                    self.config.retry_backoff_s, self.config.max_upstream_bytes), plan, body)
        common = self._span_attributes(endpoint, upstream, forwarded.status, forwarded.tries, state, weight_version,
                                       plan, policy)
        spans, response = _spans(rollout_id, attempt_id, sequence_ids, endpoint, body, forwarded, common,
                                 start, time.time(), converted)
        self._record(rollout_id, attempt_id, lease, spans)
        if plan is not None and forwarded.error is None and forwarded.status < 400:
            self.contexts.remember_later((rollout_id, attempt_id), plan, body, response)
        if forwarded.error is not None:
            raise CallFailed(forwarded.status, forwarded.error)
        if forwarded.status >= 400:
            raise CallFailed(forwarded.status, f"the policy server answered {forwarded.status}", forwarded.body)
        if response is None:
            raise CallFailed(502, spans[0].attributes["error"])
        return Answer(forwarded.status, response, forwarded.body)

    async def open_stream(self, rollout_id: str, attempt_id: str, endpoint: str,
                          body: dict[str, Any], role: str | None = None, *, lease: str | None = None) -> CallStream:
        """Start one streamed model call of a running attempt: :meth:`call`'s streamed twin.

        Checked, admitted and forwarded as :meth:`call` does (with
        ``stream: true`` upstream), and refused or failed with the same
        errors, raised before any chunk: nothing is sent to the agent yet.
        Returns the :class:`~agl_core.gateway.streaming.CallStream` of the
        upstream's chunks (OpenAI ``chat.completion.chunk`` or
        ``text_completion`` objects). Where the upstream streams (vLLM, the
        embedded backend, the test endpoint) each chunk is relayed as it comes,
        token ids included; where it answered the stream request whole, its
        answer is cut into chunks (:func:`~agl_core.gateway.streaming.chunks_of`).

        The caller iterates the stream, then must ``await stream.close()``
        (in a ``finally``): that records the call's span(s), assembled from
        the chunks by the same code as a non-streamed answer (identical token
        ids and log-probs), and holds the call in the weight-sync gate until
        then. A stream closed before its end (the agent went away) is
        recorded with ``attributes["incomplete"] = True``: counted, never
        trained on. ``stream.record_error`` says when the store could not
        record it. The call is routed to its policy as :meth:`call` routes it.
        """
        body, policy = self._routed(body, role)
        self.check_request(endpoint, body)
        state, sequence_ids = await self._admitted(rollout_id, attempt_id, body.get("n") or 1, lease)
        plan = await self._plan(rollout_id, attempt_id, endpoint, body)
        held = contextlib.AsyncExitStack()
        await held.enter_async_context(self.calls.admitted())
        start, weight_version = time.time(), self.weight_version
        upstream = self.upstreams.pick(rollout_id)
        exact = plan is not None and plan.exact
        converted = None
        try:
            if upstream is None:
                opened: Opened | Forwarded = Forwarded(503, b"", 0, "the gateway has no policy server to forward to")
            else:
                url, upstream_body = self._forwarded_request(upstream, endpoint, body, plan, state, rollout_id,
                                                             attempt_id, sequence_ids[0])
                upstream_body["stream"] = True
                if exact and include_usage(body):  # the token path's completions request has no stream options
                    upstream_body["stream_options"] = {"include_usage": True}
                opened = await open_with_retries(self._upstream_client, url, recordable.dumps(upstream_body),
                                                 self.config.max_retries, self.config.retry_backoff_s,
                                                 self.config.max_upstream_bytes)
            if isinstance(opened, Opened) and opened.response.content_type != EVENT_STREAM:
                # The upstream answered the stream request whole: read it; it is streamed back in chunks.
                opened = await read_whole(opened, url)
        except BaseException:
            await held.aclose()
            raise
        if isinstance(opened, Forwarded) and exact:
            opened, converted = _as_chat(opened, plan, body)
        if isinstance(opened, Forwarded):
            await held.aclose()  # the whole answer is in: no weight sync can change it any more
            status, tries = opened.status, opened.tries
            response, error = (converted, None) if converted is not None else _parsed(opened)
            if error is not None:
                common = self._span_attributes(endpoint, upstream, status, tries, state, weight_version, plan,
                                               policy)
                spans = _answer_spans(rollout_id, attempt_id, sequence_ids, endpoint, body, response, error, common,
                                      start, time.time())
                self._record(rollout_id, attempt_id, lease, spans)
                raise CallFailed(status, error, opened.body if opened.error is None and status >= 400 else None)
            batches = one_batch([dumps(chunk) for chunk in chunks_of(endpoint, response, include_usage(body))])
            release = None
        else:
            status, tries = opened.response.status, opened.tries
            batches, release = sse_batches(opened.response), opened.response.release
            if exact:  # the token path's completions chunks, relayed as the chat chunks the agent asked for
                batches = ChatChunks(plan).batches(batches)
        common = self._span_attributes(endpoint, upstream, status, tries, state, weight_version, plan, policy)

        async def on_close(stream: CallStream) -> None:
            await held.aclose()
            response = stream.assembly.response() if stream.assembly.chunks else None
            error = stream.error or (None if response is not None else "the policy server's stream had no chunk")
            spans = _answer_spans(rollout_id, attempt_id, sequence_ids, endpoint, body, response, error, common,
                                  start, time.time())
            if not stream.ended and stream.error is None:  # the agent stopped reading: not a whole answer
                for span in spans:
                    span.attributes["incomplete"] = True
            try:
                self._record(rollout_id, attempt_id, lease, spans)
            except RequestError as exc:
                stream.record_error = str(exc)
            else:
                if plan is not None and error is None and stream.ended:
                    self.contexts.remember_later((rollout_id, attempt_id), plan, body, response)

        return CallStream(endpoint, batches, on_close, release)

    def _span_attributes(self, endpoint: str, upstream: str | None, status: int, tries: int,
                         state: AttemptState, weight_version: int | None, plan: Plan | None,
                         policy: str | None) -> dict[str, Any]:
        attributes = {"endpoint": endpoint, "upstream": upstream, "status_code": status, "upstream_tries": tries,
                      "weight_version": weight_version, "agent_name": state.metadata.get("agent_name"),
                      "policy": policy}
        return attributes if plan is None else {**attributes, **plan.attributes()}

    def _routed(self, body: dict[str, Any], role: str | None) -> tuple[dict[str, Any], str | None]:
        """``body`` naming its policy as ``model``, and the policy (None in a run of one policy); 404 for none."""
        policy = route(self.policies, body.get("model"), role)
        if policy is None or body.get("model") == policy:
            return body, policy
        return {**body, "model": policy}, policy

    async def _plan(self, rollout_id: str, attempt_id: str, endpoint: str, body: dict[str, Any]) -> Plan | None:
        """How a chat call goes upstream, as text or as its exact context (:mod:`agl_core.gateway.contexts`);
        None when exact contexts are off or the call is not a chat call."""
        if self.contexts is None or endpoint != CHAT:
            return None
        self.translated.start_sweeper()  # drops the contexts of ended attempts
        return await self.contexts.plan((rollout_id, attempt_id), body, self.upstreams.pick(rollout_id))

    def _forwarded_request(self, upstream: str, endpoint: str, body: dict[str, Any], plan: Plan | None,
                           state: AttemptState, rollout_id: str, attempt_id: str,
                           sequence_id: int) -> tuple[str, dict[str, Any]]:
        """The URL and body that go upstream: the agent's request, or the completions call of its exact context."""
        if plan is not None and plan.exact:
            endpoint, body = COMPLETIONS, completion_request(body, plan.prompt_ids)
        return (f"{upstream}/{endpoint.replace('.', '/')}",
                self._upstream_body(endpoint, body, state, rollout_id, attempt_id, sequence_id))

    # ------------------------------------------------------------ checks

    def check_request(self, endpoint: str, body: dict[str, Any]) -> None:
        """RequestError 400 naming what is wrong with an OpenAI request ``body`` of ``endpoint``."""
        if endpoint == CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise RequestError(400, "'messages' must be a non-empty list of message objects")
            check_tools(body)
        elif not isinstance(body.get("prompt"), str):
            raise RequestError(400, "'prompt' must be a string (token-id and batched prompts are not supported)")
        check_sampling(body, max_n=self.config.max_n, logprobs_key="top_logprobs" if endpoint == CHAT else "logprobs")
        check_stream_fields(body)

    async def _admitted(self, rollout_id: str, attempt_id: str, n: int,
                        lease: str | None) -> tuple[AttemptState, list[int]]:
        """:meth:`_admit` on the event loop for a store that ``admits_at_once`` (the memory store), else on a
        worker thread.

        Another store's admission may block (a SQLite lock held by a writer, a
        store service's round trip): off the event loop. The memory store's is a
        lock held only for dict updates: the thread hop (two wake-ups, tens of µs,
        more on busy cores) would cost more than it, on every call's first-token path.
        """
        if self._admit_on_loop:
            return self._admit(rollout_id, attempt_id, n, lease)
        return await asyncio.to_thread(self._admit, rollout_id, attempt_id, n, lease)

    def _admit(self, rollout_id: str, attempt_id: str, n: int, lease: str | None) -> tuple[AttemptState, list[int]]:
        """The running attempt's state and a sequence id per choice; RequestError when the attempt is not running
        or is leased under another token."""
        try:
            state, sequence_ids = self.store.admit(rollout_id, attempt_id, n, lease=lease)
        except KeyError:  # released between the check and the ids: it ended meanwhile
            raise RequestError(409, f"rollout {rollout_id!r} ended; its calls are not recorded") from None
        except LeaseError as exc:
            raise RequestError(409, f"{exc}; this base URL is not the attempt's") from None
        if state is None:
            raise RequestError(404, f"unknown rollout {rollout_id!r}")
        if not state.current:
            raise RequestError(409, f"attempt {attempt_id!r} of rollout {rollout_id!r} is not running "
                                    f"(the rollout is {state.rollout_status}); its calls are not recorded")
        return state, sequence_ids

    def _record(self, rollout_id: str, attempt_id: str, lease: str | None, spans: list[Span]) -> None:
        """Write the call's spans; RequestError 502 when the policy server's answer cannot be recorded (the
        request was checked at the door), 503 when the store cannot write (the agent must not train blind).

        Called on the event loop: ``add_spans`` only queues (the SQLite store's writer, the store client's
        uploader) or appends in memory, so a hop to a thread would cost more than the call; it blocks only
        when its queue is full, and then every call should wait.
        """
        try:
            self.store.add_spans(spans, leases={(rollout_id, attempt_id): lease})
        except (KeyError, LeaseError) as exc:  # the attempt ended (timed out) and was consumed while in flight
            log.info("rollout %s attempt %s ended before its call returned; the call is not recorded (%s)",
                     rollout_id, attempt_id, exc)
        except NotRecordable as exc:
            raise RequestError(502, f"the policy server's answer cannot be recorded: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a store that cannot write fails the call, not the gateway
            if not self._store_failed:
                self._store_failed = True
                log.error("the store cannot record model calls: %s", exc)
            raise RequestError(503, f"the gateway cannot record this call: {exc}") from None

    def _upstream_body(self, endpoint: str, body: dict[str, Any], state: AttemptState, rollout_id: str,
                       attempt_id: str, sequence_id: int) -> dict[str, Any]:
        """What goes upstream: ``body`` asking for token ids, with the default sampling and the call seed added."""
        out = ask_for_tokens(endpoint, body)
        for key, value in self.sampling.items():
            if key == "max_tokens" and "max_completion_tokens" in out:
                continue
            out.setdefault(key, value)
        if self.seed is not None:
            out.setdefault("seed", call_seed(self.seed, state.metadata, rollout_id, attempt_id, sequence_id))
        return out


def parse_policy(body: dict[str, Any], max_n: int) -> dict[str, Any]:
    """The fields of a ``PUT /v1/admin/policy`` body, checked; RequestError 400 naming the first bad one.

    ``urls``: the policy servers' base URLs (``http(s)://…/v1``);
    ``weight_version`` and ``seed``: an int >= 0 or null; ``sampling``: an
    object of sampling parameters (null values are dropped). Absent fields
    leave the gateway's setting as it is.
    """
    unknown = sorted(set(body) - {"urls", "weight_version", "sampling", "seed"})
    if unknown:
        raise RequestError(400, f"unknown field(s) {', '.join(map(repr, unknown))}; "
                                f"allowed: 'urls', 'weight_version', 'sampling', 'seed'")
    if "urls" in body:
        if not isinstance(body["urls"], list):
            raise RequestError(400, f"'urls' must be a list of URLs, got {type(body['urls']).__name__}")
        for index, url in enumerate(body["urls"]):
            if not (isinstance(url, str) and url.startswith(("http://", "https://"))):
                raise RequestError(400, f"'urls'[{index}] must be an http:// or https:// URL, got {url!r:.80}")
    for key in ("weight_version", "seed"):
        if body.get(key) is not None:
            integer(key, body[key], low=0, high=INT64_MAX)
    if "sampling" in body:
        if not isinstance(body["sampling"], dict):
            raise RequestError(400, f"'sampling' must be an object, got {type(body['sampling']).__name__}")
        check_sampling(body["sampling"], max_n=max_n)
    return body


def call_seed(run_seed: int, metadata: dict[str, Any], rollout_id: str, attempt_id: str, sequence_id: int) -> int:
    """A seed for one model call from the run's seed and the call's place in the run (a 63-bit int).

    The place is the rollout's mode, step, task id and sample index (from
    its metadata, which the runner writes; the rollout id when they are
    missing), the attempt and the call's sequence id: the same in a run and
    in its repetition, whatever the order in which concurrent calls arrive.
    """
    keys = ("mode", "step", "task_id", "sample_index")
    place = [metadata[key] for key in keys] if all(key in metadata for key in keys) else [rollout_id]
    text = json.dumps([run_seed, *place, attempt_id, sequence_id])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def _spans(rollout_id: str, attempt_id: str, sequence_ids: list[int], endpoint: str, request: dict[str, Any],
           forwarded: Forwarded, attributes: dict[str, Any], start: float, end: float,
           parsed: dict[str, Any] | None = None) -> tuple[list[Span], dict[str, Any] | None]:
    """One span per choice of a successful answer, one errored span otherwise; and the answer parsed (None if not JSON).

    What is stored grows linearly with ``n``: the request is stored once, on
    the first span (the others point at it with ``request_sequence_id``), and
    each choice's span holds the answer with its own choice only. Every span
    keeps its prompt token ids: each choice is a row a trace aggregator trains on. ``parsed``: the answer when it
    is already parsed.
    """
    response, error = (parsed, None) if parsed is not None else _parsed(forwarded)
    return _answer_spans(rollout_id, attempt_id, sequence_ids, endpoint, request, response, error, attributes,
                         start, end), response


def _as_chat(forwarded: Forwarded, plan: Plan | None,
             request: dict[str, Any]) -> tuple[Forwarded, dict[str, Any] | None]:
    """The token path's completions answer as the chat answer the agent asked for (its body: the token fields
    only when ``request`` asked for them), and that answer whole (None: any other answer, as it came)."""
    if plan is None or not plan.exact or forwarded.error is not None or forwarded.status >= 400:
        return forwarded, None
    try:
        response, plain = recordable.loads(forwarded.body)
    except ValueError:
        return forwarded, None  # not JSON: recorded and refused as any such answer
    if not isinstance(response, dict):
        return forwarded, None
    chat = chat_answer(response, plan)
    return Forwarded(forwarded.status, recordable.dumps(as_asked(chat, request), plain), forwarded.tries), chat


def _parsed(forwarded: Forwarded) -> tuple[Any, str | None]:
    """The upstream's answer parsed, and the error that makes it unusable (None when it is a JSON success)."""
    response: Any = None
    error = forwarded.error
    if error is None:
        try:
            response, _ = recordable.loads(forwarded.body)
        except ValueError:
            error = f"the policy server answered {forwarded.status} with a body that is not JSON"
    if error is None and forwarded.status >= 400:
        error = f"the policy server answered {forwarded.status}"
    return response, error


def _answer_spans(rollout_id: str, attempt_id: str, sequence_ids: list[int], endpoint: str, request: dict[str, Any],
                  response: Any, error: str | None, attributes: dict[str, Any], start: float,
                  end: float) -> list[Span]:
    """The spans of a call whose answer is ``response`` (parsed), or that failed with ``error`` (see :func:`_spans`)."""
    captured: list[Captured] = []
    if error is None:
        captured = capture(endpoint, response)
        if not captured:
            error = "the policy server's answer has no choices"
        elif isinstance(response.get("weight_version"), int):
            attributes = {**attributes, "weight_version": response["weight_version"]}
    if error is not None:
        attrs = {**attributes, "request": request, "response": response, "error": error}
        return [Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_ids[0], kind="llm_call",
                     attributes=attrs, start_time=start, end_time=end)]
    spans = []
    recorded = without_token_fields(response)
    choices = recorded.get("choices") or []
    for index, (sequence_id, choice) in enumerate(zip(sequence_ids, captured)):
        own = {**recorded, "choices": choices[index:index + 1]}
        asked = {"request": request} if index == 0 else {"request_sequence_id": sequence_ids[0]}
        attrs = {**attributes, **asked, "response": own, "choice_index": index}
        if choice.error is not None:
            attrs["error"] = choice.error
        spans.append(Span(rollout_id=rollout_id, attempt_id=attempt_id, sequence_id=sequence_id, kind="llm_call",
                          prompt_token_ids=choice.prompt_token_ids, response_token_ids=choice.response_token_ids,
                          response_logprobs=choice.response_logprobs, attributes=attrs,
                          start_time=start, end_time=end))
    return spans
