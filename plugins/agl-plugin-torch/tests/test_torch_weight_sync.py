"""The embedded backend's weight sync needs no pause at the gateway: it swaps between two generation batches.

Real engine over a tiny llama served from a copy of the actor (asynchronous
training's set-up); 16 threads keep asking it for samples while the trainer's
side changes the actor's weights and syncs them, again and again. Every
answer reports a version, and its log-probs are those of that version's
weights: no answer mixes two versions, so the loop need not hold the
gateway's calls around a sync (``SYNCS_BETWEEN_CALLS``).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from agl_plugin_torch.backend import create
from agl_plugin_torch.sampling import SamplingParams
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import full_forward_logprobs, prompt, tiny_section

SYNCS = 12
CALLERS = 16


def test_every_answer_is_made_by_the_one_version_it_reports_while_weights_sync_under_concurrent_calls(tmp_path):
    backend = create(TorchConfig.model_validate(tiny_section(num_layers=2)), tmp_path / "run", seed=0,
                     with_critic=False)
    backend.serve_a_copy()
    backend.start_serving("policy")
    prompts = [prompt(backend, text) for text in ("guess a number", "hello world", "a number , 3")]
    weights = {0: {k: v.clone() for k, v in backend.actor.state_dict().items()}}
    answers = []  # (prompt, Generated)
    stop = threading.Event()

    def call(i: int) -> None:
        while not stop.is_set():
            p = prompts[i % len(prompts)]
            params = SamplingParams(max_tokens=6, ignore_eos=True, seed=i)
            answers.append((p, backend.engine.submit([p], [params]).result(timeout=30)))

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

    versions = {generated.weight_version for _, generated in answers}
    assert len(versions) > SYNCS // 2, versions  # calls ran across many syncs
    for p, generated in answers:
        [sample] = generated.samples
        backend.actor.load_state_dict(weights[generated.weight_version])
        torch.testing.assert_close(full_forward_logprobs(backend, p, sample.token_ids), sample.logprobs,
                                   rtol=0, atol=1e-4)  # batching noise
        # ... and not those of the versions before or after it: the check can tell versions apart.
        for other in (generated.weight_version - 1, generated.weight_version + 1):
            if other in weights:
                backend.actor.load_state_dict(weights[other])
                gap = max(abs(a - b) for a, b in zip(full_forward_logprobs(backend, p, sample.token_ids),
                                                     sample.logprobs))
                assert gap > 1e-2
