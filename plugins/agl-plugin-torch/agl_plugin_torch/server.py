"""The policy endpoint: an OpenAI-compatible HTTP server in front of the engine.

``POST /v1/chat/completions`` and ``POST /v1/completions`` answer like vLLM
with ``return_token_ids``, whatever the request asks: ``prompt_token_ids``
(top level for chat, per choice for completions), ``choices[].token_ids`` and
``choices[].logprobs`` (the sampled tokens' log-probs, with
``top_logprobs`` alternatives when asked). Every response also carries
``weight_version``, the number of the actor update whose weights produced it
(0: the initial weights). ``GET /v1/models`` lists the one model (its
``root`` the directory its tokenizer was loaded from, as vLLM lists its
model's path);
``GET /healthz`` (``/health``) says it is alive.

Scoring: a completions request with ``prompt_logprobs: k`` (vLLM's
extension) is answered without generating: per prompt (``prompt`` may be a
list of token-id lists, one choice each) its ``prompt_logprobs``, the
log-prob, rank and ``k`` alternatives of every token after the first
(:mod:`agl_plugin_torch.scoring`). A teacher of on-policy distillation asks
this of the student's samples. With ``packed_prompt_logprobs: true`` (and
``prompt_logprobs: 0``) each choice carries the given tokens' log-probs packed
(``packed_prompt_logprobs``: base64 of little-endian float32, one per token
after the first) in place of ``prompt_logprobs`` and ``prompt_token_ids``.

Sampling parameters: ``max_tokens`` / ``max_completion_tokens``,
``temperature`` (0: greedy), ``top_p``, ``top_k``, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``seed``, ``n``.

``stream: true`` is answered with server-sent events in vLLM's layout, a
chunk per token as the engine generates it (its id and log-prob, and its text
unless a stop string could still cut it or tools are offered), then per
choice the rest and the finish reason (:mod:`agl_plugin_torch.streaming`);
``stream_options.include_usage`` is honored.

Tools: a chat request's ``tools``, ``tool_choice`` and ``tool``-role messages
are rendered by the model's chat template, and the model's calls parsed back
into ``message.tool_calls`` (finish reason ``"tool_calls"``), in the formats
:mod:`agl_core.gateway.tool_calls` documents; a ``tool_choice`` naming a function
starts the model's answer with the opening of that call.
Every field is checked before the request reaches the engine (the rules of
:mod:`agl_core.http.rules`): a value the engine cannot sample with is a 400
that names the field, never a failure of the batch it would have joined.

Any model name is accepted and answered by the one policy: agents are written
against arbitrary model names, and the gateway in front decides which policy
serves a run. A name other than the served one is logged, once per name.

It keeps the rules of every server of the project: a bind off loopback needs
a bearer token (``plugins.torch.serving.token``, default
``$AGL_POLICY_TOKEN``, which the gateway also sends), and then every endpoint
but a bare health check requires it; request bodies are bounded in size and
in the time a client takes to send them.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import PreTrainedTokenizerBase

from agl_core.gateway.streaming import EVENT_STREAM
from agl_core.gateway.tool_calls import (forced_function, forced_opening, offered_tools, parse_forced_call,
                                         parse_tool_calls, template_messages, tool_format)
from agl_core.http.rules import (POLICY_TOKEN_ENV, RequestError, check_bearer, check_sampling, error_response,
                                 health_response, parse_json_object, policy_token, read_body,
                                 require_token_off_loopback)
from agl_core.http.limits import ServerLimits
from agl_core.http.server import ServerThread

from agl_plugin_torch.engine import Engine, Generated
from agl_plugin_torch.policies import adapter_of, policy_adapters
from agl_plugin_torch.sampling import SamplingParams
from agl_plugin_torch.scoring import pack_logprobs, prompt_logprobs, prompt_logprobs_field, token_logprobs
from agl_plugin_torch.settings import ServingConfig
from agl_plugin_torch.streaming import TokenStream, logprob_entry

log = logging.getLogger("agl_plugin_torch")

MAX_PROMPT_LOGPROBS = 20
"""Most alternatives a scoring request may ask per token (vLLM's default limit)."""

"""The environment variable that holds the bearer token when the recipe sets none (the gateway reads it too)."""

MAX_REPORTED_NAMES = 32
"""Unknown model names logged per server; more are answered without a word (a caller cannot grow the log)."""


def message_text(content: Any, where: str) -> str:
    """The text of a message's ``content`` (a string, a list of text parts, or None); ``where`` names it in errors."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(400, f"'{where}' must be a string, a list of text parts or null, "
                                f"got {type(content).__name__}")
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise RequestError(400, f"'{where}[{i}]' must be a content part object, got {type(part).__name__}")
        kind = part.get("type", "text")
        if kind != "text":
            raise RequestError(400, f"'{where}[{i}].type' must be 'text' (the policy reads text only), "
                                    f"got {kind!r:.80}")
        text = part.get("text")
        if not isinstance(text, str):
            raise RequestError(400, f"'{where}[{i}].text' must be a string, got {type(text).__name__}")
        texts.append(text)
    return "".join(texts)


class PolicyServer:
    """The ASGI app over ``engine``; ``model_name`` is listed by ``/v1/models``, any name is accepted.

    ValueError when ``config.host`` is not a loopback address and no token
    is set (in ``config.token`` or ``$AGL_POLICY_TOKEN``).
    """

    def __init__(self, engine: Engine, tokenizer: PreTrainedTokenizerBase, context_length: int,
                 config: ServingConfig, model_name: str = "policy"):
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.context_length, self.model_name = context_length, model_name
        self.token = policy_token(config.token)
        require_token_off_loopback("the policy endpoint", config.host, self.token,
                                   f"plugins.torch.serving.token (or ${POLICY_TOKEN_ENV})")
        self._reported_names: set[str] = set()
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/healthz", self._health, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ])

    def serve(self) -> ServerThread:
        """Start serving on ``config.host:config.port``; clients use ``server.url + "/v1"``."""
        return ServerThread(self.app, self.config.host, self.config.port, name="agl-torch-policy",
                            setting="plugins.torch.serving.port",
                            limits=ServerLimits(max_connections=self.config.max_connections)).start()

    # ------------------------------------------------------------ endpoints

    async def _chat(self, request: Request) -> Response:
        return await self._handle(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._handle(request, chat=False)

    async def _models(self, request: Request) -> Response:
        try:
            check_bearer(request, self.token)
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        # root: where the tokenizer was loaded from, as vLLM lists its model's path; the gateway renders exact
        # contexts with the same files (agl_core.gateway.chat_template). Several policies: each is a model.
        names = list(policy_adapters(self.engine.model) or [self.model_name])
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "owned_by": "agl-plugin-torch",
                                                         "root": self.tokenizer.name_or_path or None}
                                                        for name in names]})

    async def _health(self, request: Request) -> Response:
        return health_response(request, self.token, {"weight_version": self.engine.weight_version()})

    async def _handle(self, request: Request, chat: bool) -> Response:
        config = self.config
        try:
            check_bearer(request, self.token)
            body = parse_json_object(await read_body(request, config.max_body_bytes,
                                                     "plugins.torch.serving.max_body_bytes", config.body_timeout_s))
            adapter = self._check_model(body.get("model"))
            if not chat and body.get("prompt_logprobs") is not None:
                return await self._score(body)
            tools, opening = None, ""
            if chat:
                prompt_ids, tools, opening = self._chat_prompt(body)
            else:
                prompt_ids = self._completion_prompt(body)
            params = self._params(body, len(prompt_ids), chat)
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        if chat:
            def finish(generated: Generated) -> dict[str, Any]:
                return self._chat_response(body, prompt_ids, generated, tools, opening)
        else:
            def finish(generated: Generated) -> dict[str, Any]:
                return self._completion_response(body, prompt_ids, generated)
        if body.get("stream"):
            stream = TokenStream(body, chat, prompt_ids, len(params), params[0].stop, self.engine.decode,
                                 self._token_text, stream_text=not tools, model=body.get("model") or self.model_name)
            try:
                future = self.engine.submit([prompt_ids] * len(params), params, on_token=stream.on_token,
                                            adapter=adapter)
            except RuntimeError as exc:
                return error_response(503, str(exc))
            future.add_done_callback(stream.on_done)
            return StreamingResponse(stream.events(future, finish), media_type=EVENT_STREAM)
        try:
            generated: Generated = await asyncio.wrap_future(self.engine.submit([prompt_ids] * len(params), params,
                                                                                adapter=adapter))
        except Exception as exc:  # noqa: BLE001 - reported to the client, logged by the engine
            return error_response(500, f"generation failed: {exc!r}")
        return JSONResponse(finish(generated))

    async def _score(self, body: dict[str, Any]) -> Response:
        """Answer a scoring request (``prompt_logprobs``): the prompts' token log-probs, nothing generated."""
        top_k = body["prompt_logprobs"]
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 0 <= top_k <= MAX_PROMPT_LOGPROBS:
            raise RequestError(400, f"'prompt_logprobs' must be an integer in [0, {MAX_PROMPT_LOGPROBS}]")
        prompt = body.get("prompt")
        prompts = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) else [prompt]
        if len(prompts) > self.config.max_batch_rows:
            raise RequestError(400, f"'prompt' holds {len(prompts)} prompts; at most "
                                    f"{self.config.max_batch_rows} (plugins.torch.serving.max_batch_rows)")
        checked = []
        for i, ids in enumerate(prompts):
            where = "prompt" if len(prompts) == 1 and not isinstance(prompt[0], list) else f"prompt[{i}]"
            if not isinstance(ids, list) or not ids:
                raise RequestError(400, f"'{where}' must be a non-empty list of token ids to score")
            checked.append(self._completion_prompt({"prompt": ids}))
            if len(ids) > self.context_length:
                raise RequestError(400, f"'{where}' has {len(ids)} tokens; the model's context is "
                                        f"{self.context_length} tokens")
        packed = body.get("packed_prompt_logprobs", False)
        if not isinstance(packed, bool):
            raise RequestError(400, f"'packed_prompt_logprobs' must be true or false, got {packed!r}")
        if packed and top_k:
            raise RequestError(400, "'packed_prompt_logprobs' holds the given tokens' log-probs only: ask it with "
                                    "'prompt_logprobs': 0")
        engine = self.engine

        def score() -> tuple[list, int]:
            with engine.lock:
                if packed:
                    return token_logprobs(engine.model, checked, self.tokenizer.pad_token_id), engine.weight_version()
                return (prompt_logprobs(engine.model, checked, top_k, self.tokenizer.pad_token_id),
                        engine.weight_version())
        try:
            scored, version = await asyncio.to_thread(score)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            return error_response(500, f"scoring failed: {exc!r}")
        empty = {"text": "", "finish_reason": "length", "logprobs": None, "token_ids": []}
        if packed:
            choices = [{"index": i, **empty, "packed_prompt_logprobs": pack_logprobs(values)}
                       for i, values in enumerate(scored)]
        else:
            choices = [{"index": i, **empty, "prompt_token_ids": ids,
                        "prompt_logprobs": prompt_logprobs_field(rows, ids, self._token_text)}
                       for i, (ids, rows) in enumerate(zip(checked, scored))]
        n_tokens = sum(len(ids) for ids in checked)
        return JSONResponse({"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", **self._envelope(body),
                             "choices": choices, "weight_version": version,
                             "usage": {"prompt_tokens": n_tokens, "completion_tokens": 0, "total_tokens": n_tokens}})

    # ------------------------------------------------------------ requests

    def _check_model(self, name: Any) -> str | None:
        """The adapter of the policy ``name`` names when the model serves several (404 naming them for none);
        else accept any model name (see the module's docstring), logging each name but the served one, once."""
        if name is not None and not isinstance(name, str):
            raise RequestError(400, f"'model' must be a string, got {type(name).__name__}")
        if policy_adapters(self.engine.model) is not None:
            try:
                return adapter_of(self.engine.model, name if name is not None else "")
            except KeyError as exc:
                raise RequestError(404, exc.args[0]) from None
        if name is None:
            return None
        if name != self.model_name and name not in self._reported_names and \
                len(self._reported_names) < MAX_REPORTED_NAMES:
            self._reported_names.add(name)
            log.warning("a call asks for model %.80r; the policy endpoint serves %r and answers it with that "
                        "(logged once per name)", name, self.model_name)

    def _chat_prompt(self, body: dict[str, Any]) -> tuple[list[int], list[dict[str, Any]] | None, str]:
        """The prompt ids of a chat request, the tools it offers, and the forced opening of the answer (or "").

        The tools are rendered by the chat template; a ``tool_choice`` naming a
        function appends the opening of its call to the prompt (see :mod:`agl_core.gateway.tool_calls`).
        """
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "'messages' must be a non-empty list of message objects")
        rendered = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                raise RequestError(400, f"'messages[{i}]' must be a message object, got {type(message).__name__}")
            if not isinstance(message.get("role"), str):
                raise RequestError(400, f"'messages[{i}].role' must be a string, "
                                        f"got {type(message.get('role')).__name__}")
            rendered.append({**message, "content": message_text(message.get("content"), f"messages[{i}].content")})
        tools = offered_tools(body)
        function = forced_function(body, tools)
        try:
            ids = self.tokenizer.apply_chat_template(template_messages(rendered), tools=tools,
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's problem
            raise RequestError(400, f"the chat template cannot render these messages: {exc}") from None
        if function is None:
            return list(ids), tools, ""
        opening = forced_opening(function, tool_format(self.tokenizer.chat_template))
        return list(ids) + self.tokenizer.encode(opening, add_special_tokens=False), tools, opening

    def _completion_prompt(self, body: dict[str, Any]) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            # The model's vocabulary, not the tokenizer's: a padded embedding (vocab_size above the tokenizer's
            # length) can sample ids no token spells, and an exact context sends them back as they were sampled.
            vocab = self.engine.model.get_input_embeddings().num_embeddings
            if max(prompt) >= vocab or min(prompt) < 0:
                raise RequestError(400, f"'prompt' token ids must be in [0, {vocab})")
            return prompt
        raise RequestError(400, "'prompt' must be a string or a non-empty list of token ids")

    def _params(self, body: dict[str, Any], prompt_length: int, chat: bool) -> list[SamplingParams]:
        """One :class:`SamplingParams` per choice (``n``), checked; choice ``i`` of a seeded request uses seed + i."""
        # Chat asks for alternatives with top_logprobs; completions with logprobs=<k>.
        alternatives = "top_logprobs" if chat else "logprobs"
        check_sampling(body, max_n=self.config.max_batch_rows, logprobs_key=alternatives)
        room = self.context_length - prompt_length
        if room < 1:
            raise RequestError(400, f"the prompt has {prompt_length} tokens; the model's context is "
                                    f"{self.context_length} tokens, which leaves no room for a response")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or self.config.default_max_tokens
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise RequestError(400, "'stop' must be a non-empty string or a list of them")
        stop_token_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_token_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in stop_token_ids):
            raise RequestError(400, "'stop_token_ids' must be a list of token ids")
        if not isinstance(body.get("ignore_eos", False), bool | None):
            raise RequestError(400, f"'ignore_eos' must be true or false, got {type(body['ignore_eos']).__name__}")
        common = dict(
            max_tokens=min(max_tokens, room), temperature=float(_get(body, "temperature", 1.0)),
            top_p=float(_get(body, "top_p", 1.0)), top_k=max(0, _get(body, "top_k", 0)),
            stop=tuple(stop), stop_token_ids=tuple(stop_token_ids), ignore_eos=bool(body.get("ignore_eos")),
            top_logprobs=int(_get(body, alternatives, 0)))
        seed = body.get("seed")
        # Seeds past torch's range wrap (SamplingParams takes any int), so seed + i never overflows.
        return [SamplingParams(seed=None if seed is None else seed + i, **common)
                for i in range(_get(body, "n", 1))]

    # ------------------------------------------------------------ responses

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _chat_response(self, body: dict[str, Any], prompt_ids: list[int], generated: Generated,
                       tools: list[dict[str, Any]] | None, opening: str) -> dict[str, Any]:
        choices = []
        for index, sample in enumerate(generated.samples):
            content = []
            for i, (token, logprob) in enumerate(zip(sample.token_ids, sample.logprobs)):
                text = self._token_text(token)
                alternatives = [logprob_entry(self._token_text(t), lp)
                                for t, lp in (sample.top_logprobs[i] if sample.top_logprobs else [])]
                content.append({**logprob_entry(text, logprob), "top_logprobs": alternatives})
            message: dict[str, Any] = {"role": "assistant", "content": sample.text}
            finish_reason = sample.finish_reason
            if tools:
                message["content"], calls = (
                    parse_forced_call(opening, sample.text, tool_format(self.tokenizer.chat_template), tools)
                    if opening else parse_tool_calls(sample.text, tools))
                if calls:
                    message["tool_calls"], finish_reason = calls, "tool_calls"
            choices.append({"index": index, "message": message, "finish_reason": finish_reason,
                            "logprobs": {"content": content}, "token_ids": sample.token_ids})
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


def _usage(prompt_ids: list[int], generated: Generated) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in generated.samples)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion}


def _get(body: dict[str, Any], key: str, default: Any) -> Any:
    """``body[key]``, or ``default`` when it is absent or null."""
    value = body.get(key)
    return default if value is None else value
