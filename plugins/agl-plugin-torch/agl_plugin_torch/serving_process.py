"""The policy endpoint (engine and OpenAI-compatible server), in the trainer's process or in a process of its own.

Served in the trainer's process on a CPU, every generation batch waits for
the interpreter lock: a small model's forward pass is a hundred short
kernels, torch lets go of the lock around each, and one of the rollout
plane's threads (32 agents, the gateway, the store) takes it every time. A
batch that computes for 10 ms then lasts ~50 ms, and generation — which
waits on the engine — takes most of a step (measured on the default recipe). In a process of its own the
engine keeps its lock. It serves the very same weights: the trainer's
process moves the served model's tensors to shared memory before the
process starts, and a lock and the weights' version are shared too, so an
update (or an asynchronous run's weight sync) in the trainer's process is
what the next batch there generates with, and every answer is made by one
version of the weights, the one it reports.

:func:`serve_model` makes the endpoint; :func:`start` runs it in a
process and returns a :class:`RemoteEndpoint`, which the backend uses as it
would the :class:`Endpoint` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from agl_core.config import ConfigError
from agl_core.http.server import ServerThread

from agl_plugin_torch.engine import Engine
from agl_plugin_torch.server import PolicyServer
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.worker_process import StartError, WorkerProcess


class Endpoint:
    """A running engine and its HTTP server; ``url`` is the server's root (``http://127.0.0.1:PORT``)."""

    def __init__(self, engine: Engine, server: ServerThread):
        self.engine, self.server = engine, server
        self.url = server.url

    def busy_cpu_s(self) -> float:
        """CPU seconds the engine has spent generating (the model's share of the rollouts)."""
        return self.engine.busy_cpu_s

    def batches(self) -> int:
        """How many batches the engine has generated."""
        return self.engine.batches

    def generated(self) -> tuple[int, float]:
        """``(tokens, seconds)``: the tokens the engine has generated and the wall time its batches took."""
        return self.engine.generated_tokens, self.engine.busy_wall_s

    def generator_state(self) -> torch.Tensor:
        """The state of the generator unseeded requests draw from (saved with a checkpoint)."""
        return self.engine.generator.get_state()

    def close(self) -> None:
        try:
            self.server.stop()
        finally:
            self.engine.stop()


def serve_model(model: torch.nn.Module, lock: Any, weight_version: Callable[[], int],
                tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int], config: TorchConfig,
                model_name: str, generator: torch.Generator) -> Endpoint:
    """Start the engine over ``model`` (guarded by ``lock``) and the server over the engine."""
    serving = config.serving
    engine = Engine(model, lock, weight_version, eos_token_ids=eos_token_ids, pad_token_id=tokenizer.pad_token_id,
                    decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), generator=generator,
                    max_batch_rows=serving.max_batch_rows, batch_wait_s=serving.batch_wait_ms / 1000,
                    kv_cache=serving.kv_cache, compile_decode=serving.compile_decode).start()
    try:
        server = PolicyServer(engine, tokenizer, model.config.max_position_embeddings, serving, model_name).serve()
    except BaseException:
        engine.stop()
        raise
    return Endpoint(engine, server)


class RemoteEndpoint:
    """An :class:`Endpoint` in a process of its own, used the same way."""

    def __init__(self, process: WorkerProcess):
        self.process = process
        self.url: str = process.started()

    @property
    def pid(self) -> int:
        return self.process.pid

    def busy_cpu_s(self) -> float:
        return self.process.call("busy_cpu_s")

    def batches(self) -> int:
        return self.process.call("batches")

    def generated(self) -> tuple[int, float]:
        return self.process.call("generated")

    def generator_state(self) -> torch.Tensor:
        return self.process.call("generator_state")

    def close(self) -> None:
        self.process.stop()


def start(model: torch.nn.Module, lock: Any, version: Any, tokenizer: PreTrainedTokenizerBase,
          eos_token_ids: Sequence[int], config: TorchConfig, model_name: str,
          generator_state: torch.Tensor) -> RemoteEndpoint:
    """Serve ``model`` (its tensors in shared memory) from a process of its own; returns once it listens.

    ``lock`` (a lock of :data:`~agl_plugin_torch.worker_process.CONTEXT`)
    guards the weights in both processes; ``version`` (a shared integer) is
    the version the answers report, read under the lock. Unseeded requests
    draw from a generator that starts in ``generator_state``. A setting the
    server refuses (a port in use, no token off loopback) is raised here as
    the server raised it.
    """
    process = WorkerProcess("the torch policy endpoint's process", "agl-torch-serving", build, model, lock, version,
                            tokenizer, list(eos_token_ids), config, model_name, generator_state)
    try:
        return RemoteEndpoint(process)
    except BaseException:
        process.stop()
        raise


def build(model, lock, version, tokenizer, eos_token_ids, config: TorchConfig, model_name: str,
          generator_state: torch.Tensor) -> tuple[Endpoint, str]:
    """In the process: the endpoint over the shared model; reports its URL."""
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    generator = torch.Generator(device=next(model.parameters()).device)
    generator.set_state(generator_state)
    try:
        endpoint = serve_model(model, lock, lambda: version.value, tokenizer, eos_token_ids, config, model_name,
                               generator)
    except (ConfigError, ValueError) as exc:
        raise StartError from exc
    return endpoint, endpoint.url
