"""The Anthropic Messages API (``POST /v1/messages``) as one OpenAI chat completion, and its answer back.

The gateway serves ``/v1/messages`` on the per-rollout URL by translating the
request into the chat request the policy understands (:func:`chat_request`),
making that chat call exactly as for an agent that called
``chat/completions`` (same checks, same span with the same token ids), and
translating the chat answer into a Messages answer (:func:`message`), or a
streamed chat call's chunks into Anthropic's events as they come
(:class:`MessageEvents`). No I/O here.

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
from typing import Any

from agl_core.gateway.translate import (first_choice, new_id, refuse_unknown, require, server_sent_event,
                                        text_of, tool_arguments, usage_of)
from agl_core.http.rules import RequestError

API = "anthropic.messages"

TRANSLATED = frozenset({"model", "max_tokens", "messages", "system", "temperature", "top_p", "top_k",
                        "stop_sequences", "tools", "tool_choice", "stream", "seed"})
IGNORED = frozenset({"metadata", "service_tier", "cache_control", "thinking", "container", "context_management",
                     "diagnostics", "inference_geo", "speed", "user_profile_id", "workspace_id", "output_config"})
"""Fields that change nothing the policy samples: accepted so that agents setting them run unchanged."""

TEXT_BLOCKS = frozenset({"text"})

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
        chat.append({"role": "system", "content": text_of(body["system"], "system", TEXT_BLOCKS)})
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
                            "content": text_of(block.get("content") or "", f"{at}.content", TEXT_BLOCKS)})
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
    stop_reason, stop_sequence = _stop(choice)
    prompt_tokens, completion_tokens = usage_of(answer)
    return {"id": new_id("msg_"), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": completion_tokens}}


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` of a chat choice (:func:`~agl_core.gateway.translate.first_choice`)."""
    stop_reason = STOP_REASONS.get(choice["finish_reason"], "end_turn")
    stop_sequence = choice["stop_reason"] if isinstance(choice["stop_reason"], str) else None
    if stop_sequence is not None and stop_reason == "end_turn":
        stop_reason = "stop_sequence"
    if choice["tool_calls"] and stop_reason == "end_turn":
        stop_reason = "tool_use"
    return stop_reason, stop_sequence


class MessageEvents:
    """Anthropic's event stream of a streamed chat call, made chunk by chunk (chunks in, SSE frames out).

    :meth:`add` each ``chat.completion.chunk`` as it arrives: the first one
    opens the message (``message_start``, with the prompt's length when the
    chunk carries ``prompt_token_ids``); text opens a ``text`` block and
    becomes ``text_delta`` events; each tool call opens a ``tool_use`` block
    (its id and name) and its argument fragments become ``input_json_delta``
    events. :meth:`end` closes the open block and sends ``message_delta``
    (stop reason and output tokens, from the whole answer) and
    ``message_stop``; or, when the call broke off, an ``error`` event.
    """

    def __init__(self, model: str):
        self.model = model
        self.id = new_id("msg_")
        self._started = False
        self._blocks = 0  # blocks opened so far: the next one's index
        self._open: tuple[str, Any] | None = None  # ("text", None) or ("tool", the call's index in the chunk)

    def start(self) -> list[bytes]:
        """Nothing before the first chunk: ``message_start`` carries the prompt's length, which that chunk brings."""
        return []

    def add(self, chunk: dict[str, Any]) -> list[bytes]:
        frames = [] if self._started else [self._start(chunk)]
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the first choice is the answer, as in a call not streamed
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open != ("text", None):
                    frames += self._open_block(("text", None), {"type": "text", "text": ""})
                frames.append(self._delta("text_delta", "text", delta["content"]))
            for call in delta.get("tool_calls") or ():
                key = ("tool", call.get("index", 0))
                function = call.get("function") or {}
                if self._open != key:
                    frames += self._open_block(key, {"type": "tool_use", "id": call.get("id") or new_id("toolu_"),
                                                     "name": function.get("name"), "input": {}})
                if function.get("arguments"):
                    frames.append(self._delta("input_json_delta", "partial_json", function["arguments"]))
        return frames

    def end(self, answer: dict[str, Any] | None, error: str | None) -> list[bytes]:
        """The closing frames: of the whole ``answer`` (the chunks assembled), or the ``error`` it broke off with."""
        frames = [] if self._started else [self._start({})]
        if error is not None or answer is None:
            message_ = error or "the policy server's stream had no chunk"
            return frames + [server_sent_event("error", error_body(502, message_))]
        frames += self._close_block()
        done = message(answer, self.model)
        frames.append(server_sent_event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": done["stop_reason"],
                                               "stop_sequence": done["stop_sequence"]},
            "usage": {"output_tokens": done["usage"]["output_tokens"]}}))
        frames.append(server_sent_event("message_stop", {"type": "message_stop"}))
        return frames

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self._started = True
        prompt = chunk.get("prompt_token_ids")
        started = {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                   "stop_reason": None, "stop_sequence": None,
                   "usage": {"input_tokens": len(prompt) if isinstance(prompt, list) else 0, "output_tokens": 0}}
        return server_sent_event("message_start", {"type": "message_start", "message": started})

    def _open_block(self, key: tuple[str, Any], block: dict[str, Any]) -> list[bytes]:
        frames = self._close_block()
        self._open = key
        frames.append(server_sent_event("content_block_start", {"type": "content_block_start",
                                                                "index": self._blocks, "content_block": block}))
        return frames

    def _close_block(self) -> list[bytes]:
        if self._open is None:
            return []
        self._open = None
        self._blocks += 1
        return [server_sent_event("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})]

    def _delta(self, kind: str, field: str, piece: str) -> bytes:
        # One event per token: its frame is written out rather than built as a dict and dumped (the hot path).
        return (f'event: content_block_delta\ndata: {{"type":"content_block_delta","index":{self._blocks},'
                f'"delta":{{"type":"{kind}","{field}":{json.dumps(piece)}}}}}\n\n').encode()
