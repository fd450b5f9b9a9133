"""The engine isolates a request that fails from the others batched with it; seeds of any size sample."""

import pytest
import torch

from agl_plugin_torch import engine as engine_module
from agl_plugin_torch.engine import Engine
from agl_plugin_torch.sampling import SEED_SPACE, SamplingParams
from agl_plugin_torch.testing import prompt, sample

GOOD = SamplingParams(max_tokens=4)
FAILING = SamplingParams(max_tokens=4, temperature=1e-300)
"""Past the endpoint's checks, this temperature makes every row of its batch non-finite: sampling raises."""


@pytest.fixture
def batch_sizes(monkeypatch) -> list[int]:
    """The rows of every batch the engine generates (the real ``generate`` does the work)."""
    sizes, real = [], engine_module.generate

    def spy(model, prompts, params, **kwargs):
        sizes.append(len(prompts))
        return real(model, prompts, params, **kwargs)

    monkeypatch.setattr(engine_module, "generate", spy)
    return sizes


@pytest.fixture
def engine(backend):
    """A real engine over the tiny model that waits long enough for every quickly submitted request to join."""
    tokenizer = backend.tokenizer
    made = Engine(backend.actor, backend.lock, lambda: 0, eos_token_ids=[tokenizer.eos_token_id],
                  pad_token_id=tokenizer.pad_token_id,
                  decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                  generator=torch.Generator().manual_seed(0), batch_wait_s=0.5).start()
    yield made
    made.stop()


def test_a_failing_request_fails_alone_and_its_batch_mates_succeed(backend, engine, batch_sizes):
    ids = prompt(backend, "guess a number")
    futures = [engine.submit([ids], [params]) for params in (GOOD, FAILING, GOOD, GOOD)]
    with pytest.raises(RuntimeError):
        futures[1].result(timeout=60)
    good = [futures[i].result(timeout=60) for i in (0, 2, 3)]
    assert all(len(g.samples) == 1 and 1 <= len(g.samples[0].token_ids) <= 4 for g in good)
    assert batch_sizes == [4, 1, 1, 1, 1]  # the batch of four failed; each request ran again alone
    assert engine.submit([ids], [GOOD]).result(timeout=60).samples  # and the engine keeps serving


def test_a_request_cancelled_before_it_runs_is_not_generated(backend, engine, batch_sizes):
    ids = prompt(backend, "hello")
    first, dropped, last = (engine.submit([ids], [GOOD]) for _ in range(3))
    assert dropped.cancel()  # within the batch wait: the worker has not taken it yet
    assert first.result(timeout=60).samples and last.result(timeout=60).samples
    assert batch_sizes == [2]


@pytest.mark.parametrize("seed, same_as", [(5 + SEED_SPACE, 5), (-1, SEED_SPACE - 1)])
def test_a_seed_of_any_size_samples_like_torch_seeds_it(backend, seed, same_as):
    ids = prompt(backend, "guess a number")
    drawn = sample(backend, [ids, ids], [SamplingParams(max_tokens=6, seed=seed, ignore_eos=True),
                                         SamplingParams(max_tokens=6, seed=same_as, ignore_eos=True)])
    assert drawn[0].token_ids == drawn[1].token_ids


def test_a_streamed_request_hears_of_each_token_as_it_is_generated(backend, engine):
    ids = prompt(backend, "guess a number")
    heard, resolved_when = [], []
    params = [SamplingParams(max_tokens=5, ignore_eos=True, seed=s) for s in (1, 2)]

    def on_token(row, sample):
        heard.append((row, sample.token_ids[-1], sample.logprobs[-1], len(sample.token_ids)))

    streamed = engine.submit([ids, ids], params, on_token=on_token)
    plain = engine.submit([ids], [GOOD])  # batched with it: no calls for it
    streamed.add_done_callback(lambda _: resolved_when.append(len(heard)))
    samples = streamed.result(timeout=60).samples
    assert plain.result(timeout=60).samples
    assert resolved_when == [10]  # every token was heard before the request resolved
    for row, got in enumerate(samples):
        mine = [(token, logprob, count) for r, token, logprob, count in heard if r == row]
        assert mine == [(t, lp, i + 1) for i, (t, lp) in enumerate(zip(got.token_ids, got.logprobs))]
