"""Per-step metrics computed from the batch: data, timing and throughput (verl's names and values).

Column names follow verl: ``token_level_scores``, ``token_level_rewards``,
``advantages``, ``returns``, ``values`` and ``responses`` are ``(N, R)``;
``attention_mask`` is ``(N, P + R)`` with the response in its last R
columns. All statistics are vectorized over rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from agl_core.data import Batch

__all__ = ["RowStats", "compute_data_metrics", "compute_throughput_metrics", "compute_timing_metrics",
           "row_statistics", "sequence_lengths", "summarize"]


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of a batch (:func:`row_statistics`): one float64 row of the table per name.

    ``stats[rows]`` selects rows of the batch as ``batch[rows]`` does, with
    one NumPy fancy index for every statistic. The table is stored a
    statistic per row so that reducing one over the batch's rows reads
    contiguous memory.
    """

    table: np.ndarray  # (len(names), N) float64
    names: tuple[str, ...]
    max_prompt_length: int
    max_response_length: int
    use_critic: bool

    def __len__(self) -> int:
        return self.table.shape[1]

    def __getitem__(self, rows) -> RowStats:
        return RowStats(np.ascontiguousarray(self.table[:, rows]), self.names, self.max_prompt_length,
                        self.max_response_length, self.use_critic)

    def column(self, name: str) -> np.ndarray:
        """The statistic ``name`` of every row, ``(N,)``."""
        return self.table[self.names.index(name)]


def has_length_columns(batch: Batch) -> bool:
    """Whether ``batch`` carries ``prompt_length`` and ``response_length`` columns (the trace aggregators' do)."""
    return "prompt_length" in batch and "response_length" in batch


def sequence_lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_length, response_length)`` of each row, float ``(N,)``: the set bits of ``attention_mask``.

    Same as verl's ``_compute_response_info``, including its shortcut of
    taking ``prompt_length``/``response_length`` columns when both exist.
    """
    if has_length_columns(batch):
        return batch["prompt_length"], batch["response_length"]
    attention_mask = batch["attention_mask"]
    max_prompt_length = attention_mask.shape[-1] - batch["responses"].shape[-1]
    return (attention_mask[:, :max_prompt_length].sum(-1).float(),
            attention_mask[:, max_prompt_length:].sum(-1).float())


def row_statistics(batch: Batch, use_critic: bool,
                   lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> RowStats:
    """Per-row sums, extremes and counts from which the data metrics of any subset of rows follow.

    One pass over the ``(N, R)`` columns; :func:`summarize` then turns the
    statistics of any selection of rows into metrics without touching the
    big tensors again (the loop reports the same metrics before and after
    dropping and flooring rows). Tokens count when the response part of
    ``attention_mask`` is set; with length columns, they are the first
    ``response_length`` of each response (verl's right-padded layout; the
    trace aggregators write columns that agree with the mask, and the
    mask is not read). ``advantages``, ``returns`` and ``values``
    must be finite at the other positions (estimators write 0 there).
    ``lengths`` are the rows' :func:`sequence_lengths`, when already known.
    """
    prompt_length, response_length = sequence_lengths(batch) if lengths is None else lengths
    max_response_length = batch["responses"].shape[-1]
    max_prompt_length = batch["attention_mask"].shape[-1] - max_response_length
    names = ["advantages", "returns"] + (["values"] if use_critic else [])
    distinct = {id(batch[name]): batch[name] for name in names}  # outcome estimators return one tensor as both
    # Masked reductions by arithmetic with w, the 0/1 mask in the values' dtype (torch.where and masked_fill
    # are slow with a bool mask): a row's sum is w . x; with f = (w - 1) * finfo.max, its max is max(x + f)
    # and its min is min(x - f), exact for finite x. Two (N, R) buffers per dtype in all: a fresh temporary
    # per reduction costs more in page faults than the arithmetic.
    dtypes = {x.dtype for x in distinct.values()}
    if has_length_columns(batch):
        # w = clamp(length - position, 0, 1): 1 on the first ``length`` positions, in two float passes (a
        # comparison makes a bool mask, slow to build and to convert).
        weights = {dtype: torch.sub(response_length.to(dtype)[:, None],
                                    torch.arange(max_response_length, dtype=dtype)).clamp_(0, 1) for dtype in dtypes}
    else:
        valid = batch["attention_mask"][:, max_prompt_length:].bool()
        weights = {dtype: valid.view(torch.uint8).to(dtype) for dtype in dtypes}  # bool -> float directly is slow
    columns = {
        "score": batch["token_level_scores"].sum(-1),
        "reward": batch["token_level_rewards"].sum(-1),
        "prompt_length": prompt_length,
        "response_length": response_length,  # also the count of w's ones: the tokens the statistics cover
    }
    empty = response_length == 0
    reduced: dict[int, dict[str, torch.Tensor]] = {}
    if use_critic:  # before the weights become fences
        returns, values = batch["returns"].double(), batch["values"].double()
        weight = weights[batch["returns"].dtype].double()
        diff = (returns - values).mul_(weight)
        returns = returns * weight
        columns["returns_sq_sum"] = torch.linalg.vecdot(returns, returns)
        columns["diff_sum"] = diff.sum(-1)
        columns["diff_sq_sum"] = torch.linalg.vecdot(diff, diff)
    for dtype, weight in weights.items():
        xs = {key: x for key, x in distinct.items() if x.dtype == dtype}
        sums = {key: torch.linalg.vecdot(x, weight) for key, x in xs.items()}
        fence = weight.sub_(1).mul_(torch.finfo(dtype).max)  # w becomes f in place
        scratch = torch.empty_like(fence)
        for key, x in xs.items():
            reduced[key] = {
                "sum": sums[key],
                "max": torch.add(x, fence, out=scratch).amax(-1).masked_fill_(empty, -torch.inf),
                "min": torch.sub(x, fence, out=scratch).amin(-1).masked_fill_(empty, torch.inf),
            }
    for name in names:
        columns.update({f"{name}_{stat}": value for stat, value in reduced[id(batch[name])].items()})
    table = torch.stack(list(columns.values())).double().numpy()  # stack promotes mixed dtypes
    return RowStats(table, tuple(columns), max_prompt_length, max_response_length, use_critic)


def summarize(stats: RowStats, suffix: str = "") -> dict[str, float]:
    """The data metrics of the rows in ``stats`` (see :func:`compute_data_metrics`); ``{}`` when empty."""
    if len(stats) == 0:
        return {}
    # One NumPy reduction per kind over the whole table, then pick the statistics (as Python floats: NumPy
    # scalars are slow to index, divide and convert one by one).
    table = stats.table
    column = {name: i for i, name in enumerate(stats.names)}
    sums, maxes, mins = table.sum(1).tolist(), table.max(1).tolist(), table.min(1).tolist()
    means = [total / len(stats) for total in sums]  # what ndarray.mean computes
    out: dict[str, float] = {}
    for key, name in (("critic/score", "score"), ("critic/rewards", "reward"),
                      ("response_length", "response_length"), ("prompt_length", "prompt_length")):
        i = column[name]
        out.update({f"{key}/mean": means[i], f"{key}/max": maxes[i], f"{key}/min": mins[i]})
    n = sums[column["response_length"]]  # tokens the advantage statistics cover
    for name in ["advantages", "returns"] + (["values"] if stats.use_critic else []):
        if n > 0:
            out.update({f"critic/{name}/mean": sums[column[f"{name}_sum"]] / n,
                        f"critic/{name}/max": maxes[column[f"{name}_max"]],
                        f"critic/{name}/min": mins[column[f"{name}_min"]]})
        else:  # verl reports NaN rather than failing when no token is selected
            out.update({f"critic/{name}/{stat}": math.nan for stat in ("mean", "max", "min")})
    if stats.use_critic:
        out["critic/vf_explained_var"] = 1.0 - _variance(sums[column["diff_sum"]], sums[column["diff_sq_sum"]], n) / (
            _variance(sums[column["returns_sum"]], sums[column["returns_sq_sum"]], n) + 1e-5)
    out["response_length/clip_ratio"] = (stats.column("response_length") == stats.max_response_length).mean()
    out["prompt_length/clip_ratio"] = (stats.column("prompt_length") == stats.max_prompt_length).mean()
    return {key + suffix: float(value) for key, value in out.items()}


def _variance(total: float, total_sq: float, n: float) -> float:
    """Unbiased variance over all tokens from the sums of x and x² (torch.var's definition)."""
    if n < 2:  # one token or none: NaN, as torch.var gives
        return math.nan
    return (total_sq - total * total / n) / (n - 1)


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
    return summarize(row_statistics(batch, use_critic), suffix)


def compute_timing_metrics(timing_raw: dict[str, float], prompt_tokens: float,
                           response_tokens: float) -> dict[str, float]:
    """``timing_s/{stage}`` for every stage and ``timing_per_token_ms/{stage}`` for the known ones.

    Same keys and values as verl's ``compute_timing_metrics`` for a batch
    with ``prompt_tokens`` and ``response_tokens`` valid tokens: ``gen`` is
    normalized by response tokens; ``ref``, ``values``, ``adv``,
    ``update_critic`` and ``update_actor`` by prompt + response tokens;
    0.0 when there are no tokens (an empty batch).
    """
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
