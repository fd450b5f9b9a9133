"""What the gateway's API translations share: field checks, the chat answer's first choice, ids, SSE framing.

The Anthropic Messages API (:mod:`agl_core.gateway.anthropic`) and the OpenAI
Responses API (:mod:`agl_core.gateway.responses`) are both translated to one
OpenAI chat completion and back; these are the pieces both need.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from agl_core.http.rules import RequestError


def new_id(prefix: str) -> str:
    """A fresh id in the style of the API (``msg_…``, ``resp_…``, ``toolu_…``)."""
    return f"{prefix}{uuid.uuid4().hex}"


def require(value: Any, kind: type | tuple[type, ...], where: str, what: str) -> Any:
    """``value`` when it is a ``kind``; RequestError 400 naming ``where`` and saying it must be ``what`` otherwise."""
    if not isinstance(value, kind):
        raise RequestError(400, f"'{where}' must be {what}, got {type(value).__name__}")
    return value


def text_of(content: Any, where: str, kinds: frozenset[str]) -> str:
    """The text of ``content``: a string, or a list of text parts whose ``type`` is one of ``kinds``, joined.

    RequestError 400 naming ``where`` (and the part) for anything else: the policy reads text only.
    """
    if isinstance(content, str):
        return content
    parts = require(content, list, where, "a string or a list of text parts")
    texts = []
    for index, part in enumerate(parts):
        require(part, dict, f"{where}[{index}]", "a content part")
        if part.get("type") not in kinds:
            raise RequestError(400, f"'{where}[{index}].type' {part.get('type')!r:.80} is not supported "
                                    f"(the policy reads {' and '.join(sorted(kinds))} parts)")
        texts.append(require(part.get("text"), str, f"{where}[{index}].text", "a string"))
    return "".join(texts)


def refuse_unknown(body: dict[str, Any], known: frozenset[str], where: str = "") -> None:
    """RequestError 400 naming the keys of ``body`` that are not in ``known`` (prefixed by ``where``)."""
    unknown = sorted(set(body) - known)
    if unknown:
        names = ", ".join(repr(f"{where}{key}") for key in unknown)
        raise RequestError(400, f"unknown or unsupported field(s) {names}")


def first_choice(answer: dict[str, Any]) -> dict[str, Any]:
    """The first choice of an OpenAI chat completion: text, tool calls and finish reason.

    Returns ``{"text", "tool_calls", "finish_reason", "stop_reason"}``
    (``stop_reason``: the stop string that ended the answer, as vLLM reports it).
    """
    choices = answer.get("choices") or [{}]
    choice = choices[0] if isinstance(choices[0], dict) else {}
    message = choice.get("message") or {}
    return {"text": message.get("content") or "", "tool_calls": list(message.get("tool_calls") or []),
            "finish_reason": choice.get("finish_reason"), "stop_reason": choice.get("stop_reason")}


def usage_of(answer: dict[str, Any]) -> tuple[int, int]:
    """``(prompt_tokens, completion_tokens)`` of a chat completion: its ``usage``, else its token ids counted."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    choices = answer.get("choices") or [{}]
    return len(answer.get("prompt_token_ids") or ()), len((choices[0] or {}).get("token_ids") or ())


def tool_arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's JSON ``arguments`` as an object; a model's malformed JSON kept as ``{"_raw": text}``.

    A policy being trained writes broken JSON at times; the agent sees what
    it wrote instead of the gateway failing the call.
    """
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments or "{}")
    except ValueError:
        return {"_raw": arguments}
    return parsed if isinstance(parsed, dict) else {"_raw": arguments}


def server_sent_event(event: str, data: dict[str, Any]) -> bytes:
    """One SSE frame: ``event: <event>`` and its JSON ``data``."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def upstream_error_message(body: bytes, status: int) -> str:
    """The message of an error answer of the chat path (OpenAI's ``{"error": {"message": …}}``), else a summary."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"the policy server answered {status}"
    return str(message)
