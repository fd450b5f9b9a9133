"""The OpenAI Responses API (``POST /v1/responses``) as one OpenAI chat completion, and its answer back.

The subset the OpenAI Agents SDK uses: ``input`` (a string, or items:
messages with text parts, ``function_call`` and ``function_call_output``),
``instructions``, function ``tools`` and ``tool_choice``,
``previous_response_id`` within a rollout attempt, streamed and not. The
gateway translates a request into the chat request the policy understands
(:func:`chat_request`), makes that chat call exactly as for an agent that
called ``chat/completions`` (same checks, same span with the same token ids),
and translates the answer into a response (:func:`response`), or a streamed
chat call's chunks into the Responses events as they come
(:class:`ResponseEvents`). :class:`ResponseMemory` keeps the responses
of the running attempts, so a call may continue one with
``previous_response_id``.

What maps to what:

- ``instructions`` → a first ``system`` message (not carried over from a
  previous response, as OpenAI does);
- message items (``{"role", "content"}``, with or without ``type:
  "message"``): ``developer`` → ``system``; text parts (``input_text``,
  ``output_text``) joined with nothing between them;
- ``function_call`` items → ``tool_calls`` of an assistant message (with the
  text of an assistant message just before them); ``function_call_output``
  items → ``tool`` messages; ``reasoning`` items are dropped (the policy does
  not think aloud);
- function ``tools`` → chat ``tools``; ``tool_choice`` as it is (a named
  function in chat's form); ``parallel_tool_calls``, ``temperature``,
  ``top_p``, ``max_output_tokens`` (→ ``max_tokens``), ``top_logprobs``,
  ``seed`` (not OpenAI's, sent with ``extra_body``) as they are;
- fields that change nothing the policy samples (``include``, ``store``,
  ``metadata``, ``truncation``, ``reasoning``, ``prompt_cache_key``, …) are
  accepted and ignored; others (``conversation``, ``background``, hosted tools,
  images, a ``text.format`` other than text) are a 400 naming them.

An answer cut at ``max_output_tokens`` is ``status: "incomplete"`` with
``incomplete_details.reason: "max_output_tokens"``, as OpenAI answers (the
Agents SDK raises ``ModelBehaviorError`` on it). Errors have OpenAI's shape.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from agl_core.gateway.translate import (first_choice, new_id, refuse_unknown, require, server_sent_event,
                                        text_of, usage_of)
from agl_core.http.rules import RequestError

API = "openai.responses"

TRANSLATED = frozenset({"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
                        "temperature", "top_p", "max_output_tokens", "top_logprobs", "previous_response_id",
                        "stream", "stream_options", "text", "seed"})
IGNORED = frozenset({"include", "store", "metadata", "truncation", "reasoning", "prompt_cache_key",
                     "prompt_cache_retention", "prompt_cache_options", "service_tier", "user", "safety_identifier",
                     "context_management", "max_tool_calls"})
"""Fields that change nothing the policy samples: accepted so that agents setting them run unchanged."""

TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def wants_stream(body: dict[str, Any]) -> bool:
    """Whether the request asks for the event stream; RequestError 400 when ``stream`` is not a boolean."""
    return bool(require(body.get("stream", False), bool, "stream", "a boolean"))


# ---------------------------------------------------------------- memory


@dataclass(frozen=True)
class Stored:
    """What a response adds to its conversation: the new input messages and the answer's message."""

    previous_response_id: str | None
    messages: tuple[dict[str, Any], ...]


class ResponseMemory:
    """The responses of the running attempts, for ``previous_response_id``; bounded, dropped per attempt.

    At most ``max_attempts`` attempts are held (the least recently used one is
    dropped first) and ``max_responses`` responses per attempt (the oldest
    first); the gateway drops an attempt's responses once the attempt ended
    (:meth:`drop`). A response is found only within its own attempt, so one
    rollout never continues another's conversation. Each response stores only
    the messages it added, so a conversation's memory grows linearly with its
    length. Used from the gateway's event loop only (not thread-safe).
    """

    def __init__(self, max_attempts: int = 4096, max_responses: int = 256):
        self.max_attempts, self.max_responses = max_attempts, max_responses
        self._attempts: OrderedDict[tuple[str, str], OrderedDict[str, Stored]] = OrderedDict()

    def add(self, attempt: tuple[str, str], response_id: str, stored: Stored) -> None:
        held = self._attempts.get(attempt)
        if held is None:
            held = self._attempts[attempt] = OrderedDict()
            while len(self._attempts) > self.max_attempts:
                self._attempts.popitem(last=False)
        self._attempts.move_to_end(attempt)
        held[response_id] = stored
        while len(held) > self.max_responses:
            held.popitem(last=False)

    def conversation(self, attempt: tuple[str, str], response_id: str) -> list[dict[str, Any]]:
        """The chat messages of ``response_id`` and the responses before it, oldest first.

        RequestError 400 naming ``previous_response_id`` when it is not a
        response of this attempt (or no longer held).
        """
        held = self._attempts.get(attempt) or {}
        chain: list[Stored] = []
        current: str | None = response_id
        while current is not None:
            stored = held.get(current)
            if stored is None:
                raise RequestError(400, f"'previous_response_id': no response {current!r:.80} in this rollout "
                                        f"attempt (responses are kept for the attempt that made them, the last "
                                        f"{self.max_responses} of each)")
            chain.append(stored)
            current = stored.previous_response_id
        return [message for stored in reversed(chain) for message in stored.messages]

    def attempts(self) -> list[tuple[str, str]]:
        """The attempts whose responses are held."""
        return list(self._attempts)

    def drop(self, attempt: tuple[str, str]) -> None:
        """Forget the responses of ``attempt`` (it ended)."""
        self._attempts.pop(attempt, None)


# ---------------------------------------------------------------- request


def chat_request(body: dict[str, Any], history: list[dict[str, Any]] = ()) -> tuple[dict[str, Any], list[dict]]:
    """The chat request a Responses request asks for, and the messages its ``input`` adds to the conversation.

    ``history`` holds the messages of the ``previous_response_id`` chain
    (:meth:`ResponseMemory.conversation`). RequestError 400 naming the first bad field.
    """
    refuse_unknown(body, TRANSLATED | IGNORED)
    require(body.get("model"), str, "model", "a string")
    added = _input_messages(body.get("input"))
    messages = list(history) + added
    if body.get("instructions") is not None:
        messages.insert(0, {"role": "system", "content": require(body["instructions"], str, "instructions",
                                                                 "a string")})
    if not messages:
        raise RequestError(400, "'input' must not be empty")
    out: dict[str, Any] = {"model": body["model"], "messages": messages}
    for key in ("temperature", "top_p", "top_logprobs", "seed", "parallel_tool_calls"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    if body.get("tools"):
        out["tools"] = [_tool(tool, f"tools[{i}]")
                        for i, tool in enumerate(require(body["tools"], list, "tools", "a list of tools"))]
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    text = body.get("text")
    if text is not None:
        kind = (require(text, dict, "text", "an object").get("format") or {}).get("type", "text")
        if kind != "text":
            raise RequestError(400, f"'text.format.type' {kind!r:.80} is not supported: the policy answers text")
    return out, added


def _input_messages(items: Any) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    require(items, list, "input", "a string or a list of input items")
    out: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        require(item, dict, where, "an input item")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise RequestError(400, f"'{where}.role' must be 'user', 'assistant', 'system' or 'developer', "
                                        f"got {role!r:.80}")
            out.append({"role": "system" if role == "developer" else role,
                        "content": text_of(item.get("content"), f"{where}.content", TEXT_PARTS)})
        elif kind == "function_call":
            call = {"id": require(item.get("call_id"), str, f"{where}.call_id", "a string"), "type": "function",
                    "function": {"name": require(item.get("name"), str, f"{where}.name", "a string"),
                                 "arguments": require(item.get("arguments", ""), str, f"{where}.arguments",
                                                      "a string")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one assistant turn: its text and its calls
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": require(item.get("call_id"), str, f"{where}.call_id",
                                                                "a string"),
                        "content": text_of(item.get("output", ""), f"{where}.output", TEXT_PARTS)})
        elif kind == "reasoning":
            continue
        else:
            raise RequestError(400, f"'{where}.type' {kind!r:.80} is not supported (the policy reads messages, "
                                    f"function_call and function_call_output items)")
    return out


def _tool(tool: Any, where: str) -> dict[str, Any]:
    require(tool, dict, where, "a tool object")
    if tool.get("type") != "function":
        raise RequestError(400, f"'{where}.type' {tool.get('type')!r:.80} is not supported: only function tools "
                                f"reach the policy")
    function = {"name": require(tool.get("name"), str, f"{where}.name", "a string"),
                "parameters": require(tool.get("parameters") or {"type": "object", "properties": {}}, dict,
                                      f"{where}.parameters", "a JSON schema")}
    if tool.get("description") is not None:
        function["description"] = require(tool["description"], str, f"{where}.description", "a string")
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": require(choice.get("name"), str, "tool_choice.name",
                                                                 "a string")}}
    raise RequestError(400, f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {choice!r:.80}")


# ---------------------------------------------------------------- answer


def response(answer: dict[str, Any], request: dict[str, Any], response_id: str | None = None,
             item_ids: list[str] = ()) -> dict[str, Any]:
    """The Responses object of a chat completion (its first choice), for ``request`` (the Responses body).

    ``item_ids`` names the output items in order (those a stream already
    announced); the others get fresh ids.
    """
    choice = first_choice(answer)
    output: list[dict[str, Any]] = []
    cut = choice["finish_reason"] == "length"
    if choice["text"] or not choice["tool_calls"]:
        output.append({"type": "message", "id": new_id("msg_"), "status": "incomplete" if cut else "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": choice["text"], "annotations": [], "logprobs": []}]})
    for call in choice["tool_calls"]:
        function = call.get("function") or {}
        output.append({"type": "function_call", "id": new_id("fc_"), "call_id": call.get("id") or new_id("call_"),
                       "name": function.get("name"), "arguments": function.get("arguments") or "{}",
                       "status": "completed"})
    for item, item_id in zip(output, item_ids):
        item["id"] = item_id
    prompt_tokens, completion_tokens = usage_of(answer)
    return {
        "id": response_id or new_id("resp_"), "object": "response", "created_at": int(time.time()),
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": request.get("instructions"), "max_output_tokens": request.get("max_output_tokens"),
        "model": request.get("model"), "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": request.get("previous_response_id"), "temperature": request.get("temperature"),
        "top_p": request.get("top_p"), "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [], "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": request.get("metadata") or {}, "store": True,
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def answer_message(answer: dict[str, Any]) -> dict[str, Any]:
    """The assistant message a chat completion adds to the conversation (kept for ``previous_response_id``)."""
    choice = first_choice(answer)
    message: dict[str, Any] = {"role": "assistant", "content": choice["text"]}
    if choice["tool_calls"]:
        message["tool_calls"] = [{"id": call.get("id"), "type": "function", "function": call.get("function")}
                                 for call in choice["tool_calls"]]
    return message


class ResponseEvents:
    """The Responses event stream of a streamed chat call, made chunk by chunk (chunks in, SSE frames out).

    The first frames (:meth:`start`) are ``response.created`` and
    ``response.in_progress``. :meth:`add` each ``chat.completion.chunk`` as it
    arrives: text opens a message item (``response.output_item.added``,
    ``response.content_part.added``) and becomes ``response.output_text.delta``
    events; each tool call opens a ``function_call`` item and its argument
    fragments become ``response.function_call_arguments.delta`` events.
    :meth:`end` closes the open item (``….done`` events, from the whole
    answer), sends the items the stream did not show (an empty message), and
    ``response.completed`` (``response.incomplete`` for an answer cut at
    ``max_output_tokens``); or, when the call broke off, an ``error`` event.
    Every event has its ``sequence_number``. :attr:`done` is then the final
    response object.
    """

    def __init__(self, request: dict[str, Any]):
        self.request = request
        self.id = new_id("resp_")
        self.done: dict[str, Any] | None = None
        self._sequence = 0
        self._items: list[dict[str, Any]] = []  # the items announced, as announced
        self._pieces: list[list[str]] = []  # each item's text or argument fragments so far
        self._open: tuple[str, Any] | None = None  # ("message", None) or ("call", the call's index in the chunk)

    def start(self) -> list[bytes]:
        pending = response({}, self.request, self.id)
        pending.update(status="in_progress", incomplete_details=None, output=[], usage=None)
        return [self._event("response.created", response=pending), self._event("response.in_progress",
                                                                              response=pending)]

    def add(self, chunk: dict[str, Any]) -> list[bytes]:
        frames: list[bytes] = []
        for choice in chunk.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue  # the first choice is the answer, as in a call not streamed
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self._open != ("message", None):
                    frames += self._close_item(None)
                    frames += self._open_item(("message", None), {
                        "type": "message", "id": new_id("msg_"), "status": "in_progress", "role": "assistant",
                        "content": []})
                    frames.append(self._event("response.content_part.added", **self._at(), part={
                        "type": "output_text", "text": "", "annotations": [], "logprobs": []}))
                self._pieces[-1].append(delta["content"])
                frames.append(self._delta("response.output_text.delta", ',"content_index":0,"logprobs":[]',
                                          delta["content"]))
            for call in delta.get("tool_calls") or ():
                key = ("call", call.get("index", 0))
                function = call.get("function") or {}
                if self._open != key:
                    frames += self._close_item(None)
                    frames += self._open_item(key, {
                        "type": "function_call", "id": new_id("fc_"), "call_id": call.get("id") or new_id("call_"),
                        "name": function.get("name"), "arguments": "", "status": "in_progress"})
                if function.get("arguments"):
                    self._pieces[-1].append(function["arguments"])
                    frames.append(self._delta("response.function_call_arguments.delta", "", function["arguments"]))
        return frames

    def end(self, answer: dict[str, Any] | None, error: str | None) -> list[bytes]:
        """The closing frames: of the whole ``answer`` (the chunks assembled), or the ``error`` it broke off with."""
        if error is not None or answer is None:
            return [self._event("error", code="server_error", param=None,
                                message=error or "the policy server's stream had no chunk")]
        done = response(answer, self.request, self.id, [item["id"] for item in self._items])
        frames = self._close_item(done)
        for index in range(len(self._items), len(done["output"])):  # items no chunk showed (an empty message)
            item = done["output"][index]
            if item["type"] == "message":
                frames += self._open_item(("message", None), {**item, "status": "in_progress", "content": []})
                frames.append(self._event("response.content_part.added", **self._at(),
                                          part={**item["content"][0], "text": ""}))
            else:
                frames += self._open_item(("call", index), {**item, "status": "in_progress", "arguments": ""})
            frames += self._close_item(done)
        self.done = done
        kind = "response.completed" if done["status"] == "completed" else "response.incomplete"
        return frames + [self._event(kind, response=done)]

    def _event(self, kind: str, **fields: Any) -> bytes:
        self._sequence += 1
        return server_sent_event(kind, {"type": kind, "sequence_number": self._sequence - 1, **fields})

    def _delta(self, kind: str, fields: str, piece: str) -> bytes:
        """A delta event of the last item (``fields``: its other fields as JSON text), written out: one per token."""
        self._sequence += 1
        return (f'event: {kind}\ndata: {{"type":"{kind}","sequence_number":{self._sequence - 1},'
                f'"item_id":"{self._items[-1]["id"]}","output_index":{len(self._items) - 1}{fields},'
                f'"delta":{json.dumps(piece)}}}\n\n').encode()

    def _at(self) -> dict[str, Any]:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1, "content_index": 0}

    def _open_item(self, key: tuple[str, Any], item: dict[str, Any]) -> list[bytes]:
        self._open = key
        self._items.append(item)
        self._pieces.append([])
        return [self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)]

    def _close_item(self, done: dict[str, Any] | None) -> list[bytes]:
        """The ``….done`` events of the open item: its final form from ``done``, else from what it streamed."""
        if self._open is None:
            return []
        self._open = None
        index = len(self._items) - 1
        item = done["output"][index] if done is not None else self._streamed(index)
        frames = []
        if item["type"] == "message":
            part = item["content"][0]
            frames += [self._event("response.output_text.done", **self._at(), text=part["text"], logprobs=[]),
                       self._event("response.content_part.done", **self._at(), part=part)]
        else:
            frames.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        return frames + [self._event("response.output_item.done", output_index=index, item=item)]

    def _streamed(self, index: int) -> dict[str, Any]:
        """Item ``index`` as its chunks made it (closed by the next item, before the answer is whole)."""
        item, pieces = self._items[index], "".join(self._pieces[index])
        if item["type"] == "message":
            return {**item, "status": "completed",
                    "content": [{"type": "output_text", "text": pieces, "annotations": [], "logprobs": []}]}
        return {**item, "arguments": pieces, "status": "completed"}
