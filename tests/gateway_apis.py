"""What the tests of the gateway's translated APIs share (test_gateway_anthropic.py, test_gateway_responses.py).

Fixtures (import them into the test module): ``store``, a memory store with
three running attempts (``r0``, ``r1``, ``r2``, attempt ``1``), and
``serve``, which serves a gateway over it in front of an upstream URL. Helpers
to read spans and server-sent event frames, a chat answer to translate, and a
short run of a guess_number recipe.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from agl_core.builtin.memory_store import MemoryStore
from agl_core.config import GatewayConfig
from agl_core.data import Task
from agl_core.gateway import Gateway
from agl_core.rollout.store import NewRollout

ROLLOUTS = ("r0", "r1", "r2")
LEASES: dict[str, str] = {}
"""The lease token of each rollout's running attempt (the ``store`` fixture's)."""


def base_url(url: str, rollout: str = "r0", attempt: str = "1") -> str:
    """The base URL of ``rollout``'s running attempt on the gateway at ``url``."""
    return Gateway.base_url(url, rollout, attempt, LEASES.get(rollout, "no-lease"))
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def store():
    s = MemoryStore()
    s.enqueue([NewRollout(rollout, Task(id="t", input={})) for rollout in ROLLOUTS])
    LEASES.clear()
    for _ in ROLLOUTS:
        attempt = s.dequeue("w", lease_s=60)
        LEASES[attempt.rollout_id] = attempt.lease
    yield s
    s.close()


@pytest.fixture
def serve(store):
    """``serve(upstream, **config)``: a gateway over ``store`` served on 127.0.0.1 (``gateway.url``)."""
    servers = []

    def start(upstream: str, **config) -> Gateway:
        gateway = Gateway(store, GatewayConfig(**{"retry_backoff_s": 0.01, **config}),
                          sampling={"temperature": 0.7, "max_tokens": 64}, upstreams=[upstream])
        servers.append(gateway.serve())
        gateway.url = servers[-1].url
        return gateway

    yield start
    for server in servers:
        server.stop()


def spans(store, rollout="r0"):
    """The ``llm_call`` spans of ``rollout`` in the memory store."""
    return [span for span in store._entries[rollout].spans if span.kind == "llm_call"]


def tokens(span):
    """What a span holds for training: prompt ids, response ids, response log-probs."""
    return span.prompt_token_ids, span.response_token_ids, span.response_logprobs


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def events_of(frames: list[bytes]) -> list[tuple[str, dict]]:
    """Server-sent event frames as ``(event, data)`` pairs."""
    out = []
    for frame in b"".join(frames).decode().split("\n\n"):
        if frame:
            event, data = frame.split("\n")
            out.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"text": "it"}'}}


def chat_answer(content="", tool_calls=None, finish_reason="stop", stop_reason=None) -> dict:
    """A chat completion as the gateway gets it from a policy server (3 prompt tokens, 2 response tokens)."""
    message = {"role": "assistant", "content": content or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"id": "c", "object": "chat.completion", "prompt_token_ids": [1, 2, 3],
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "stop_reason": stop_reason,
                         "token_ids": [4, 5]}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


LEARNING = ("val/reward/mean", "actor/pg_loss", "actor/entropy", "actor/ppo_kl", "training/n_calls",
            "response_length/mean")
"""The metrics that say two runs learned alike."""


def assert_learns_as_the_default_recipe(name: str, tmp_path, monkeypatch) -> None:
    """A short run of recipe ``name`` logs the learning metrics of the same run of ``recipe.yaml``, number for number.

    An agent on another API makes the chat calls the plain-openai agent
    makes, with the same call seeds (by place in the run): the same token ids.
    """
    pytest.importorskip("agl_plugin_torch")
    default = run_recipe("recipe.yaml", tmp_path / "default", monkeypatch)
    translated = run_recipe(name, tmp_path / "translated", monkeypatch)
    assert [[record.get(key) for key in LEARNING] for record in translated] == \
        [[record.get(key) for key in LEARNING] for record in default]
    assert translated[-1]["rollout/n_succeeded"] == 28 and translated[-1]["training/n_calls_error"] == 0


def run_recipe(name: str, run_dir, monkeypatch) -> list[dict]:
    """A short run of ``examples/guess_number/<name>`` (1 step, groups of 4): its metrics records."""
    from agl_core.cli import main

    monkeypatch.chdir(REPO)  # the recipes' paths are relative to the repository root
    monkeypatch.syspath_prepend(str(REPO))
    code = main(["train", str(REPO / "examples" / "guess_number" / name), f"trainer.run_dir={run_dir}",
                 "trainer.total_steps=1", "trainer.test_freq=1", "trainer.save_freq=1", "trainer.progress=false",
                 "rollout.n=4", "algorithm.ppo_mini_batch_size=8"])
    assert code == 0
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def served_backend(tmp_path):
    """The embedded backend of a tiny model made from a config, its endpoint served (``backend.url``)."""
    pytest.importorskip("agl_plugin_torch")
    from agl_plugin_torch.backend import create
    from agl_plugin_torch.settings import TorchConfig
    from agl_plugin_torch.testing import tiny_section

    backend = create(TorchConfig.model_validate(tiny_section()), tmp_path, seed=0, with_critic=False)
    backend.start_serving("policy")
    return backend
