"""Batched sampling: per-row parameters, stop conditions, seeds, and log-probs of the model's own distribution."""

import pytest
import torch

from agl_plugin_torch.sampling import LENGTH, STOP, SamplingParams, generate, sampling_distribution
from agl_plugin_torch.testing import full_forward_logprobs, prompt, sample


def test_logprobs_are_the_raw_model_distribution_whatever_the_batch(backend):
    prompts = [prompt(backend, "guess a number"), prompt(backend, "hello"), prompt(backend, "1 2 3 4 5 6")]
    params = [SamplingParams(max_tokens=6, temperature=0.7, top_k=5, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0),
              SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, ignore_eos=True)]
    for p, s in zip(prompts, sample(backend, prompts, params)):
        # Batched, left-padded, cached decoding and one plain forward pass agree.
        assert s.logprobs == pytest.approx(full_forward_logprobs(backend, p, s.token_ids), abs=1e-5)


def test_greedy_rows_take_the_most_likely_token(backend):
    p = prompt(backend, "guess a number")
    (s,) = sample(backend, [p], [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, top_logprobs=3)])
    for token, logprob, top in zip(s.token_ids, s.logprobs, s.top_logprobs):
        assert top[0] == (token, logprob) and len(top) == 3
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_a_seeded_row_draws_the_same_tokens_in_any_batch(backend):
    p = prompt(backend, "guess a number")
    seeded = SamplingParams(max_tokens=8, seed=1234, ignore_eos=True)
    alone = sample(backend, [p], [seeded])[0]
    others = [prompt(backend, "hello world"), prompt(backend, "1 2 3")]
    crowd = sample(backend, [others[0], p, others[1]],
                   [SamplingParams(max_tokens=3), seeded, SamplingParams(max_tokens=8, ignore_eos=True)],
                   generator=torch.Generator().manual_seed(99))[1]
    assert crowd.token_ids == alone.token_ids


def test_rows_stop_at_their_own_limits(backend):
    tokenizer = backend.tokenizer
    p = prompt(backend, "hello")
    free = sample(backend, [p], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)])[0]
    stop_token = free.token_ids[1]
    by_token, by_length = sample(backend, [p, p], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                                  stop_token_ids=(stop_token,)),
                                                   SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])
    first_stop = free.token_ids.index(stop_token) + 1
    assert (by_token.token_ids, by_token.finish_reason) == (free.token_ids[:first_stop], STOP)
    assert (by_length.token_ids, by_length.finish_reason) == (free.token_ids[:4], LENGTH)
    stop_text = tokenizer.decode(free.token_ids[2:3], skip_special_tokens=True)
    if stop_text:  # the greedy continuation holds a word to stop at
        by_text = sample(backend, [p], [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True,
                                                       stop=(stop_text,))])[0]
        assert by_text.finish_reason == STOP and stop_text not in by_text.text
        assert by_text.token_ids == free.token_ids[:len(by_text.token_ids)]


def test_eos_ends_a_row_unless_ignored(backend):
    p = prompt(backend, "hello")
    first = sample(backend, [p], [SamplingParams(max_tokens=1, temperature=0.0)])[0].token_ids[0]
    tokenizer = backend.tokenizer
    # Declared an EOS id, the greedy first token ends the row at once (kept in token_ids, as vLLM does).
    ended, ignored = generate(backend.actor, [p, p], [SamplingParams(max_tokens=5, temperature=0.0),
                                                      SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)],
                              eos_token_ids=[first], pad_token_id=tokenizer.pad_token_id,
                              decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    assert (ended.token_ids, ended.finish_reason) == ([first], STOP)
    assert (len(ignored.token_ids), ignored.finish_reason) == (5, LENGTH)


def test_top_k_and_top_p_keep_the_most_likely_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    probs = sampling_distribution(logits, temperature=torch.ones(3), top_k=torch.tensor([2, 0, 0]),
                                  top_p=torch.tensor([1.0, 0.7, 0.01]))
    assert probs[0].tolist() == pytest.approx([0.625, 0.375, 0, 0])  # top-2, renormalised
    assert probs[1].tolist() == pytest.approx([0.625, 0.375, 0, 0])  # 0.5 + 0.3 reaches 0.7
    assert probs[2].tolist() == pytest.approx([1, 0, 0, 0])  # the most likely token always stays
    hot = sampling_distribution(logits[:1], torch.tensor([2.0]), torch.tensor([0]), torch.tensor([1.0]))
    assert hot[0].tolist() == pytest.approx((logits[0] / 2).softmax(-1).tolist())


def test_sampled_tokens_follow_the_sampling_distribution():
    from agl_plugin_torch.sampling import _Rows

    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log().expand(20_000, -1)
    rows = _Rows([SamplingParams(max_tokens=1)] * 10_000 + [SamplingParams(max_tokens=1, seed=i) for i in range(10_000)],
                 torch.device("cpu"))
    tokens = rows.choose(logits, torch.Generator().manual_seed(0))
    for drawn in (tokens[:10_000], tokens[10_000:]):  # the shared generator's rows, then the seeded rows
        frequencies = torch.bincount(drawn, minlength=5) / len(drawn)
        assert frequencies.tolist() == pytest.approx(probs.tolist(), abs=0.015)
        assert frequencies[4] == 0  # a token with no probability is never drawn


def test_a_static_kv_cache_generates_what_the_dynamic_one_does(backend):
    """``kv_cache="static"`` (the whole cache allocated up front, a fixed-width mask) changes no sample or log-prob."""
    tokenizer = backend.tokenizer
    prompts = [prompt(backend, "guess a number"), prompt(backend, "hello"), prompt(backend, "1 2 3 4 5 6")]
    params = [SamplingParams(max_tokens=7, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=3, temperature=0.0),
              SamplingParams(max_tokens=5, temperature=1.0, seed=9)]

    def run(kv_cache):
        return generate(backend.actor, prompts, params, eos_token_ids=[tokenizer.eos_token_id],
                        pad_token_id=tokenizer.pad_token_id,
                        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), kv_cache=kv_cache)

    for dynamic, static in zip(run("dynamic"), run("static")):
        assert static.token_ids == dynamic.token_ids and static.finish_reason == dynamic.finish_reason
        assert static.logprobs == pytest.approx(dynamic.logprobs, abs=1e-5)
    with pytest.raises(ValueError, match="kv_cache must be"):
        run("paged")
