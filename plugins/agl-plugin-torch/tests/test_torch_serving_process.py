"""The policy endpoint in a process of its own (``plugins.torch.serving.process``, the default on a CPU).

A real spawned process serving a tiny llama over the actor's tensors in
shared memory, called with the real openai client. Covered: an update made
in the trainer's process is what the next answer is generated with, and
reports its version; a port in use is the trainer's own clear error; Ctrl-C
(SIGINT to the process group) does not stop the endpoint, the trainer does;
a checkpoint holds the generator the process has drawn from; what the
process logs reaches the trainer's loggers.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

import pytest
import torch
from openai import OpenAI

from agl_core.config import ConfigError
from agl_plugin_torch.backend import STATE_FILE, create
from agl_plugin_torch.serving_process import RemoteEndpoint
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import full_forward_logprobs, tiny_section

REPO = Path(__file__).resolve().parents[3]

MESSAGES = [{"role": "user", "content": "guess a number"}]


@pytest.fixture
def served(tmp_path):
    backend = create(TorchConfig.model_validate(tiny_section()), tmp_path / "run", seed=0, with_critic=False)
    backend.start_serving("policy")
    yield backend
    backend.stop_serving()


def ask(backend, **kwargs):
    client = OpenAI(base_url=backend.url, api_key="unused", max_retries=0, timeout=30)
    return client.chat.completions.create(**{"model": "policy", "messages": MESSAGES, "max_tokens": 4, **kwargs})


def served_logprobs_match(backend, reply) -> bool:
    served = [entry.logprob for entry in reply.choices[0].logprobs.content]
    recomputed = full_forward_logprobs(backend, reply.model_extra["prompt_token_ids"],
                                       reply.choices[0].model_extra["token_ids"])
    return max(abs(a - b) for a, b in zip(served, recomputed)) < 1e-5


def test_an_update_in_the_trainers_process_is_what_the_process_serves_next(served):
    assert isinstance(served.endpoint, RemoteEndpoint) and served.endpoint.pid != os.getpid()
    before = ask(served, seed=3)
    assert before.model_extra["weight_version"] == 0 and served_logprobs_match(served, before)
    with torch.no_grad(), served.lock:  # an update: the actor's weights move far
        for param in served.actor.parameters():
            param.add_(torch.randn_like(param) * 0.2)
    served.set_weight_version(1)
    after = ask(served, seed=3)
    assert after.model_extra["weight_version"] == 1 and served_logprobs_match(served, after)
    assert [e.logprob for e in after.choices[0].logprobs.content] != \
        [e.logprob for e in before.choices[0].logprobs.content]


def test_a_port_in_use_is_the_trainers_clear_error(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        config = TorchConfig.model_validate(tiny_section(serving={"port": port}))
        backend = create(config, tmp_path / "run", seed=0, with_critic=False)
        with pytest.raises(ConfigError, match=rf"plugins\.torch\.serving\.port.*127\.0\.0\.1:{port}"):
            backend.start_serving("policy")
    assert backend.endpoint is None


def test_sigint_does_not_stop_the_endpoint(served):
    os.kill(served.endpoint.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends the whole process group
    assert ask(served).choices[0].model_extra["token_ids"]


def test_a_checkpoint_holds_the_generator_the_process_draws_from(served, tmp_path):
    initial = served.generator.get_state()
    for _ in range(3):
        ask(served, temperature=1.0)  # unseeded: drawn from the process's generator
    served.save(tmp_path / "ckpt")
    saved = torch.load(tmp_path / "ckpt" / STATE_FILE, weights_only=False)["generator"]
    assert torch.equal(saved, served.endpoint.generator_state()) and not torch.equal(saved, initial)


def test_what_the_process_logs_reaches_the_trainers_loggers(served, caplog):
    with caplog.at_level(logging.WARNING, logger="agl_plugin_torch"):
        ask(served, model="someone-else")
        deadline = time.monotonic() + 10  # the record crosses a queue, read by a thread of this process
        while not (records := [r for r in caplog.records if "'someone-else'" in r.getMessage()]):
            assert time.monotonic() < deadline, "the process's log record never arrived"
            time.sleep(0.05)
    assert records[0].name.startswith("agl_plugin_torch") and records[0].levelno == logging.WARNING


@pytest.mark.parametrize("section, asynchronous, starts", [
    ({}, False, True),  # the serving process
    ({"serving": {"process": False}}, False, False),
    ({"serving": {"process": False}}, True, True),  # the update process
    ({"serving": {"process": False}, "update_process": False}, True, False),
    ({"model": {"device": "cuda"}}, True, False),  # on a GPU both stay in the trainer's process
])
def test_a_run_starts_worker_processes_where_it_forks_them(section, asynchronous, starts):
    config = tiny_section()
    for key, value in section.items():
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value  # merged, not replaced
    assert TorchConfig.model_validate(config).starts_processes(asynchronous) is starts


def test_the_fork_server_starts_before_the_backend_makes_its_model(tmp_path, monkeypatch):
    """Its imports then overlap the model's making (the endpoint serves ~2 s sooner on 2 cores)."""
    from agl_core.cli import main
    from agl_plugin_torch import backend, worker_process

    events = []
    start_fork_server, make = worker_process.start_fork_server, backend.create
    monkeypatch.setattr(worker_process, "start_fork_server",
                        lambda: (events.append("fork server"), start_fork_server())[1])
    monkeypatch.setattr(backend, "create", lambda *args, **kwargs: (events.append("create"), make(*args, **kwargs))[1])
    monkeypatch.chdir(REPO)
    code = main(["train", str(REPO / "examples" / "guess_number" / "recipe.yaml"), f"trainer.run_dir={tmp_path}",
                 "trainer.total_steps=1", "trainer.test_freq=0", "trainer.val_before_train=false",
                 "trainer.progress=false", "rollout.n=2", "algorithm.ppo_mini_batch_size=8"])
    assert code == 0 and events == ["fork server", "create"]
