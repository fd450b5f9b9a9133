"""Serve a reward model (a sequence-classification checkpoint, ``num_labels`` 1) over HTTP the way vLLM serves one.

``POST /pooling`` takes ``{"model": NAME, "input": INPUT}``, INPUT a text, a
list of token ids, or a list of either, and answers vLLM's pooling response:
``{"object": "list", "model", "data": [{"index": i, "object": "pooling",
"data": [value]}, ...], "usage": {"prompt_tokens", "total_tokens"}}``, the
value the model's head at each input's last token, unscaled (no activation).
Token ids are the model's own; a text is tokenized by its tokenizer, with its
special tokens. ``GET /v1/models`` lists the model, ``GET /health`` answers
200. The values come from :class:`~agl_plugin_teachers.reward_model.RewardModel`,
the same forward a local reward model runs, ``rows_per_forward`` rows at a time.

Run it::

    python -m agl_plugin_teachers.reward_server MODEL_DIR --port 8001 [--model NAME] [--device cpu]

and point a judge at it: ``plugins.judge: {kind: reward_model, endpoint: http://127.0.0.1:8001/v1}``.
A host other than loopback needs a bearer token (``--token`` or ``$AGL_POLICY_TOKEN``).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agl_core.http.rules import (POLICY_TOKEN_ENV, RequestError, check_bearer, error_response, health_response,
                                 parse_json_object, policy_token, read_body, require_token_off_loopback)
from agl_core.http.server import ServerThread, stop_on_signals

from agl_plugin_teachers.reward_model import RewardModel
from agl_plugin_teachers.settings import JudgeConfig

MAX_BODY_BYTES = 64 * 2 ** 20
BODY_TIMEOUT_S = 60.0


class RewardServer:
    """The ASGI app over a loaded :class:`RewardModel`; ``model_name`` is listed by ``/v1/models``."""

    def __init__(self, model: RewardModel, model_name: str = "reward", token: str | None = None):
        self.model, self.model_name, self.token = model, model_name, token
        self.vocab_size = model.model.config.vocab_size
        self.lock = threading.Lock()  # one forward at a time: they share the model
        self.app = Starlette(routes=[Route("/pooling", self._pooling, methods=["POST"]),
                                     Route("/v1/models", self._models, methods=["GET"]),
                                     Route("/health", self._health, methods=["GET"])])

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> ServerThread:
        require_token_off_loopback("the reward model server", host, self.token, f"--token (or ${POLICY_TOKEN_ENV})")
        return ServerThread(self.app, host, port, name="agl-reward-model", setting="--port").start()

    async def _models(self, request: Request) -> Response:
        try:
            check_bearer(request, self.token)
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "owned_by": "agl-plugin-teachers"}]})

    async def _health(self, request: Request) -> Response:
        return health_response(request, self.token, {})

    async def _pooling(self, request: Request) -> Response:
        try:
            check_bearer(request, self.token)
            body = parse_json_object(await read_body(request, MAX_BODY_BYTES, "the server's body limit",
                                                     BODY_TIMEOUT_S))
            rows = self._rows(body.get("input"))
        except RequestError as exc:
            return error_response(exc.status, str(exc))
        try:
            values = await asyncio.to_thread(self._values, rows)
        except Exception as exc:  # noqa: BLE001 - reported to the client
            return error_response(500, f"scoring failed: {exc!r}")
        tokens = sum(len(row) for row in rows)
        return JSONResponse({"id": f"pool-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": body.get("model") or self.model_name,
                             "data": [{"index": i, "object": "pooling", "data": [value]}
                                      for i, value in enumerate(values)],
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})

    def _rows(self, given: Any) -> list[list[int]]:
        """The inputs as rows of token ids; a 400 naming what is wrong."""
        if isinstance(given, str) or (isinstance(given, list) and given and isinstance(given[0], int)):
            given = [given]
        if not isinstance(given, list) or not given:
            raise RequestError(400, "'input' must be a text, a list of token ids, or a non-empty list of either")
        rows = []
        for i, item in enumerate(given):
            if isinstance(item, str):
                item = self.model.tokenizer(item, add_special_tokens=True)["input_ids"]
            if not isinstance(item, list) or not item or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in item):
                raise RequestError(400, f"'input[{i}]' must be a text or a non-empty list of token ids in "
                                        f"[0, {self.vocab_size})")
            rows.append(item)
        return rows

    def _values(self, rows: list[list[int]]) -> list[float]:
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        step, out = self.model.config.rows_per_forward, [0.0] * len(rows)
        with self.lock:
            for first in range(0, len(order), step):
                chunk = order[first:first + step]
                for i, value in zip(chunk, self.model.values([rows[i] for i in chunk])):
                    out[i] = value
        return out


def serve_reward_model(model_path: str, host: str = "127.0.0.1", port: int = 0, model_name: str = "reward",
                       device: str = "auto", dtype: str = "auto", rows_per_forward: int = 8,
                       token: str | None = None) -> ServerThread:
    """Load the reward model at ``model_path`` and serve it; clients use ``server.url + "/v1"``."""
    config = JudgeConfig(kind="reward_model", model_path=model_path, device=device, dtype=dtype,
                         rows_per_forward=rows_per_forward)
    return RewardServer(RewardModel(config, None), model_name, policy_token(token)).serve(host, port)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m agl_plugin_teachers.reward_server",
                                     description="Serve a reward model on vLLM's pooling API (POST /pooling).")
    parser.add_argument("model_path", help="a sequence-classification model directory (num_labels 1)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--model", default="reward", help="the name /v1/models lists")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--rows-per-forward", type=int, default=8)
    parser.add_argument("--token", default=None, help=f"bearer token clients must send (or ${POLICY_TOKEN_ENV})")
    args = parser.parse_args(argv)
    stop = stop_on_signals()
    server = serve_reward_model(args.model_path, args.host, args.port, args.model, args.device, args.dtype,
                                args.rows_per_forward, args.token)
    print(f"reward model {args.model_path} served at {server.url}/pooling", flush=True)
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
