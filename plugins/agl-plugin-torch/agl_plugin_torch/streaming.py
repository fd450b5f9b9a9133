"""A streamed answer of the policy endpoint: a chunk per token as the engine generates it, in vLLM's layout.

The engine calls back, from its thread, each time a row of the request gets
a token (:meth:`TokenStream.on_token`); the server's event loop turns each
into a chunk with the token's id and log-prob (and its text), then, once the
request is done, sends per choice a last chunk with the rest of the text (or
the tool calls) and the finish reason, the usage chunk when asked, and
``[DONE]``. The chunks assemble into the answer of the same call not streamed
(:class:`agl_core.gateway.streaming.StreamAssembly`).

Text goes out as soon as no stop string can still cut it (the last
``len(longest stop) - 1`` characters wait) and no character is half decoded.
With tools offered, the text waits for the end: the answer may be a call.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from agl_core.gateway.streaming import DONE_EVENT, dumps, sse_event

from agl_plugin_torch.sampling import Sample

_END = object()


class TextDeltas:
    """The text of one row as its tokens come: what can be sent now, and the rest at the end."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def add(self, token_ids: list[int]) -> str:
        """The text to send after the row's tokens so far ("" to wait).

        Text a stop string could still begin is held back; once a stop string
        appears, the text up to it is all there is (the row stops there).
        """
        text = self.decode(token_ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            safe = text[:cut]
        else:
            safe = text[:len(text) - self.hold] if self.hold else text
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent) or safe.endswith("\ufffd"):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def rest(self, final: str) -> str:
        """What is left to send of the row's final text."""
        return final[len(self.sent):] if final.startswith(self.sent) else ""


class TokenStream:
    """The events of one streamed request; ``finish(generated)`` builds the whole answer to end the stream with.

    ``chat``: chat chunks (else text completion chunks). ``token_text(id)``
    names a token in the log-probs. ``stream_text``: send text as it comes
    (False when tools are offered).
    """

    def __init__(self, body: dict[str, Any], chat: bool, prompt_ids: list[int], n: int, stop: tuple[str, ...],
                 decode: Callable[[list[int]], str], token_text: Callable[[int], str], stream_text: bool,
                 model: str):
        self.body, self.chat, self.prompt_ids, self.n = body, chat, prompt_ids, n
        self.token_text, self.stream_text = token_text, stream_text
        self.deltas = [TextDeltas(decode, stop) for _ in range(n)]
        self.ids: list[list[int]] = [[] for _ in range(n)]
        self.envelope = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                         "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": int(time.time()), "model": model}
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    # -------------------------------------------------------- the engine's side (its thread)

    def on_token(self, row: int, sample: Sample) -> None:
        """The engine's callback: the row's new token, read now (the sample grows after)."""
        top = sample.top_logprobs[-1] if sample.top_logprobs else None
        self._put((row, sample.token_ids[-1], sample.logprobs[-1], top))

    def on_done(self, future: Future) -> None:
        """The future's done callback: it runs after the request's last ``on_token``."""
        self._put(_END)

    def _put(self, item: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the server's loop is gone (it stopped): no one reads this stream any more
            pass

    # -------------------------------------------------------- the server's side (its event loop)

    async def events(self, future: Future, finish: Callable[[Any], dict[str, Any]]) -> AsyncIterator[bytes]:
        """The server-sent events: first chunks, a chunk per token, then the ends built from ``finish(generated)``."""
        if self.chat:
            for index in range(self.n):
                first = {**self.envelope, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}
                if index == 0:
                    first["prompt_token_ids"] = self.prompt_ids
                yield sse_event(dumps(first))
        while (item := await self._queue.get()) is not _END:
            yield sse_event(dumps({**self.envelope, "choices": [self._token_choice(*item)]}))
        try:
            answer = finish(future.result())
        except Exception as exc:  # noqa: BLE001 - the stream has started: the error goes as an event
            yield sse_event(dumps({"error": {"message": f"generation failed: {exc!r}", "type": "server_error",
                                             "code": 500}})) + DONE_EVENT
            return
        ends = {"weight_version": answer.get("weight_version")}
        for choice in answer["choices"]:
            yield sse_event(dumps({**self.envelope, **ends, "choices": [self._last_choice(choice)]}))
        options = self.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            yield sse_event(dumps({**self.envelope, **ends, "choices": [], "usage": answer["usage"]}))
        yield DONE_EVENT

    def _token_choice(self, row: int, token: int, logprob: float, top: list[tuple[int, float]] | None):
        ids = self.ids[row]
        ids.append(token)
        text = self.deltas[row].add(ids) if self.stream_text else ""
        name = self.token_text(token)
        if self.chat:
            alternatives = [logprob_entry(self.token_text(t), lp) for t, lp in top or ()]
            return {"index": row, "delta": {"content": text} if text else {},
                    "logprobs": {"content": [{**logprob_entry(name, logprob), "top_logprobs": alternatives}]},
                    "finish_reason": None, "token_ids": [token]}
        choice = {"index": row, "text": text, "finish_reason": None, "token_ids": [token],
                  "logprobs": {"tokens": [name], "token_logprobs": [logprob],
                               "top_logprobs": [{self.token_text(t): lp for t, lp in top}] if top else None}}
        if len(ids) == 1:
            choice["prompt_token_ids"] = self.prompt_ids
        return choice

    def _last_choice(self, choice: dict[str, Any]) -> dict[str, Any]:
        """The end of a choice of the whole answer: the text not sent yet (or the tool calls), the finish reason."""
        index = choice["index"]
        if not self.chat:
            out = {"index": index, "text": self.deltas[index].rest(choice["text"]), "logprobs": None,
                   "finish_reason": choice["finish_reason"]}
            if not self.ids[index]:  # no token came: the prompt's ids go with the end
                out["prompt_token_ids"] = self.prompt_ids
            return out
        message = choice["message"]
        delta: dict[str, Any] = {}
        rest = self.deltas[index].rest(message.get("content") or "")
        if rest:
            delta["content"] = rest
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": choice["finish_reason"]}


def logprob_entry(text: str, logprob: float) -> dict[str, Any]:
    """A token's entry in chat log-probs: its text, log-prob and UTF-8 bytes."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
