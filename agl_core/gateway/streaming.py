"""Streamed calls: server-sent events in the OpenAI format, read, written, and assembled into one answer.

A streamed ``chat/completions`` or ``completions`` call answers with
``data: <chunk JSON>`` events ending with ``data: [DONE]``. vLLM's OpenAI
server, asked for ``return_token_ids``, puts ``prompt_token_ids`` on the
first chunk (top level for chat, per choice for completions) and each
choice's new ``token_ids`` on every chunk with its log-probs. These functions
read such a stream (:class:`SSEParser`, :func:`sse_batches`), frame events (:func:`sse_event`),
assemble the chunks into the answer a non-streamed call would have got
(:class:`StreamAssembly`), so that the span of a streamed call is made by
the same code from the same fields, and turn a whole answer into chunks
(:func:`chunks_of`) for an upstream that answered a stream request whole.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import anyio

from agl_core.gateway.capture import CHAT
from agl_core.gateway.upstream import Response, UpstreamError, UpstreamTooLarge
from agl_core.http.recordable import loads
from agl_core.http.rules import RequestError

yield_core = getattr(os, "sched_yield", lambda: None)
"""Give this core away once, after a stream's first write (see :class:`EventStreamResponse`)."""

DONE = b"[DONE]"
DONE_EVENT = b"data: [DONE]\n\n"
EVENT_STREAM = "text/event-stream"
EVENT_STREAM_HEADERS = ((b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"))


def sse_event(payload: bytes) -> bytes:
    """One server-sent event whose data is ``payload`` (a JSON text without newlines)."""
    return b"data: " + payload + b"\n\n"


def sse_events(payloads: Iterable[bytes]) -> bytes:
    """:func:`sse_event` of each of ``payloads``, in one bytes."""
    return b"".join([sse_event(payload) for payload in payloads])


class SSEParser:
    """Server-sent events fed as bytes arrive: :meth:`feed` returns the data of each event completed so far.

    Comments (``:``) and fields other than ``data`` are skipped; an event of
    several ``data`` lines is joined with newlines, as the format says. The
    ``[DONE]`` event ends the stream: it is not returned, :attr:`done` turns
    true and later bytes are ignored.
    """

    def __init__(self) -> None:
        self.done = False
        self._partial = b""  # a line not ended yet
        self._data: list[bytes] = []  # the data lines of the event being read

    def feed(self, data: bytes) -> list[bytes]:
        if self.done:
            return []
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        payloads = []
        for raw in lines:
            line = raw[:-1] if raw.endswith(b"\r") else raw
            if line:
                if line.startswith(b"data:"):
                    self._data.append(line[6:] if line[5:6] == b" " else line[5:])
                continue
            if not self._data:
                continue
            payload = b"\n".join(self._data)
            self._data = []
            if payload == DONE:
                self.done = True
                break
            payloads.append(payload)
        return payloads


Batches = AsyncIterator[tuple[list[bytes], bool]]
"""A stream's event data, a batch at a time, each with whether the stream ended with it (``[DONE]`` came)."""


async def sse_batches(response: Response) -> Batches:
    """The data of the events of an upstream's event stream, a batch per read: every event that had arrived.

    Reading what has arrived (not line by line) lets a fast upstream's events go
    on in one write, and costs one wait per read instead of one per line.
    """
    parser = SSEParser()
    while not parser.done:
        data = await response.readany()
        if not data:
            return
        payloads = parser.feed(data)
        if payloads or parser.done:
            yield payloads, parser.done


class StreamAssembly:
    """The chunks of one streamed call of ``endpoint``, assembled into the answer of the same call not streamed.

    :meth:`add` each chunk (a parsed JSON object) in order; :meth:`response`
    is then the ``chat.completion`` or ``text_completion`` object with each
    choice's text (or message with ``tool_calls``), log-probs, ``token_ids``,
    ``finish_reason``, and the call's ``prompt_token_ids``, ``usage`` and any
    other top-level field (``weight_version``). Made from a stream cut short,
    it holds what had arrived.
    """

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.chunks = 0
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        for key, value in chunk.items():
            if key != "choices" and value is not None:
                self._top[key] = value
        for delta in chunk.get("choices") or ():
            index = delta.get("index", 0)
            choice = self._choices.get(index)
            if choice is None:
                choice = self._choices[index] = {"index": index, "text": [], "tool_calls": {}, "token_ids": [],
                                                 "logprobs": None, "finish_reason": None, "extra": {}}
            self._add_choice(choice, delta)

    def _add_choice(self, choice: dict[str, Any], delta: dict[str, Any]) -> None:
        for key, value in delta.items():
            if value is None or key == "index":
                continue
            if key == "token_ids":
                choice["token_ids"].extend(value)
            elif key == "logprobs":
                choice["logprobs"] = _merge_logprobs(choice["logprobs"], value)
            elif key == "finish_reason":
                choice["finish_reason"] = value
            elif key == "delta":  # chat
                self._add_message(choice, value)
            elif key == "text":  # completions
                choice["text"].append(value)
            else:  # prompt_token_ids (completions), stop_reason, ...
                choice["extra"][key] = value

    @staticmethod
    def _add_message(choice: dict[str, Any], delta: dict[str, Any]) -> None:
        if delta.get("role"):
            choice["extra"]["role"] = delta["role"]
        if delta.get("content"):
            choice["text"].append(delta["content"])
        for call in delta.get("tool_calls") or ():
            slot = choice["tool_calls"].setdefault(call.get("index", len(choice["tool_calls"])),
                                                   {"id": None, "type": "function", "name": [], "arguments": []})
            if call.get("id"):
                slot["id"] = call["id"]
            if call.get("type"):
                slot["type"] = call["type"]
            function = call.get("function") or {}
            if function.get("name"):
                slot["name"].append(function["name"])
            if function.get("arguments"):
                slot["arguments"].append(function["arguments"])

    def response(self) -> dict[str, Any]:
        """The assembled answer (see the class)."""
        chat = self.endpoint == CHAT
        out = {**self._top, "object": "chat.completion" if chat else "text_completion"}
        choices = []
        for index in sorted(self._choices):
            choice = self._choices[index]
            extra = dict(choice["extra"])
            text = "".join(choice["text"])
            made: dict[str, Any] = {"index": index}
            if chat:
                message: dict[str, Any] = {"role": extra.pop("role", "assistant"),
                                           "content": text if text or not choice["tool_calls"] else None}
                if choice["tool_calls"]:
                    message["tool_calls"] = [
                        {"id": call["id"], "type": call["type"],
                         "function": {"name": "".join(call["name"]), "arguments": "".join(call["arguments"])}}
                        for _, call in sorted(choice["tool_calls"].items())]
                made["message"] = message
            else:
                made["text"] = text
            made.update(logprobs=choice["logprobs"], finish_reason=choice["finish_reason"],
                        token_ids=choice["token_ids"], **extra)
            choices.append(made)
        out["choices"] = choices
        return out


def _merge_logprobs(into: dict[str, Any] | None, more: dict[str, Any]) -> dict[str, Any]:
    """Log-prob objects of consecutive chunks as one: their per-token lists concatenated."""
    if into is None:
        return {key: list(value) if isinstance(value, list) else value for key, value in more.items()}
    for key, value in more.items():
        if isinstance(value, list) and isinstance(into.get(key), list):
            into[key].extend(value)
        elif key not in into or into[key] is None:
            into[key] = list(value) if isinstance(value, list) else value
    return into


def chunks_of(endpoint: str, response: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A whole answer of ``endpoint`` as the chunks of a stream, in vLLM's layout (see the module).

    Chat: per choice, a first chunk with the role (the call's first chunk
    carrying ``prompt_token_ids``), then one with the whole content, tool
    calls, log-probs, token ids and finish reason. Completions: one chunk per
    choice. With ``include_usage``, a last chunk with no choices and the usage.
    :class:`StreamAssembly` makes ``response`` back from them.
    """
    top = {key: value for key, value in response.items()
           if key not in ("choices", "usage", "object", "prompt_token_ids")}
    chunks = []
    if endpoint == CHAT:
        top["object"] = "chat.completion.chunk"
        for choice in response.get("choices") or ():
            message = choice.get("message") or {}
            first: dict[str, Any] = {**top, "choices": [{"index": choice.get("index", 0),
                                                         "delta": {"role": message.get("role", "assistant"),
                                                                   "content": ""},
                                                         "logprobs": None, "finish_reason": None}]}
            if not chunks and response.get("prompt_token_ids") is not None:
                first["prompt_token_ids"] = response["prompt_token_ids"]
            delta: dict[str, Any] = {"content": message.get("content") or ""}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            rest = {key: value for key, value in choice.items() if key not in ("index", "message")}
            chunks += [first, {**top, "choices": [{"index": choice.get("index", 0), "delta": delta, **rest}]}]
    else:
        top["object"] = "text_completion"
        chunks = [{**top, "choices": [choice]} for choice in response.get("choices") or ()]
    if include_usage and response.get("usage") is not None:
        chunks.append({**top, "choices": [], "usage": response["usage"]})
    return chunks


def check_stream_fields(body: dict[str, Any]) -> None:
    """RequestError 400 naming ``stream`` or ``stream_options`` when a request sets them to something else than
    a boolean and an object with a boolean ``include_usage``."""
    if not isinstance(body.get("stream", False), bool | None):
        raise RequestError(400, f"'stream' must be true or false, got {type(body['stream']).__name__}")
    options = body.get("stream_options")
    if options is None:
        return
    if not isinstance(options, dict):
        raise RequestError(400, f"'stream_options' must be an object, got {type(options).__name__}")
    if not isinstance(options.get("include_usage", False), bool | None):
        raise RequestError(400, "'stream_options.include_usage' must be true or false")


def include_usage(body: dict[str, Any]) -> bool:
    """Whether a streamed request asks for the usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes, as chunks are sent."""
    return json.dumps(obj, separators=(",", ":")).encode()


class Chunk:
    """One chunk of a relayed stream: ``raw``, the JSON bytes as the upstream sent them; ``data``, parsed on first use.

    The chat route relays ``raw`` and never parses a chunk on its way: the
    stream's chunks are parsed together when it closes (ValueError from
    ``data`` when a chunk is not a JSON object).
    """

    __slots__ = ("raw", "_data")

    def __init__(self, raw: bytes):
        self.raw, self._data = raw, None

    @property
    def data(self) -> dict[str, Any]:
        if self._data is None:
            data, _ = loads(self.raw)
            if not isinstance(data, dict):
                raise ValueError("a chunk is not a JSON object")
            self._data = data
        return self._data


class CallStream:
    """A streamed model call being relayed: iterate its :class:`Chunk` s, then :meth:`close` it, always.

    ``async for chunk in stream`` gives the chunks one by one;
    :meth:`next_batch` gives every chunk that has arrived (fewer writes when
    the upstream is fast). :meth:`assemble` adds the chunks come so far to
    :attr:`assembly`; :meth:`close` adds the rest, then ``on_close(self)``
    records the call; it runs once,
    shielded from the cancellation of a client that went away. By then
    :attr:`ended` says whether the upstream's stream reached its end (else
    the consumer stopped early: the call is incomplete) and :attr:`error` why
    it broke off, if it did. ``release(drain=...)`` (:meth:`Response.release
    <agl_core.gateway.upstream.Response.release>`) lets the upstream
    connection go: an unfinished upstream stops generating, one whose stream
    ended keeps its connection for the next call.
    """

    def __init__(self, endpoint: str, batches: Batches,
                 on_close: Callable[[CallStream], Awaitable[None]], release: Callable[..., Any] | None = None):
        self.endpoint = endpoint
        self.assembly = StreamAssembly(endpoint)
        self.ended = False
        self.error: str | None = None
        self.record_error: str | None = None  # set by on_close when the call could not be recorded
        self._batches, self._on_close, self._release = batches, on_close, release
        self._chunks: list[Chunk] = []
        self._assembled = 0  # how many of _chunks are in the assembly
        self._bad_chunk = False  # a chunk that is not a JSON object came: the assembly stopped before it
        self._pending: collections.deque[Chunk] = collections.deque()
        self._closed = False

    def __aiter__(self) -> CallStream:
        return self

    async def __anext__(self) -> Chunk:
        if not self._pending:
            self._pending.extend(await self.next_batch())
            if not self._pending:
                raise StopAsyncIteration
        return self._pending.popleft()

    async def next_batch(self) -> list[Chunk]:
        """The chunks that have arrived (waiting for at least one); [] once the stream ended or broke off.

        :attr:`ended` turns true with the batch the upstream's stream ended with.
        """
        if self.ended or self.error is not None:
            return []
        try:
            raws, self.ended = await self._batches.__anext__()
            chunks = [Chunk(raw) for raw in raws]
        except StopAsyncIteration:
            self.ended = True
            return []
        except TimeoutError:
            self.error = "the policy server did not finish its stream in time"
            return []
        except UpstreamTooLarge as exc:
            self.error = f"the policy server's stream was cut: {exc}"
            return []
        except UpstreamError as exc:
            self.error = f"the policy server broke off its stream: {exc}"
            return []
        self._chunks += chunks
        return chunks

    def assemble(self) -> None:
        """Add the chunks not assembled yet to :attr:`assembly`, in order, parsing those not parsed in one go.

        A relay calls it after each write: the work is done while the upstream
        makes the next tokens, so that the end of the stream (where the call is
        recorded before the client's last event) finds little left to do, and
        never between a chunk's arrival and its write. :meth:`close` adds the rest.
        """
        chunks = self._chunks[self._assembled:]
        if not chunks or self._bad_chunk:
            return
        unparsed = [chunk for chunk in chunks if chunk._data is None]
        if unparsed:
            try:
                values, _ = loads(b"[" + b",".join(chunk.raw for chunk in unparsed) + b"]")
            except ValueError:
                values = None
            if values is not None and len(values) == len(unparsed) and all(isinstance(v, dict) for v in values):
                for chunk, value in zip(unparsed, values):
                    chunk._data = value
        for chunk in chunks:
            try:
                data = chunk.data
            except ValueError:  # one at a time finds the first bad one
                self._bad_chunk = True
                return
            self.assembly.add(data)
            self._assembled += 1

    async def close(self) -> None:
        """Release the upstream and record the call (once); safe to call from a cancelled task."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            if self._release is not None:
                self._release(drain=self.ended)  # a stream read to its end keeps its connection
            self.assemble()
            if self._bad_chunk:
                self.error = "the policy server streamed a chunk that is not a JSON object"
            await self._on_close(self)


class EventStreamResponse:
    """The ASGI response relaying a :class:`CallStream` to the client as server-sent events.

    Each chunk goes out as it arrives, but a chat stream's first chunk when
    it came alone (the role's, no token yet, in vLLM's layout) waits for the
    next, so that the client wakes once for it and the first token, not
    twice, which on busy cores is what the first token waits for. After the
    first write the relay gives its core away once (``sched_yield``): the
    scheduler tends to wake a reader on its writer's core, so the agent just
    woken for its first token would otherwise wait there while the relay goes
    on with the rest of a fast stream (on 2 busy cores that wait was most of
    the first token's time through the gateway; on an idle machine the call
    returns at once). At the end the call is recorded before the last event (``[DONE]``, or an error event
    when the upstream broke off or the store could not record), so a client
    that saw the end of the stream sees a recorded call; the chunks that came
    with the upstream's end go out with it, in one write. A client that
    disconnects cancels the relay: the stream is closed then, and its call
    recorded as incomplete.

    The relay is one loop for every API: a subclass that speaks another
    (:class:`agl_core.gateway.api_routes.TranslatedEventStream`) gives its
    own frames for the opening, each batch and the closing.
    """

    def __init__(self, stream: CallStream):
        self.stream = stream

    async def __call__(self, scope, receive, send) -> None:
        # The relay runs in this task; a watcher cancels it when the client disconnects (what Starlette's
        # StreamingResponse does with a task group, for one task less per call).
        relay = asyncio.current_task()
        done = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not done:
                relay.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not watcher.done():
                raise
            # The client left: the stream was closed and recorded incomplete; there is no one to answer.
        finally:
            done = True
            watcher.cancel()

    async def _relay(self, send) -> None:
        stream = self.stream
        await send({"type": "http.response.start", "status": 200, "headers": EVENT_STREAM_HEADERS})
        frames: list[bytes] = []  # what goes out with the next write (see the class)
        try:
            frames = self._opening()
            first, yielded = True, False
            while batch := await stream.next_batch():
                self._add_frames(frames, batch)
                held = stream.ended or (first and len(batch) == 1 and self._holds_first())
                first = False
                if frames and not held:
                    await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                    frames = []
                    if not yielded:
                        yielded = True
                        yield_core()
                    stream.assemble()
        except ValueError:
            pass  # a chunk that is not a JSON object (a translation reads each): closing the stream finds it
        finally:
            await stream.close()
        await send({"type": "http.response.body", "body": b"".join(frames + self._closing()), "more_body": False})

    def _opening(self) -> list[bytes]:
        """The frames before any chunk's."""
        return []

    def _add_frames(self, frames: list[bytes], batch: list[Chunk]) -> None:
        """Add the frames of a batch of chunks to ``frames`` (those of the chunks before one that fails stay)."""
        frames.append(sse_events(chunk.raw for chunk in batch))

    def _holds_first(self) -> bool:
        """Whether a first chunk that came alone waits for the next (a chat stream's role chunk: see the class)."""
        return self.stream.endpoint == CHAT

    def _closing(self) -> list[bytes]:
        """The last frames, once the stream is closed and its call recorded."""
        error = self.stream.error or self.stream.record_error
        if error is None:
            return [DONE_EVENT]
        return [sse_event(dumps({"error": {"message": error, "type": "server_error", "code": 502}})), DONE_EVENT]


async def one_batch(items: list[bytes]) -> Batches:
    """``items`` as a stream's one and last batch (the chunks of an answer that came whole)."""
    yield items, True
