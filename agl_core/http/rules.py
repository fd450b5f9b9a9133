"""The rules every HTTP server of the project keeps: the gateway, the policy endpoint, the store server.

- It binds 127.0.0.1 by default; any other address only with a bearer token
  (:func:`require_token_off_loopback`), compared in constant time (:func:`check_bearer`).
- Request bodies are bounded in size and in the time a client may take to send
  them (:func:`read_body`): a huge or a trickling body costs the server nothing.
- A bad request fails alone, with a 4xx whose message names what is wrong
  (:class:`RequestError`): malformed or too deeply nested JSON
  (:func:`parse_json_object`), and sampling parameters out of range or not
  finite (:func:`check_sampling`), which are checked at the door so that they
  never reach an engine that would fail a whole batch over them.
- ``/healthz`` (``/health``) without the token says only that the server is
  alive (:func:`health_response`): what it serves is for callers with the token.

Error bodies use the OpenAI format, so the ``openai`` client raises with the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import math
import os
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from agl_core.http.recordable import (MAX_REQUEST_DEPTH, NotRecordable, check_json, deep_path, loads,
                                      within_depth)

INT64_MAX = 2**63 - 1


class RequestError(Exception):
    """A request a server refuses: answered with ``status`` and ``message``, nothing recorded."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> Response:
    """An error in the OpenAI format, so the openai client raises with ``message``."""
    return Response(error_body(status, message), status_code=status, media_type="application/json")


def error_body(status: int, message: str, kind: str | None = None) -> bytes:
    """The JSON of :func:`error_response`; ``kind``, when given, instead of the type the status implies."""
    kind = kind or ("authentication_error" if status == 401 else "invalid_request_error" if status < 500
                    else "api_error")
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}, ensure_ascii=False,
                      separators=(",", ":")).encode()


# ---------------------------------------------------------------- who may call


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and addresses in 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def require_token_off_loopback(what: str, host: str, token: str | None, setting: str) -> None:
    """ValueError unless ``host`` is a loopback address or ``token`` is set (``setting`` names where to set it)."""
    if not is_loopback(host) and not token:
        raise ValueError(f"{what} binds {host}, which is not a loopback address: set {setting} "
                         f"so that only callers with it get in")


POLICY_TOKEN_ENV = "AGL_POLICY_TOKEN"


def token_from(configured: str | None, env: str) -> str | None:
    """A server's or client's bearer token: ``configured``, else the environment variable ``env``, else None."""
    return configured or os.environ.get(env) or None


def policy_token(configured: str | None) -> str | None:
    """The bearer token between the gateway and the policy servers: ``configured``, else ``$AGL_POLICY_TOKEN``.

    The gateway sends it and a policy server requires it; both sides read it
    here, so the environment variable alone configures both.
    """
    return token_from(configured, POLICY_TOKEN_ENV)


def has_bearer(request: Request, token: str | None) -> bool:
    """Whether the request carries ``Authorization: Bearer <token>`` (always true without a token)."""
    return is_bearer(request.headers.get("authorization", ""), token)


def is_bearer(authorization: str, token: str | None) -> bool:
    """Whether an ``Authorization`` header's value is ``Bearer <token>`` (always true without a token)."""
    if token is None:
        return True
    scheme, _, given = authorization.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token.encode())


def check_bearer(request: Request, token: str | None) -> None:
    """RequestError 401 unless the request carries the bearer token (no check without a token)."""
    check_authorization(request.headers.get("authorization", ""), token)


def check_authorization(authorization: str, token: str | None) -> None:
    """:func:`check_bearer` of an ``Authorization`` header's value."""
    if not is_bearer(authorization, token):
        raise RequestError(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' "
                                "(the openai client sends its api_key so)")


def health_response(request: Request, token: str | None, details: dict[str, Any]) -> JSONResponse:
    """``{"ok": true}``, with ``details`` only for a caller with the token (or when there is none)."""
    return JSONResponse({"ok": True, **details} if has_bearer(request, token) else {"ok": True})


# ---------------------------------------------------------------- the body


BODY_RECEIVED = "agl.body_received"
"""The ASGI scope extension the project's servers set once they hold a request's whole body
(:mod:`agl_core.http.limits`): :func:`read_body` then takes it without a timer, which cost more than the rest of
the read (most requests arrive whole, in one packet)."""


async def read_body(request: Request, limit: int, limit_setting: str, timeout_s: float) -> bytes:
    """The request body, at most ``limit`` bytes (413) and sent within ``timeout_s`` seconds (408)."""
    too_big = RequestError(413, f"request body exceeds {limit} bytes ({limit_setting})")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    received = BODY_RECEIVED in request.scope.get("extensions", ())
    chunks, size = [], 0
    try:
        async with contextlib.nullcontext() if received else asyncio.timeout(timeout_s):
            while True:  # the ASGI messages themselves: Request.stream() adds an async generator's cost to each
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    raise too_big
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
    except TimeoutError:
        raise RequestError(408, f"the request body was not received within {timeout_s:g} s") from None
    except ClientDisconnect:
        raise RequestError(400, "the client disconnected before sending the whole body") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json_object(raw: bytes, max_depth: int = MAX_REQUEST_DEPTH) -> dict[str, Any]:
    """The body as a JSON object, or the RequestError (400) that says what is wrong with it: not JSON, not an
    object, nested deeper than ``max_depth`` levels, or holding a lone surrogate (:mod:`agl_core.http.recordable`:
    what no store could record), the last two naming the path."""
    try:
        body, plain = loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        where = deep_path(raw.decode("utf-8", "replace"), max_depth)
        raise RequestError(400, f"request body is nested too deeply (at most {max_depth} levels)"
                                + (f": {where!r} is nested deeper" if where else "")) from None
    if not isinstance(body, dict):
        raise RequestError(400, "request body must be a JSON object")
    if plain and within_depth(raw, max_depth):
        return body  # orjson refuses lone surrogates: with few enough brackets, nothing is left to look for
    try:
        check_json(body, max_depth)
    except NotRecordable as exc:
        raise RequestError(400, f"request body: {exc}") from None
    return body


# ---------------------------------------------------------------- sampling parameters


def integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; RequestError 400 naming ``name`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be an integer, got {_short(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise RequestError(400, f"'{name}' must be in [{'-inf' if low is None else low}, "
                                f"{'inf' if high is None else high}], got {value}")
    return value


def number(name: str, value: Any, *, low: float | None = None, high: float | None = None,
           low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` with ``low_open``); RequestError otherwise."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise RequestError(400, f"'{name}' must be a number, got {_short(value)}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float: not a sane parameter either
        raise RequestError(400, f"'{name}' must be a finite number, got an integer of {value.bit_length()} bits") \
            from None
    if not math.isfinite(value):
        raise RequestError(400, f"'{name}' must be a finite number, got {value}")
    if (low is not None and (value < low or (low_open and value == low))) or (high is not None and value > high):
        bounds = (f"{'(' if low_open else '['}{'-inf' if low is None else low}, "
                  f"{'inf' if high is None else high}]")
        raise RequestError(400, f"'{name}' must be in {bounds}, got {value}")
    return value


MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 100.0
"""The temperatures a request or a recipe's sampling may ask for, besides 0 (greedy decoding): logits divided by
a smaller one overflow."""


def temperature_problem(value: float) -> str | None:
    """What is wrong with a sampling temperature, or None; one rule for requests and recipes."""
    if value == 0 or MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        return None
    return f"must be 0 (greedy) or from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}"

_NUMBERS: dict[str, dict[str, Any]] = {
    "top_p": {"low": 0.0, "high": 1.0, "low_open": True},
    "min_p": {"low": 0.0, "high": 1.0},
    "frequency_penalty": {"low": -2.0, "high": 2.0},
    "presence_penalty": {"low": -2.0, "high": 2.0},
    "repetition_penalty": {"low": 0.0, "high": 100.0, "low_open": True},
}


def check_sampling(body: dict[str, Any], *, max_n: int, logprobs_key: str | None = None) -> None:
    """Check the OpenAI sampling fields of a chat or text completion request; RequestError 400 naming the field.

    Absent and null fields are fine (the server's defaults apply). ``n`` may
    be at most ``max_n``; ``logprobs_key`` (``top_logprobs`` for chat,
    ``logprobs`` for completions) asks for at most 20 alternatives.
    """
    get = body.get
    if get("n") is not None:
        integer("n", get("n"), low=1, high=max_n)
    for key in ("max_tokens", "max_completion_tokens"):
        if get(key) is not None:
            integer(key, get(key), low=1, high=INT64_MAX)
    if get("temperature") is not None:
        temperature = number("temperature", get("temperature"), low=0.0, high=MAX_TEMPERATURE)
        if (problem := temperature_problem(temperature)) is not None:
            raise RequestError(400, f"'temperature' {problem}, got {temperature!r}")
    for key, bounds in _NUMBERS.items():
        if get(key) is not None:
            number(key, get(key), **bounds)
    if get("seed") is not None:
        integer("seed", get("seed"), low=0, high=INT64_MAX)
    if get("top_k") is not None:
        integer("top_k", get("top_k"), low=-1, high=INT64_MAX)
    if logprobs_key is not None and get(logprobs_key) is not None and not isinstance(get(logprobs_key), bool):
        integer(logprobs_key, get(logprobs_key), low=0, high=20)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
