"""A tiny OpenAI-compatible policy endpoint with deterministic token ids, for CPU tests only.

It stands in for a served model (vLLM, the embedded backend) so that the
gateway, the stores and the runner can be tested end to end without one. It
speaks ``POST /v1/chat/completions`` and ``POST /v1/completions`` with vLLM's
extensions: ``return_token_ids`` (``prompt_token_ids`` and per-choice
``token_ids``) and ``logprobs``.

Everything is a pure function of the request: the tokenizer maps each UTF-8
byte ``b`` to id ``b + 3`` (:class:`ByteTokenizer`), a chat prompt is
rendered by :meth:`ByteTokenizer.chat_prompt`, the reply is ``"echo: "``
followed by the last user message (or the prompt) cut to ``max_tokens``
tokens, and the log-prob of the ``i``-th response token ``t`` is
``-((t + i) % 10 + 1) / 10``.

Knobs for tests: ``fail_next`` (statuses to answer the next calls with, e.g.
``[503, 429]``), ``delay_s`` (sleep before answering), ``requests`` (the last
bodies received). Run it alone with ``python -m agl_core.testing_endpoint
--port 0``; it prints its URL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import deque
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl_core.http_server import ServerThread


class ByteTokenizer:
    """UTF-8 bytes as token ids: id = byte + 3 (0, 1, 2 are pad, bos, eos)."""

    OFFSET = 3
    EOS = 2

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - self.OFFSET for i in ids if i >= self.OFFSET).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        return bytes([token_id - self.OFFSET]).decode("latin-1")

    @staticmethod
    def chat_prompt(messages: list[dict[str, Any]]) -> str:
        """The chat template: ``<|role|>content\\n`` per message, then ``<|assistant|>``."""
        return "".join(f"<|{m.get('role', 'user')}|>{message_text(m)}\n" for m in messages) + "<|assistant|>"


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
        ids = self.tokenizer.encode(f"echo: {text}")
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        if max_tokens is not None and len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        return ids, "stop"

    async def chat_completions(self, request: Request) -> Response:
        body = await self._receive(request)
        if isinstance(body, Response):
            return body
        messages = body.get("messages") or []
        prompt_ids = self.tokenizer.encode(self.tokenizer.chat_prompt(messages))
        last_user = next((message_text(m) for m in reversed(messages) if m.get("role") == "user"), "")
        ids, finish_reason = self._reply(body, last_user)
        choices = []
        for index in range(body.get("n") or 1):
            choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": self.tokenizer.decode(ids)},
                                      "logprobs": None}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": [
                    {"token": self.tokenizer.token_text(t), "logprob": response_logprob(t, i), "top_logprobs": []}
                    for i, t in enumerate(ids)]}
            if body.get("return_token_ids"):
                choice["token_ids"] = ids
            choices.append(choice)
        out: dict[str, Any] = self._envelope("chat.completion", body, choices, len(prompt_ids), len(ids))
        if body.get("return_token_ids"):
            out["prompt_token_ids"] = prompt_ids
        return JSONResponse(out)

    async def completions(self, request: Request) -> Response:
        body = await self._receive(request)
        if isinstance(body, Response):
            return body
        prompt = body.get("prompt") or ""
        prompt_ids = self.tokenizer.encode(prompt)
        ids, finish_reason = self._reply(body, prompt)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = TestEndpoint().serve(args.host, args.port)
    print(server.url, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
