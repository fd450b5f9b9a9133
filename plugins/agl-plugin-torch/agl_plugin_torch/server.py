"""The policy endpoint: an OpenAI-compatible HTTP server in front of the engine.

``POST /v1/chat/completions`` and ``POST /v1/completions`` answer like vLLM
with ``return_token_ids``, whatever the request asks: ``prompt_token_ids``
(top level for chat, per choice for completions), ``choices[].token_ids`` and
``choices[].logprobs`` (the sampled tokens' log-probs, with
``top_logprobs`` alternatives when asked). Every response also carries
``weight_version``, the number of the actor update whose weights produced it
(0: the initial weights). ``GET /v1/models`` lists the one model.

Sampling parameters: ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0: greedy), ``top_p``, ``top_k``, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``seed``, ``n``; streaming is refused.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from transformers import PreTrainedTokenizerBase

from agl_core.http_server import ServerThread

from agl_plugin_torch.engine import Engine, Generated
from agl_plugin_torch.sampling import SamplingParams
from agl_plugin_torch.settings import ServingConfig


class BadRequest(Exception):
    """A request the server refuses with 400 and this message."""


def error_response(status: int, message: str) -> JSONResponse:
    """An error in the OpenAI format, so the openai client raises with ``message``."""
    kind = "invalid_request_error" if status < 500 else "api_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def message_text(content: Any) -> str:
    """The text of a message's ``content``: a string, a list of text parts, or None."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    raise BadRequest(f"message content must be a string or a list of parts, got {type(content).__name__}")


class PolicyServer:
    """The ASGI app over ``engine``; ``model_name`` is listed by ``/v1/models``, any name is accepted."""

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, context_length: int,
                 config: ServingConfig, model_name: str = "policy"):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.context_length, self.model_name = context_length, model_name
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ])

    def serve(self) -> ServerThread:
        """Start serving on ``config.host:config.port``; clients use ``server.url + "/v1"``."""
        return ServerThread(self.app, self.config.host, self.config.port, name="agl-torch-policy").start()

    # ------------------------------------------------------------ endpoints

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "owned_by": "agl-plugin-torch"}]})

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"ok": True, "weight_version": self.engine.weight_version()})

    async def _handle(self, request: Request, chat: bool) -> Response:
        try:
            body = _json_object(await request.body())
            prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
            params = self._params(body, len(prompt_ids), chat)
        except BadRequest as exc:
            return error_response(400, str(exc))
        try:
            generated: Generated = await asyncio.wrap_future(self.engine.submit([prompt_ids] * len(params), params))
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged by the engine
            return error_response(500, f"generation failed: {exc!r}")
        build = self._chat_response if chat else self._completion_response
        return JSONResponse(build(body, prompt_ids, generated))

    # ------------------------------------------------------------ requests

    def _chat_prompt(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
        messages = [{**m, "content": message_text(m.get("content"))} for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise BadRequest(f"the chat template cannot render these messages: {exc}") from None
        return list(ids)

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if max(prompt) >= len(self.tokenizer) or min(prompt) < 0:
                raise BadRequest(f"prompt token ids must be in [0, {len(self.tokenizer)})")
            return prompt
        raise BadRequest("'prompt' must be a string or a non-empty list of token ids")

    def _params(self, body: dict[str, Any], prompt_length: int, chat: bool) -> list[SamplingParams]:
        """One :class:`SamplingParams` per choice (``n``), checked; choice ``i`` of a seeded request uses seed + i."""
        if body.get("stream"):
            raise BadRequest("streaming is not supported: call with stream=false")
        room = self.context_length - prompt_length
        if room < 1:
            raise BadRequest(f"the prompt has {prompt_length} tokens; the model's context is "
                             f"{self.context_length} tokens, which leaves no room for a response")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = self.config.default_max_tokens
        max_tokens = _integer("max_tokens", max_tokens, low=1)
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise BadRequest("'stop' must be a non-empty string or a list of them")
        stop_token_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) for t in stop_token_ids):
            raise BadRequest("'stop_token_ids' must be a list of token ids")
        # Chat asks for alternatives with top_logprobs; completions with logprobs=<k>.
        alternatives = "top_logprobs" if chat else "logprobs"
        seed = body.get("seed")
        common = dict(
            max_tokens=min(max_tokens, room),
            temperature=_number("temperature", _get(body, "temperature", 1.0), low=0.0),
            top_p=_number("top_p", _get(body, "top_p", 1.0), low=0.0, low_open=True, high=1.0),
            top_k=max(0, _integer("top_k", _get(body, "top_k", 0), low=-1)),
            stop=tuple(stop), stop_token_ids=tuple(stop_token_ids), ignore_eos=bool(body.get("ignore_eos")),
            top_logprobs=_integer(alternatives, _get(body, alternatives, 0), low=0, high=20))
        n = _integer("n", _get(body, "n", 1), low=1, high=self.config.max_batch_rows)
        if seed is not None:
            seed = _integer("seed", seed)
        return [SamplingParams(seed=None if seed is None else seed + i, **common) for i in range(n)]

    # ------------------------------------------------------------ responses

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_response(self, body: dict[str, Any], prompt_ids: list[int], generated: Generated) -> dict[str, Any]:
        choices = []
        for index, sample in enumerate(generated.samples):
            content = []
            for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs)):
                text = self._token_text(token)
                alternatives = [_token_logprob(self._token_text(t), lp)
                                for t, lp in (sample.top_logprobs[i] if sample.top_logprobs else [])]
                content.append({**_token_logprob(text, logprob), "top_logprobs": alternatives})
            choices.append({"index": index, "message": {"role": "assistant", "content": sample.text},
                            "finish_reason": sample.finish_reason, "logprobs": {"content": content},
                            "token_ids": sample.token_ids})
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", **self._envelope(body),
                "choices": choices, "prompt_token_ids": prompt_ids,
                "usage": _usage(prompt_ids, generated), "weight_version": generated.weight_version}

    def _completion_response(self, body: dict[str, Any], prompt_ids: list[int],
                             generated: Generated) -> dict[str, Any]:
        choices = []
        for index, sample in enumerate(generated.samples):
            tokens = [self._token_text(t) for t in sample.token_ids]
            top = ([{self._token_text(t): lp for t, lp in alternatives} for alternatives in sample.top_logprobs]
                   if sample.top_logprobs else None)
            choices.append({"index": index, "text": sample.text, "finish_reason": sample.finish_reason,
                            "logprobs": {"tokens": tokens, "token_logprobs": sample.logprobs,
                                         "top_logprobs": top},
                            "prompt_token_ids": prompt_ids, "token_ids": sample.token_ids})
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **self._envelope(body),
                "choices": choices, "usage": _usage(prompt_ids, generated),
                "weight_version": generated.weight_version}

    def _envelope(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"created": int(time.time()), "model": body.get("model") or self.model_name}


def _token_logprob(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def _usage(prompt_ids: list[int], generated: Generated) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in generated.samples)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _get(body: dict[str, Any], key: str, default: Any) -> Any:
    """``body[key]``, or ``default`` when it is absent or null."""
    value = body.get(key)
    return default if value is None else value


def _integer(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(f"'{name}' must be in [{low}, {'inf' if high is None else high}], got {value}")
    return value


def _number(name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bounds = f"{'(' if low_open else '['}{low}, {'inf' if high is None else high}]"
        raise BadRequest(f"'{name}' must be in {bounds}, got {value}")
    return float(value)
