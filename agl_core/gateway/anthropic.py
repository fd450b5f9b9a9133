"""The Anthropic Messages API (``POST /v1/messages``) as one OpenAI chat completion, and its answer back.

The gateway serves ``/v1/messages`` on the per-rollout URL by translating the
request into the chat request the policy understands (:func:`chat_request`),
making that chat call exactly as for an agent that called
``chat/completions`` (same checks, same span with the same token ids), and
translating the chat answer into a Messages answer (:func:`message`) or its
event stream (:func:`message_events`). Pure functions: no I/O.

What maps to what:

- ``system`` (a string or text blocks) → a first ``system`` message;
- ``messages[].content`` text blocks → the message's text (blocks joined with
  nothing between them, as the policy servers read a list of text parts);
  ``tool_use`` blocks of an assistant message → its ``tool_calls``;
  ``tool_result`` blocks of a user message → ``tool`` messages, before the
  message's text (``is_error`` is not carried: chat has no such field);
- ``tools`` (custom tools with ``input_schema``) → chat ``tools``;
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` → ``auto`` /
  ``required`` / the named function / ``none``, and
  ``disable_parallel_tool_use`` → ``parallel_tool_calls: false``;
- ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_sequences`` →
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``; ``seed``
  (not Anthropic's, sent with ``extra_body``) as it is;
- fields that do not change what the policy samples (``metadata``,
  ``service_tier``, ``cache_control``, ``thinking``, …) are accepted and
  ignored; any other field, and content the policy cannot read (images,
  documents, server tools), is a 400 naming it.

The answer's ``stop_reason``: ``end_turn`` (the model stopped), ``max_tokens``
(cut at ``max_tokens``), ``stop_sequence`` (with ``stop_sequence``, when the
policy server names the stop string that ended it, as vLLM does),
``tool_use`` (tool calls). Errors have Anthropic's shape
(:func:`error_body`), so the ``anthropic`` client raises its own exceptions.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from agl_core.gateway.translate import (first_choice, new_id, refuse_unknown, require, server_sent_event,
                                        tool_arguments, usage_of)
from agl_core.http_rules import RequestError

API = "anthropic.messages"

TRANSLATED = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                        "stop_sequences", "tools", "tool_choice", "stream", "seed"})
IGNORED = frozenset({"metadata", "service_tier", "cache_control", "thinking", "container", "context_management",
                     "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id", "output_config"})
"""Fields that change nothing the policy samples: accepted so that agents setting them run unchanged."""

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use",
                "content_filter": "refusal"}

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 409: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    """An error in Anthropic's shape: ``{"type": "error", "error": {"type": …, "message": …}}``."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def wants_stream(body: dict[str, Any]) -> bool:
    """Whether the request asks for the event stream; RequestError 400 when ``stream`` is not a boolean."""
    return bool(require(body.get("stream", False), bool, "stream", "a boolean"))


# ---------------------------------------------------------------- request


def chat_request(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat request a Messages request asks for; RequestError 400 naming the first bad field."""
    refuse_unknown(body, TRANSLATED | IGNORED)
    require(body.get("model"), str, "model", "a string")
    if "max_tokens" not in body:
        raise RequestError(400, "'max_tokens' is required")
    messages = require(body.get("messages"), list, "messages", "a list of messages")
    if not messages:
        raise RequestError(400, "'messages' must be a non-empty list of messages")
    chat: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for index, entry in enumerate(messages):
        chat.extend(_messages(entry, f"messages[{index}]"))
    out: dict[str, Any] = {"model": body["model"], "messages": chat, "max_tokens": body["max_tokens"]}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences") is not None:
        stops = require(body["stop_sequences"], list, "stop_sequences", "a list of strings")
        for index, stop in enumerate(stops):
            require(stop, str, f"stop_sequences[{index}]", "a string")
        out["stop"] = stops
    if body.get("tools"):
        out["tools"] = [_tool(tool, f"tools[{i}]")
                        for i, tool in enumerate(require(body["tools"], list, "tools", "a list of tools"))]
    if body.get("tool_choice") is not None:
        out.update(_tool_choice(body["tool_choice"]))
    return out


def _messages(entry: Any, where: str) -> list[dict[str, Any]]:
    """The chat messages of one Messages message (a user message with tool results makes several)."""
    require(entry, dict, where, "a message object")
    role = entry.get("role")
    if role not in ("user", "assistant"):
        raise RequestError(400, f"'{where}.role' must be 'user' or 'assistant', got {role!r:.80}")
    content = entry.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = require(content, list, f"{where}.content", "a string or a list of content blocks")
    texts, tool_calls, results = [], [], []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        require(block, dict, at, "a content block")
        kind = block.get("type")
        if kind == "text":
            texts.append(require(block.get("text"), str, f"{at}.text", "a string"))
        elif kind == "tool_use" and role == "assistant":
            tool_calls.append({"id": require(block.get("id"), str, f"{at}.id", "a string"), "type": "function",
                               "function": {"name": require(block.get("name"), str, f"{at}.name", "a string"),
                                            "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool",
                            "tool_call_id": require(block.get("tool_use_id"), str, f"{at}.tool_use_id", "a string"),
                            "content": _text(block.get("content") or "", f"{at}.content")})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # the policy does not think aloud: a client replaying another model's thoughts loses nothing
        else:
            raise RequestError(400, f"'{at}.type' {kind!r:.80} is not supported in a {role} message "
                                    f"(the policy reads text, tool_use and tool_result blocks)")
    out = list(results)
    if role == "assistant":
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if tool_calls:
            message["tool_calls"] = tool_calls
        out.append(message)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _text(content: Any, where: str) -> str:
    """The text of a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    blocks = require(content, list, where, "a string or a list of text blocks")
    texts = []
    for index, block in enumerate(blocks):
        require(block, dict, f"{where}[{index}]", "a text block")
        if block.get("type") != "text":
            raise RequestError(400, f"'{where}[{index}].type' must be 'text', got {block.get('type')!r:.80}")
        texts.append(require(block.get("text"), str, f"{where}[{index}].text", "a string"))
    return "".join(texts)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    require(tool, dict, where, "a tool object")
    if tool.get("type") not in (None, "custom"):
        raise RequestError(400, f"'{where}.type' {tool.get('type')!r:.80} is not supported: only custom tools "
                                f"(name, description, input_schema) reach the policy")
    function = {"name": require(tool.get("name"), str, f"{where}.name", "a string"),
                "parameters": require(tool.get("input_schema"), dict, f"{where}.input_schema", "a JSON schema")}
    if tool.get("description") is not None:
        function["description"] = require(tool["description"], str, f"{where}.description", "a string")
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> dict[str, Any]:
    require(choice, dict, "tool_choice", "an object")
    kind = choice.get("type")
    if kind == "tool":
        name = require(choice.get("name"), str, "tool_choice.name", "a string")
        out: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": name}}}
    elif kind in ("auto", "any", "none"):
        out = {"tool_choice": {"auto": "auto", "any": "required", "none": "none"}[kind]}
    else:
        raise RequestError(400, f"'tool_choice.type' must be 'auto', 'any', 'tool' or 'none', got {kind!r:.80}")
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


# ---------------------------------------------------------------- answer


def message(answer: dict[str, Any], model: str) -> dict[str, Any]:
    """The Messages answer of a chat completion (its first choice) to a request that named ``model``."""
    choice = first_choice(answer)
    content: list[dict[str, Any]] = []
    if choice["text"]:
        content.append({"type": "text", "text": choice["text"]})
    for call in choice["tool_calls"]:
        function = call.get("function") or {}
        content.append({"type": "tool_use", "id": call.get("id") or new_id("toolu_"), "name": function.get("name"),
                        "input": tool_arguments(function.get("arguments"))})
    stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    stop_sequence = choice["stop_reason"] if isinstance(choice["stop_reason"], str) else None
    if stop_sequence is not None and stop_reason == "end_turn":
        stop_reason = "stop_sequence"
    if choice["tool_calls"] and stop_reason == "end_turn":
        stop_reason = "tool_use"
    prompt_tokens, completion_tokens = usage_of(answer)
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}}


def message_events(answer: dict[str, Any]) -> Iterator[bytes]:
    """The SSE frames that stream ``answer`` (a :func:`message`), in the order Anthropic sends them.

    ``message_start`` (the message without content, no stop reason yet),
    per content block ``content_block_start`` / one ``content_block_delta``
    (``text_delta`` or ``input_json_delta``) / ``content_block_stop``, then
    ``message_delta`` (stop reason and output tokens) and ``message_stop``.
    """
    start = {**answer, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**answer["usage"], "output_tokens": 0}}
    yield server_sent_event("message_start", {"type": "message_start", "message": start})
    for index, block in enumerate(answer["content"]):
        if block["type"] == "text":
            opening, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opening = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        yield server_sent_event("content_block_start",
                                {"type": "content_block_start", "index": index, "content_block": opening})
        yield server_sent_event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
        yield server_sent_event("content_block_stop", {"type": "content_block_stop", "index": index})
    yield server_sent_event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": answer["stop_reason"], "stop_sequence": answer["stop_sequence"]},
        "usage": {"output_tokens": answer["usage"]["output_tokens"]}})
    yield server_sent_event("message_stop", {"type": "message_stop"})
