"""Per-step metrics computed from the batch: data, timing and throughput (verl's names and values).

Column names follow verl: ``token_level_scores``, ``token_level_rewards``,
``advantages``, ``returns``, ``values`` and ``responses`` are ``(N, R)``;
``attention_mask`` is ``(N, P + R)`` with the response in its last R
columns. All statistics are vectorized over rows.
"""

from __future__ import annotations

import torch

from agl_core.data import Batch

__all__ = ["compute_data_metrics", "compute_throughput_metrics", "compute_timing_metrics"]


def _lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(prompt_length, response_length, max_prompt_length, max_response_length)``; lengths are float ``(N,)``.

    Same as verl's ``_compute_response_info``, including its shortcut of
    taking ``prompt_length``/``response_length`` columns when both exist.
    """
    max_response_length = batch["responses"].shape[-1]
    attention_mask = batch["attention_mask"]
    max_prompt_length = attention_mask.shape[-1] - max_response_length
    if "prompt_length" in batch and "response_length" in batch:
        return batch["prompt_length"], batch["response_length"], max_prompt_length, max_response_length
    prompt_length = attention_mask[:, :max_prompt_length].sum(-1).float()
    response_length = attention_mask[:, max_prompt_length:].sum(-1).float()
    return prompt_length, response_length, max_prompt_length, max_response_length


def _add_stats(stats: dict[str, torch.Tensor], name: str, values: torch.Tensor) -> None:
    if values.numel() == 0:
        # verl reports NaN rather than failing when nothing is selected.
        nan = torch.tensor(float("nan"), device=values.device)
        stats.update({f"{name}/mean": nan, f"{name}/max": nan, f"{name}/min": nan})
    else:
        stats.update({f"{name}/mean": values.mean(), f"{name}/max": values.max(), f"{name}/min": values.min()})


def _to_floats(stats: dict[str, torch.Tensor], suffix: str) -> dict[str, float]:
    # One device-to-host transfer for all statistics instead of one .item() each;
    # float64 holds every float32/int value exactly, so the numbers equal verl's .item().
    values = torch.stack([value.to(torch.float64) for value in stats.values()]).tolist()
    return {key + suffix: value for key, value in zip(stats, values)}


def compute_data_metrics(batch: Batch, use_critic: bool, suffix: str = "") -> dict[str, float]:
    """Score, reward, advantage, return (and value) statistics and prompt/response lengths of ``batch``.

    Matches Agent Lightning's variant of verl's ``compute_data_metrics``:
    ``critic/{score,rewards}/{mean,max,min}`` over the per-row sums of
    ``token_level_scores``/``token_level_rewards`` (all rows),
    ``critic/{advantages,returns}/{mean,max,min}`` (and, with ``use_critic``,
    ``critic/values/...`` and ``critic/vf_explained_var``) over the tokens
    selected by the response part of ``attention_mask``,
    ``response_length/{mean,max,min,clip_ratio}`` and
    ``prompt_length/{mean,max,min,clip_ratio}``; every key ends with
    ``suffix``. With verl 0.9.1 the values equal verl's for these keys when
    ``response_mask`` equals the response part of ``attention_mask`` and no
    row has an empty response (verl then leaves such rows out of score and
    reward). Statistics over an empty selection are NaN, as in verl. An
    empty batch gives ``{}``.
    """
    if len(batch) == 0:
        return {}
    prompt_length, response_length, max_prompt_length, max_response_length = _lengths(batch)
    valid = batch["attention_mask"][:, max_prompt_length:].bool()
    valid_returns = torch.masked_select(batch["returns"], valid)
    stats: dict[str, torch.Tensor] = {}
    _add_stats(stats, "critic/score", batch["token_level_scores"].sum(-1))
    _add_stats(stats, "critic/rewards", batch["token_level_rewards"].sum(-1))
    _add_stats(stats, "critic/advantages", torch.masked_select(batch["advantages"], valid))
    _add_stats(stats, "critic/returns", valid_returns)
    if use_critic:
        valid_values = torch.masked_select(batch["values"], valid)
        _add_stats(stats, "critic/values", valid_values)
        if valid_values.numel():
            explained = 1.0 - torch.var(valid_returns - valid_values) / (torch.var(valid_returns) + 1e-5)
        else:
            explained = torch.tensor(float("nan"), device=valid_values.device)
        stats["critic/vf_explained_var"] = explained
    _add_stats(stats, "response_length", response_length)
    stats["response_length/clip_ratio"] = torch.eq(response_length, max_response_length).float().mean()
    _add_stats(stats, "prompt_length", prompt_length)
    stats["prompt_length/clip_ratio"] = torch.eq(prompt_length, max_prompt_length).float().mean()
    return _to_floats(stats, suffix)


def compute_timing_metrics(batch: Batch, timing_raw: dict[str, float]) -> dict[str, float]:
    """``timing_s/{stage}`` for every stage and ``timing_per_token_ms/{stage}`` for the known ones.

    Same keys and values as verl's ``compute_timing_metrics``: ``gen`` is
    normalized by response tokens; ``ref``, ``values``, ``adv``,
    ``update_critic`` and ``update_actor`` by prompt + response tokens;
    0.0 when there are no tokens (an empty batch).
    """
    if len(batch) == 0:
        prompt_tokens = response_tokens = 0.0
    else:
        prompt_length, response_length, _, _ = _lengths(batch)
        prompt_tokens, response_tokens = torch.stack([prompt_length.sum(), response_length.sum()]).tolist()
    all_tokens = prompt_tokens + response_tokens
    tokens_of = {"gen": response_tokens, **dict.fromkeys(["ref", "values", "adv", "update_critic", "update_actor"],
                                                          all_tokens)}
    per_token = {
        f"timing_per_token_ms/{name}": timing_raw[name] * 1000 / tokens_of[name] if tokens_of[name] > 0 else 0.0
        for name in tokens_of
        if name in timing_raw
    }
    return {**{f"timing_s/{name}": value for name, value in timing_raw.items()}, **per_token}


def compute_throughput_metrics(batch: Batch, timing_raw: dict[str, float], n_devices: int) -> dict[str, float]:
    """``perf/total_num_tokens``, ``perf/time_per_step`` and ``perf/throughput`` (tokens per second per device).

    Same as verl's ``compute_throughout_metrics``: the token count is
    ``sum(batch.meta["global_token_num"])`` (the per-row attention-mask
    sums the loop stores) and the time is ``timing_raw["step"]``.
    """
    if "global_token_num" not in batch.meta:
        raise KeyError("batch.meta['global_token_num'] is missing: set it to the per-row token counts, "
                       "batch['attention_mask'].sum(-1).tolist(), before computing throughput")
    total = sum(batch.meta["global_token_num"])
    time = timing_raw["step"]
    return {"perf/total_num_tokens": total, "perf/time_per_step": time, "perf/throughput": total / (time * n_devices)}
