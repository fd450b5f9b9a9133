"""agl_core.metrics against verl 0.9.1's metric_utils on randomized batches."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo import metric_utils as verl_metrics

from agl_core.data import Batch
from agl_core.metrics import compute_data_metrics, compute_throughput_metrics, compute_timing_metrics

DATA_KEYS = [
    *(f"critic/{name}/{stat}" for name in ("score", "rewards", "advantages", "returns")
      for stat in ("mean", "max", "min")),
    *(f"response_length/{stat}" for stat in ("mean", "max", "min", "clip_ratio")),
    *(f"prompt_length/{stat}" for stat in ("mean", "max", "min", "clip_ratio")),
]
CRITIC_KEYS = ["critic/values/mean", "critic/values/max", "critic/values/min", "critic/vf_explained_var"]


def random_batch(seed: int, n: int = 64, prompt_width: int = 24, response_width: int = 16,
                 min_response: int = 1) -> Batch:
    """A verl-shaped batch: left-padded prompts, right-padded responses, rewards on the last response token."""
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, prompt_width + 1, (n,), generator=g)
    response_len = torch.randint(min_response, response_width + 1, (n,), generator=g)
    prompt_len[0], response_len[1] = prompt_width, response_width  # some rows at the length limits
    columns = torch.arange(prompt_width)
    prompt_mask = (columns >= prompt_width - prompt_len[:, None]).long()
    response_mask = (torch.arange(response_width) < response_len[:, None]).long()
    last = (response_len - 1).clamp(min=0)
    scores = torch.zeros(n, response_width)
    scores[torch.arange(n), last] = torch.randn(n, generator=g) * response_mask[torch.arange(n), last]
    noise = torch.randn(n, response_width, generator=g) * 0.01
    return Batch(
        tensors={
            "prompts": torch.randint(0, 1000, (n, prompt_width), generator=g),
            "responses": torch.randint(0, 1000, (n, response_width), generator=g),
            "attention_mask": torch.cat([prompt_mask, response_mask], dim=1),
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores - noise * response_mask,
            "advantages": torch.randn(n, response_width, generator=g) * response_mask,
            "returns": torch.randn(n, response_width, generator=g) * response_mask,
            "values": torch.randn(n, response_width, generator=g) * response_mask,
        },
        non_tensors={"uid": np.array([str(i // 4) for i in range(n)], dtype=object)},
        meta={"global_token_num": torch.cat([prompt_mask, response_mask], dim=1).sum(-1).tolist()},
    )


def assert_close(ours: dict, theirs: dict, keys) -> None:
    for key in keys:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6, nan_ok=True), key


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("use_critic", [True, False])
def test_data_metrics_match_verl(seed, use_critic):
    batch = random_batch(seed, n=16 + 40 * seed)
    ours = compute_data_metrics(batch, use_critic)
    theirs = verl_metrics.compute_data_metrics(batch.to_dataproto(), use_critic=use_critic)
    expected_keys = DATA_KEYS + (CRITIC_KEYS if use_critic else [])
    assert sorted(ours) == sorted(expected_keys)
    assert_close(ours, theirs, expected_keys)
    assert all(isinstance(value, float) for value in ours.values())


def test_suffix_is_appended_to_every_key():
    batch = random_batch(1)
    plain = compute_data_metrics(batch, use_critic=True)
    suffixed = compute_data_metrics(batch, use_critic=True, suffix="_before_processing")
    assert suffixed == {key + "_before_processing": value for key, value in plain.items()}


def test_float64_columns_give_verl_numbers_exactly():
    batch = random_batch(3)
    for name in ("token_level_scores", "token_level_rewards", "advantages", "returns", "values"):
        batch[name] = batch[name].double()
    ours = compute_data_metrics(batch, use_critic=True)
    theirs = verl_metrics.compute_data_metrics(batch.to_dataproto(), use_critic=True)
    for key, value in ours.items():
        assert value == theirs[key], key


def test_empty_responses_count_in_scores_like_agent_lightning():
    """Rows with no response tokens stay in score/reward statistics (Agent Lightning; verl 0.9.1 drops them)."""
    batch = random_batch(5, min_response=0)
    batch["attention_mask"][2, -16:] = 0
    batch["token_level_scores"][2] = 0.0
    batch["token_level_scores"][2, 0] = 100.0  # visible in the mean only if the row counts
    metrics = compute_data_metrics(batch, use_critic=False)
    row_scores = batch["token_level_scores"].sum(-1)
    assert metrics["critic/score/mean"] == pytest.approx(row_scores.mean().item())
    assert metrics["critic/score/max"] == 100.0
    assert metrics["response_length/min"] == 0.0


def test_no_response_tokens_gives_nan_token_statistics():
    batch = random_batch(2, n=4)
    batch["attention_mask"][:, -16:] = 0
    metrics = compute_data_metrics(batch, use_critic=True)
    for key in ["critic/advantages/mean", "critic/returns/min", "critic/values/max", "critic/vf_explained_var"]:
        assert math.isnan(metrics[key]), key
    assert metrics["response_length/max"] == 0.0
    assert not math.isnan(metrics["critic/score/mean"])


@pytest.mark.parametrize("use_critic", [False, True])
def test_length_columns_shortcut_matches_verl_and_the_mask(use_critic):
    """With prompt_length/response_length columns (as the trace aggregators write them, in agreement with the
    attention mask) the mask is not read: the metrics equal verl's and those computed from the mask."""
    batch = random_batch(4)
    from_mask = compute_data_metrics(batch, use_critic=use_critic)
    width = batch["responses"].shape[-1]
    batch["prompt_length"] = batch["attention_mask"][:, :-width].sum(-1).float()
    batch["response_length"] = batch["attention_mask"][:, -width:].sum(-1).float()
    ours = compute_data_metrics(batch, use_critic=use_critic)
    theirs = verl_metrics.compute_data_metrics(batch.to_dataproto(), use_critic=use_critic)
    assert_close(ours, theirs, DATA_KEYS + (CRITIC_KEYS if use_critic else []))
    assert ours == pytest.approx(from_mask, nan_ok=True)


def test_empty_batch_data_metrics():
    assert compute_data_metrics(Batch.empty(), use_critic=True) == {}
    assert compute_data_metrics(random_batch(0)[[]], use_critic=True, suffix="_x") == {}


TIMING = {"gen": 3.0, "reward": 0.5, "old_log_prob": 0.7, "ref": 0.4, "values": 0.3, "adv": 0.01,
          "update_critic": 1.1, "update_actor": 2.2, "step": 9.5}


def token_counts(batch: Batch) -> tuple[float, float]:
    """(prompt tokens, response tokens) of a batch, from its attention mask."""
    if len(batch) == 0:
        return 0.0, 0.0
    mask, width = batch["attention_mask"], batch["responses"].shape[-1]
    return float(mask[:, :-width].sum()), float(mask[:, -width:].sum())


@pytest.mark.parametrize("seed", range(4))
def test_timing_metrics_match_verl(seed):
    batch = random_batch(seed, n=32 + seed)
    timing = {name: value * (seed + 1) for name, value in TIMING.items()}
    ours = compute_timing_metrics(timing, *token_counts(batch))
    theirs = verl_metrics.compute_timing_metrics(batch.to_dataproto(), timing)
    assert sorted(ours) == sorted(theirs)
    assert_close(ours, theirs, theirs)
    assert ours["timing_s/reward"] == timing["reward"]
    assert "timing_per_token_ms/reward" not in ours


def test_timing_metrics_of_an_empty_batch():
    empty = random_batch(0)[[]]
    theirs = verl_metrics.compute_timing_metrics(empty.to_dataproto(), TIMING)
    assert compute_timing_metrics(TIMING, *token_counts(empty)) == theirs
    assert compute_timing_metrics(TIMING, 0.0, 0.0) == theirs
    assert theirs["timing_per_token_ms/gen"] == 0.0


@pytest.mark.parametrize("n_devices", [1, 8])
def test_throughput_metrics_match_verl(n_devices):
    batch = random_batch(7)
    ours = compute_throughput_metrics(batch, TIMING, n_devices)
    theirs = verl_metrics.compute_throughout_metrics(batch.to_dataproto(), TIMING, n_devices)
    assert ours == theirs
    assert ours["perf/total_num_tokens"] == int(batch["attention_mask"].sum())


def test_throughput_needs_global_token_num():
    batch = random_batch(0)
    del batch.meta["global_token_num"]
    with pytest.raises(KeyError, match="global_token_num"):
        compute_throughput_metrics(batch, TIMING, 1)
    empty = Batch(meta={"global_token_num": []})
    assert compute_throughput_metrics(empty, TIMING, 2)["perf/throughput"] == 0.0
