"""The gateway's routes for the APIs it translates to chat: Anthropic's ``/v1/messages``, OpenAI's ``/v1/responses``.

Each route reads the body (the gateway's token and body limits), translates
it to a chat request (:mod:`agl_core.gateway.anthropic`,
:mod:`agl_core.gateway.responses`), makes the call through
:meth:`Gateway.call <agl_core.gateway.server.Gateway.call>` (the checks,
admission, forwarding and spans of every chat call: a trace aggregator sees
the same spans whatever API the agent used), and answers in the API's own
shape, errors included. A streamed request is a streamed chat call
(:meth:`Gateway.open_stream <agl_core.gateway.server.Gateway.open_stream>`)
whose chunks are relayed as the API's events as they arrive
(:class:`TranslatedEventStream`); its span is the streamed chat call's, marked
incomplete when the agent disconnects before the end.

The responses of each running attempt are kept for ``previous_response_id``
(:class:`~agl_core.gateway.responses.ResponseMemory`, bounded); every
``SWEEP_S`` seconds the attempts that ended are looked up in the store and
their responses dropped, with their exact contexts (:mod:`agl_core.gateway.contexts`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agl_core.config import GatewayConfig
from agl_core.gateway import anthropic, responses
from agl_core.gateway.capture import CHAT
from agl_core.gateway.streaming import CallStream, Chunk, EventStreamResponse
from agl_core.gateway.translate import require, upstream_error_message
from agl_core.http.rules import RequestError, check_bearer, error_response, parse_json_object, read_body
from agl_core.rollout.store import Store

log = logging.getLogger("agl_core.gateway")

SWEEP_S = 10.0
"""How often the responses of ended attempts are looked for and dropped."""


class ChatCalls(Protocol):
    """What these routes use of the gateway (:class:`~agl_core.gateway.server.Gateway`, which imports this module).

    ``call`` returns the gateway's ``Answer`` (its ``response`` parsed);
    ``open_stream`` a :class:`~agl_core.gateway.streaming.CallStream`.
    """

    config: GatewayConfig
    token: str | None
    store: Store

    async def call(self, rollout_id: str, attempt_id: str, endpoint: str, body: dict[str, Any],
                   role: str | None = None, *, lease: str | None = None) -> Any: ...

    async def open_stream(self, rollout_id: str, attempt_id: str, endpoint: str, body: dict[str, Any],
                          role: str | None = None, *, lease: str | None = None) -> CallStream: ...


class TranslatedApis:
    """The ``/v1/messages`` and ``/v1/responses`` endpoints of ``gateway``, and the responses kept for them."""

    def __init__(self, gateway: ChatCalls, memory: responses.ResponseMemory | None = None):
        self.gateway = gateway
        self.memory = memory or responses.ResponseMemory()
        self._sweeper: asyncio.Task | None = None

    async def messages(self, request: Request) -> Response:
        """``POST …/v1/messages``: an Anthropic Messages call, answered whole or as Anthropic's events."""
        rollout_id, attempt_id, lease = (request.path_params[key] for key in ("rollout_id", "attempt_id", "lease"))
        try:
            body = await self._body(request, anthropic_key=True)
            stream = anthropic.wants_stream(body)
            chat = anthropic.chat_request(body)
            if stream:
                opened = await self.gateway.open_stream(rollout_id, attempt_id, CHAT, streamed(chat),
                                                        request.path_params.get("role"), lease=lease)
                return TranslatedEventStream(opened, anthropic.MessageEvents(body["model"]))
            answer = await self.gateway.call(rollout_id, attempt_id, CHAT, chat, request.path_params.get("role"),
                                             lease=lease)
        except RequestError as exc:
            raw = getattr(exc, "raw", None)  # a CallFailed: the policy server's own error answer, if it gave one
            message = upstream_error_message(raw, exc.status) if raw is not None else str(exc)
            return JSONResponse(anthropic.error_body(exc.status, message), status_code=exc.status)
        return JSONResponse(anthropic.message(answer.response, body["model"]))

    async def responses(self, request: Request) -> Response:
        """``POST …/v1/responses``: an OpenAI Responses call, answered whole or as the Responses events."""
        rollout_id, attempt_id, lease = (request.path_params[key] for key in ("rollout_id", "attempt_id", "lease"))
        attempt = (rollout_id, attempt_id)
        self.start_sweeper()
        try:
            body = await self._body(request)
            stream = responses.wants_stream(body)
            previous = body.get("previous_response_id")
            history = [] if previous is None else self.memory.conversation(
                attempt, require(previous, str, "previous_response_id", "a string"))
            chat, added = responses.chat_request(body, history)

            def keep(response_id: str, answer: dict[str, Any]) -> None:
                self.memory.add(attempt, response_id, responses.Stored(previous, (*added,
                                                                                  responses.answer_message(answer))))

            if stream:
                opened = await self.gateway.open_stream(rollout_id, attempt_id, CHAT, streamed(chat),
                                                        request.path_params.get("role"), lease=lease)
                events = responses.ResponseEvents(body)
                return TranslatedEventStream(opened, events, lambda answer: keep(events.id, answer))
            answer = await self.gateway.call(rollout_id, attempt_id, CHAT, chat, request.path_params.get("role"),
                                             lease=lease)
        except RequestError as exc:
            raw = getattr(exc, "raw", None)  # a CallFailed: the policy server's own error answer, if it gave one
            if raw is not None:  # already in OpenAI's shape
                return Response(raw, exc.status, media_type="application/json")
            return error_response(exc.status, str(exc))
        out = responses.response(answer.response, body)
        keep(out["id"], answer.response)
        return JSONResponse(out)

    async def _body(self, request: Request, anthropic_key: bool = False) -> dict[str, Any]:
        """The JSON body, once the caller showed the gateway's token (``anthropic_key``: also as ``x-api-key``)."""
        config, token = self.gateway.config, self.gateway.token
        key = request.headers.get("x-api-key") if anthropic_key else None
        # The anthropic SDK sends its api_key as x-api-key (its auth_token as a bearer token): either is the token.
        if key is None or token is None or not hmac.compare_digest(key.encode(), token.encode()):
            check_bearer(request, token)
        return parse_json_object(await read_body(request, config.max_body_bytes, "rollout.gateway.max_body_bytes",
                                                 config.body_timeout_s))

    # ------------------------------------------------------------ ended attempts

    def start_sweeper(self) -> None:
        """Drop, from now on, what is kept of attempts that ended (Responses, exact contexts)."""
        # Started on the serving loop by its first Responses or chat call; it ends with that loop (a gateway
        # served again starts it on its new loop).
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_S)
            contexts = self.gateway.contexts
            held = sorted({*self.memory.attempts(), *(contexts.attempts() if contexts is not None else ())})
            if held:
                for attempt in await asyncio.to_thread(self._ended, held):
                    self.memory.drop(attempt)
                    if contexts is not None:
                        contexts.drop(attempt)

    def _ended(self, attempts: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The attempts among ``attempts`` that are no longer running (the store may block: a worker thread)."""
        ended = []
        for rollout_id, attempt_id in attempts:
            try:
                state = self.gateway.store.attempt_state(rollout_id, attempt_id)
            except Exception as exc:  # noqa: BLE001 - a store that fails now is asked again at the next sweep
                log.debug("cannot look up attempt %s of rollout %s: %s", attempt_id, rollout_id, exc)
                continue
            if state is None or not state.current:
                ended.append((rollout_id, attempt_id))
        return ended


def streamed(chat: dict[str, Any]) -> dict[str, Any]:
    """The chat request streamed, its usage asked for (the translations report it at the end)."""
    return {**chat, "stream": True, "stream_options": {"include_usage": True}}


class TranslatedEventStream(EventStreamResponse):
    """A streamed chat call relayed as another API's events: ``events`` turns each chunk into that API's frames.

    ``events`` has ``start()`` (the frames before any chunk), ``add(chunk)``
    and ``end(answer, error)`` (the closing frames, from the chunks assembled,
    or the error the call broke off with). As for a chat stream, the first
    chunk when it came alone waits for the next, a client that disconnects
    cancels the relay and the call is recorded incomplete,
    and at the end the call is recorded before the closing frames go out;
    ``finished(answer)`` runs then, when the answer came whole and was recorded.
    """

    def __init__(self, stream: CallStream, events: Any, finished: Callable[[dict[str, Any]], None] | None = None):
        super().__init__(stream)
        self.events, self.finished = events, finished

    def _opening(self) -> list[bytes]:
        return self.events.start()

    def _add_frames(self, frames: list[bytes], batch: list[Chunk]) -> None:
        for chunk in batch:
            frames += self.events.add(chunk.data)

    def _holds_first(self) -> bool:
        return True  # whatever the API: its first frames wait for the first token's

    def _closing(self) -> list[bytes]:
        stream = self.stream
        error = stream.error or stream.record_error
        answer = stream.assembly.response() if stream.assembly.chunks else None
        frames = self.events.end(answer, error)
        if error is None and answer is not None and self.finished is not None:
            self.finished(answer)
        return frames
