"""A tiny OpenAI-compatible policy endpoint with deterministic token ids, for CPU tests only.

It stands in for a served model (vLLM, the embedded backend) so that the
gateway, the stores and the runner can be tested end to end without one. It
speaks ``POST /v1/chat/completions`` and ``POST /v1/completions`` with vLLM's
extensions: ``return_token_ids`` (``prompt_token_ids`` and per-choice
``token_ids``) and ``logprobs``.

Everything is a pure function of the request: the tokenizer maps each UTF-8
byte ``b`` to id ``b + 3`` (:class:`ByteTokenizer`), a chat prompt is
rendered by :meth:`ByteTokenizer.chat_prompt`, the reply is ``"echo: "``
followed by the last user message (or the prompt; for chat, the last message
when it is a tool result) cut to ``max_tokens`` tokens, and the log-prob of
the ``i``-th response token ``t`` is ``-((t + i) % 10 + 1) / 10``.

Tool calls: a chat request with ``tools`` (and ``tool_choice`` not
``"none"``) whose last message is the user's is answered with a call of the
first tool (or the one ``tool_choice`` names) with arguments ``{"text": <the
user's message>}``. Its tokens are the Hermes text
``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; the message has
``content: null``, the ``tool_calls`` and finish reason ``"tool_calls"``, as
vLLM's tool parser answers. Tools, tool calls and tool results are rendered
into the next prompt so that it extends the previous prompt and response.

A completions ``prompt`` may be a list of token ids, as vLLM takes it (the
reply then echoes their text).
Scoring: a completions request with ``prompt_logprobs`` (vLLM's extension)
and a ``prompt`` of token ids, or a list of such lists, is answered with one
choice per prompt holding ``prompt_logprobs``: None for the first token,
then ``{str(id): {"logprob", "rank": 1, "decoded_token"}}`` with the
log-prob of the ``i``-th token ``t`` given by the same formula.

``stream: true`` answers with server-sent events the way vLLM does: for chat,
a first chunk per choice with the role (and, on the call's first chunk,
``prompt_token_ids``), then one chunk per token with its text, its
``token_ids`` and log-probs, the last one with the finish reason (a tool call
streams its id and name on its first token and its arguments on its last);
for completions, one chunk per token with ``prompt_token_ids`` on each
choice's first. With ``stream_options.include_usage``, a last chunk has no
choices and the usage; then ``data: [DONE]``.

Knobs for tests: ``fail_next`` (statuses to answer the next calls with, e.g.
``[503, 429]``), ``delay_s`` (sleep before answering), ``token_delay_s``
(sleep between streamed chunks), ``requests`` (the last bodies received),
``streams_cut`` (streams whose client left before their end). Run it alone
with ``python -m agl_core.testing.endpoint --port 0 [--token-delay-s S]``; it prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl_core.http.server import ServerThread


class ByteTokenizer:
    """UTF-8 bytes as token ids: id = byte + 3 (0, 1, 2 are pad, bos, eos)."""

    OFFSET = 3
    EOS = 2

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        # Ids past the bytes (a token prompt made by another tokenizer) have no text here.
        return bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET).decode("utf-8",
                                                                                                 errors="replace")

    def token_text(self, token_id: int) -> str:
        return bytes([token_id - self.OFFSET]).decode("latin-1")

    @staticmethod
    def chat_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template: ``<|tools|>`` and the tools as JSON when given, then per message
        ``<|role|>content`` + its tool calls (:func:`tool_call_text`) + ``\\n``, then ``<|assistant|>``."""
        head = f"<|tools|>{json.dumps(tools)}\n" if tools else ""
        return head + "".join(f"<|{m.get('role', 'user')}|>{message_text(m)}"
                              f"{''.join(tool_call_text(c) for c in m.get('tool_calls') or ())}\n"
                              for m in messages) + "<|assistant|>"


def tool_call_text(call: dict[str, Any]) -> str:
    """An OpenAI tool call as the Hermes text the model writes: ``<tool_call>{"name", "arguments"}</tool_call>``."""
    function = call.get("function") or {}
    arguments = function.get("arguments") or "{}"
    arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    return f"<tool_call>{json.dumps({'name': function.get('name'), 'arguments': arguments})}</tool_call>"


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message whose content is a string or a list of text parts."""
    content = message.get("content") or ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def response_logprob(token_id: int, position: int) -> float:
    return -((token_id + position) % 10 + 1) / 10


class TestEndpoint:
    """The ASGI app and its knobs; :meth:`serve` runs it on a background thread."""

    __test__ = False  # not a pytest test class

    def __init__(self, delay_s: float = 0.0):
        self.tokenizer = ByteTokenizer()
        self.delay_s = delay_s
        self.fail_next: deque[int] = deque()
        self.requests: deque[dict[str, Any]] = deque(maxlen=1000)
        self.calls = 0
        self.weight_version: int | None = None  # reported in answers when set, as the embedded backend does
        self.token_delay_s = 0.0
        self.streams_cut = 0
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
        ])

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
        """Start serving; the returned server's ``url + "/v1"`` is the base URL for clients."""
        return ServerThread(self.app, host, port, name="agl-test-endpoint").start()

    async def _receive(self, request: Request) -> dict[str, Any] | Response:
        self.calls += 1
        try:
            body = json.loads(await request.body())
        except ValueError:
            return JSONResponse({"error": {"message": "body is not JSON"}}, status_code=400)
        self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_next:
            status = self.fail_next.popleft()
            return JSONResponse({"error": {"message": f"injected failure {status}"}}, status_code=status)
        return body

    def _reply(self, body: dict[str, Any], text: str) -> tuple[list[int], str]:
        return self._cut(body, self.tokenizer.encode(f"echo: {text}"))

    async def chat_completions(self, request: Request) -> Response | EventStream:
        body = await self._receive(request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages") or []
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        prompt_ids = self.tokenizer.encode(self.tokenizer.chat_prompt(messages, body.get("tools")))
        last = messages[-1] if messages else {}
        call = None
        if tools and last.get("role") == "user":
            call = self._tool_call(tools, body.get("tool_choice"), message_text(last))
            ids, finish_reason = self._cut(body, self.tokenizer.encode(tool_call_text(call)))
            if finish_reason == "length":  # a call cut short is no call: its text is the answer
                call = None
            else:
                finish_reason = "tool_calls"
        else:
            source = last if last.get("role") == "tool" else \
                next((m for m in reversed(messages) if m.get("role") == "user"), {})
            ids, finish_reason = self._reply(body, message_text(source))
        if body.get("stream"):
            return self._stream(body, self._chat_chunks(body, prompt_ids, ids, finish_reason, call))
        choices = []
        for index in range(body.get("n") or 1):
            message: dict[str, Any] = {"role": "assistant",
                                       "content": None if call else self.tokenizer.decode(ids)}
            if call:
                message["tool_calls"] = [call]
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "message": message,
                                      "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [self._chat_logprob(t, i) for i, t in enumerate(ids)]}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        out: dict[str, Any] = self._envelope("chat.completion", body, choices, len(prompt_ids), len(ids))
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt_ids
        return JSONResponse(out)

    def _tool_call(self, tools: list[dict[str, Any]], tool_choice: Any, text: str) -> dict[str, Any]:
        named = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
        name = named or (tools[0].get("function") or {}).get("name")
        return {"id": f"call_{self.calls}", "type": "function",
                "function": {"name": name, "arguments": json.dumps({"text": text})}}

    def _chat_logprob(self, token_id: int, position: int) -> dict[str, Any]:
        return {"token": self.tokenizer.token_text(token_id), "logprob": response_logprob(token_id, position),
                "top_logprobs": []}

    def _chat_chunks(self, body: dict[str, Any], prompt_ids: list[int], ids: list[int], finish_reason: str,
                     call: dict[str, Any] | None):
        """The chunks of a streamed chat answer, in vLLM's order (see the module); a generator of dicts."""
        n = body.get("n") or 1
        chunk = self._chunk_envelope("chat.completion.chunk", body)
        for index in range(n):
            first = {**chunk, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                           "logprobs": None, "finish_reason": None}]}
            if index == 0 and body.get("return_token_ids"):
                first["prompt_token_ids"] = prompt_ids
            yield first
        decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]
        for position, token in enumerate(ids):
            last = position == len(ids) - 1
            for index in range(n):
                delta: dict[str, Any] = {}
                if call is None:
                    delta["content"] = decoders[index].decode(bytes([token - ByteTokenizer.OFFSET]), final=last)
                elif position == 0:
                    delta["tool_calls"] = [{"index": 0, "id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}]
                elif last:
                    delta["tool_calls"] = [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]
                choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None,
                                          "finish_reason": finish_reason if last else None}
                if body.get("logprobs"):
                    choice["logprobs"] = {"content": [self._chat_logprob(token, position)]}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [token]
                yield {**chunk, "choices": [choice]}
        yield from self._usage_chunk(chunk, body, len(prompt_ids), len(ids) * n)

    def _completion_chunks(self, body: dict[str, Any], prompt_ids: list[int], ids: list[int], finish_reason: str):
        n = body.get("n") or 1
        chunk = self._chunk_envelope("text_completion", body)
        decoders = [codecs.getincrementaldecoder("utf-8")(errors="replace") for _ in range(n)]
        for position, token in enumerate(ids):
            last = position == len(ids) - 1
            for index in range(n):
                choice: dict[str, Any] = {"index": index,
                                          "text": decoders[index].decode(bytes([token - ByteTokenizer.OFFSET]),
                                                                         final=last),
                                          "logprobs": None, "finish_reason": finish_reason if last else None}
                if body.get("logprobs") is not None:
                    choice["logprobs"] = {"tokens": [self.tokenizer.token_text(token)],
                                          "token_logprobs": [response_logprob(token, position)],
                                          "top_logprobs": None, "text_offset": [position]}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [token]
                    if position == 0:
                        choice["prompt_token_ids"] = prompt_ids
                yield {**chunk, "choices": [choice]}
        yield from self._usage_chunk(chunk, body, len(prompt_ids), len(ids) * n)

    def _chunk_envelope(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        envelope = {"id": f"cmpl-{self.calls}", "object": kind, "created": int(time.time()),
                    "model": body.get("model", "test")}
        if self.weight_version is not None:
            envelope["weight_version"] = self.weight_version
        return envelope

    @staticmethod
    def _usage_chunk(chunk: dict[str, Any], body: dict[str, Any], n_prompt: int, n_completion: int):
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            yield {**chunk, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                                                     "total_tokens": n_prompt + n_completion}}

    def _stream(self, body: dict[str, Any], chunks) -> EventStream:
        return EventStream(self, chunks)

    def _cut(self, body: dict[str, Any], ids: list[int]) -> tuple[list[int], str]:
        """``ids`` cut to the request's token limit, and the finish reason."""
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if max_tokens is not None and len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    async def completions(self, request: Request) -> Response | EventStream:
        body = await self._receive(request)
        if isinstance(body, Response):
            return body
        if body.get("prompt_logprobs") is not None:
            return JSONResponse(self._scored(body))
        prompt = body.get("prompt") or ""
        if isinstance(prompt, list):  # token ids, as vLLM takes them (the gateway's exact contexts)
            prompt_ids, prompt = list(prompt), self.tokenizer.decode(prompt)
        else:
            prompt_ids = self.tokenizer.encode(prompt)
        ids, finish_reason = self._reply(body, prompt)
        if body.get("stream"):
            return self._stream(body, self._completion_chunks(body, prompt_ids, ids, finish_reason))
        choices = []
        for index in range(body.get("n") or 1):
            choice: dict[str, Any] = {"index": index, "text": self.tokenizer.decode(ids),
                                      "finish_reason": finish_reason, "logprobs": None}
            if body.get("logprobs") is not None:
                choice["logprobs"] = {"tokens": [self.tokenizer.token_text(t) for t in ids],
                                      "token_logprobs": [response_logprob(t, i) for i, t in enumerate(ids)],
                                      "top_logprobs": None, "text_offset": list(range(len(ids)))}
            if body.get("return_token_ids"):
                choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, ids
            choices.append(choice)
        return JSONResponse(self._envelope("text_completion", body, choices, len(prompt_ids), len(ids)))

    def _scored(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        prompts = prompt if prompt and isinstance(prompt[0], list) else [prompt]
        choices = [{"index": index, "text": "", "finish_reason": "length", "logprobs": None, "token_ids": [],
                    "prompt_token_ids": ids,
                    "prompt_logprobs": [None] + [{str(t): {"logprob": response_logprob(t, i), "rank": 1,
                                                           "decoded_token": self.tokenizer.token_text(t)}}
                                                 for i, t in enumerate(ids) if i > 0]}
                   for index, ids in enumerate(prompts)]
        return self._envelope("text_completion", body, choices, sum(map(len, prompts)), 0)

    def _envelope(self, kind: str, body: dict[str, Any], choices: list[dict[str, Any]],
                  n_prompt: int, n_response: int) -> dict[str, Any]:
        n_completion = n_response * len(choices)
        envelope = {"id": f"cmpl-{self.calls}", "object": kind, "created": int(time.time()),
                    "model": body.get("model", "test"), "choices": choices,
                    "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
                              "total_tokens": n_prompt + n_completion}}
        if self.weight_version is not None:
            envelope["weight_version"] = self.weight_version
        return envelope

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "test", "object": "model"}]})


class EventStream:
    """The ASGI response streaming ``chunks`` (dicts) as server-sent events: one write per chunk, as vLLM writes one
    per token, its JSON compact as vLLM's; the endpoint's ``token_delay_s`` between chunks.

    A raw ASGI response rather than Starlette's ``StreamingResponse``: the test endpoint stands for a policy server
    whose streaming costs little next to the gateway it is used to measure. A client that leaves stops the stream
    at its next chunk and counts in the endpoint's ``streams_cut``.
    """

    def __init__(self, endpoint: TestEndpoint, chunks: Iterator[dict[str, Any]]):
        self.endpoint, self.chunks = endpoint, chunks

    async def __call__(self, scope, receive, send) -> None:
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True

        watcher = asyncio.get_running_loop().create_task(watch())
        complete = False
        try:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})
            for sent, chunk in enumerate(self.chunks):
                if sent and self.endpoint.token_delay_s:
                    await asyncio.sleep(self.endpoint.token_delay_s)
                if left:
                    return
                await send({"type": "http.response.body", "more_body": True,
                            "body": b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
            complete = True
        finally:
            watcher.cancel()
            if not complete:
                self.endpoint.streams_cut += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="pause between streamed chunks")
    args = parser.parse_args()
    endpoint = TestEndpoint()
    endpoint.token_delay_s = args.token_delay_s
    server = endpoint.serve(args.host, args.port)
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
