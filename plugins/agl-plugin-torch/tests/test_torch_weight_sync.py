"""The embedded backend's weight sync needs no pause at the gateway: it swaps between two generation batches.

Real endpoint over a tiny llama served from a copy of the actor (asynchronous
training's set-up), in the trainer's process and in a process of its own
(weights, lock and version shared with it); 16 threads of the real openai
client keep asking it for samples while the trainer's side changes the
actor's weights and syncs them, again and again. Every answer reports a
version, and its log-probs are those of that version's weights: no answer
mixes two versions, so the loop need not hold the gateway's calls around a
sync (``SYNCS_BETWEEN_CALLS``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from openai import OpenAI

from agl_plugin_torch.backend import create
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import full_forward_logprobs, tiny_section

SYNCS = 12
CALLERS = 16


@pytest.mark.parametrize("in_a_process", [False, True], ids=["in-process", "own-process"])
def test_every_answer_is_made_by_the_one_version_it_reports_while_weights_sync_under_concurrent_calls(
        tmp_path, in_a_process):
    section = tiny_section(num_layers=2, serving={"process": in_a_process})
    backend = create(TorchConfig.model_validate(section), tmp_path / "run", seed=0, with_critic=False)
    backend.serve_a_copy()
    backend.start_serving("policy")
    texts = ("guess a number", "hello world", "a number , 3")
    weights = {0: {k: v.clone() for k, v in backend.actor.state_dict().items()}}
    answers = []  # (prompt ids, token ids, log-probs, weight version)
    stop = threading.Event()
    client = OpenAI(base_url=backend.url, api_key="unused", max_retries=0, timeout=30)

    def call(i: int) -> None:
        while not stop.is_set():
            reply = client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": texts[i % len(texts)]}], max_tokens=6,
                seed=i, extra_body={"ignore_eos": True})
            choice = reply.choices[0]
            answers.append((reply.model_extra["prompt_token_ids"], choice.model_extra["token_ids"],
                            [entry.logprob for entry in choice.logprobs.content], reply.model_extra["weight_version"]))

    try:
        with ThreadPoolExecutor(CALLERS) as pool:
            callers = [pool.submit(call, i) for i in range(CALLERS)]
            for version in range(1, SYNCS + 1):
                with torch.no_grad(), backend.lock:  # an update: the actor's weights move far
                    for param in backend.actor.parameters():
                        param.add_(torch.randn_like(param) * 0.2)
                backend.sync_weights(version)
                weights[version] = {k: v.clone() for k, v in backend.actor.state_dict().items()}
                n, deadline = len(answers), time.monotonic() + 30
                while len(answers) < n + CALLERS:  # calls served between this sync and the next
                    assert time.monotonic() < deadline, "the engine stopped answering"
                    time.sleep(0.005)
            stop.set()
            for caller in callers:
                caller.result()
    finally:
        backend.stop_serving()

    versions = {version for *_, version in answers}
    assert len(versions) > SYNCS // 2, versions  # calls ran across many syncs
    for prompt_ids, token_ids, logprobs, version in answers:
        backend.actor.load_state_dict(weights[version])
        torch.testing.assert_close(full_forward_logprobs(backend, prompt_ids, token_ids), logprobs,
                                   rtol=0, atol=1e-4)  # batching noise
        # ... and not those of the versions before or after it: the check can tell versions apart.
        for other in (version - 1, version + 1):
            if other in weights:
                backend.actor.load_state_dict(weights[other])
                gap = max(abs(a - b) for a, b in zip(full_forward_logprobs(backend, prompt_ids, token_ids),
                                                     logprobs))
                assert gap > 1e-2
