"""Time the trajectory aggregator of agl-plugin-traces against a per-triplet Python implementation.

Builds 4,096 succeeded rollouts of 8 model calls each, the way an agent with
tools produces them: the first prompt has about 200 tokens, every call
answers with about 50, and every later prompt is the previous prompt + the
previous response + about 200 new tokens (the tool's result), so the calls
of a rollout merge into one row of about 2,000 tokens. One rollout in 16
breaks the prefix once (its history is re-rendered), so the break path runs
too. By default the spans are parsed from JSON, as a store hands them over
(``--source python`` builds them from shared Python lists instead).

Both implementations run the same algorithm on the same spans, each in the
form its trainer holds them, parsed from the same JSON before its timing
starts. Each is timed with only its own spans in memory (ours first, then
the reference), as a trainer holds one form or the other; the reference's
list spans are GBs of Python objects, and that heap slows whatever runs
next to it by about 15%:

* ``reference``: the approach of the reference trainer (Agent Lightning's
  ``get_train_data_batch``), written straightforwardly: per rollout, per
  triplet, Python lists for every row (padded ids, attention mask, response
  mask, log-probs, scores), then ``torch.tensor`` over the lists of rows. Its
  spans hold token ids and log-probs as Python lists (``ListSpan``, the
  reference's span model), one int object per id.
* ``ours``: ``agl_plugin_traces.trajectory.trajectory_batch`` on agl_core's
  ``Span``, which holds them packed (``TokenIds``, ``LogProbs``: 8 bytes
  each). Packing happens when a span is validated, i.e. while the store
  parses it: ``parse_s`` and ``parse_lists_s`` are the times to parse all
  spans from JSON into each form (not part of either aggregation time).

Every output tensor and column is asserted identical, then one JSON line is
printed:

    {"bench": "aggregation", "aggregator": "trajectory", "source": "json", "rollouts": 4096, "turns": 8, "rows": ...,
     "tokens": ..., "ours_s": ..., "reference_s": ..., "speedup": ..., "ours_cpu_s": ...,
     "reference_cpu_s": ..., "speedup_cpu": ..., "prefix_check_s": ..., "parse_s": ...,
     "parse_lists_s": ..., "output_bytes": ..., "peak_bytes": ..., "peak_over_output": ...}

Times are medians over ``--repeats`` runs after one untimed warm-up (the
reference: over a third as many), with torch.set_num_threads(2), in wall
seconds (``*_s``) and in CPU seconds of the process (``*_cpu_s``, which other
processes on a shared machine do not stretch).
``prefix_check_s`` is the time of the token comparisons alone (each prompt
against the previous prompt + response) on the list spans, which any exact
implementation on Python lists makes: a floor for the reference. ``peak_bytes`` is the peak of memory allocated while
our aggregator builds the batch (a separate run, measured as the kernel's
high-water mark of the resident set, so every allocation counts), and
``output_bytes`` the size of the output tensors (``prompts`` and
``responses`` are views of ``input_ids``: each storage counts once). Linux only.
Our aggregator pages its output in on a helper thread while it walks the
rollouts (``agl_plugin_traces.reservation``).

    python benchmarks/bench_aggregation.py [--rollouts 4096] [--turns 8] [--repeats 3] [--source json|python]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from pydantic import BaseModel

from agl_core.data import Batch, Rollout, Span
from agl_plugin_traces.trajectory import trajectory_batch
from procmem import reset_peak, status_bytes

MAX_PROMPT, MAX_RESPONSE = 256, 2048


# --------------------------------------------------------------------------- workload


class ListSpan(BaseModel):
    """The span as the reference trainer holds it: agl_core's ``Span`` fields, token ids and log-probs as lists."""

    rollout_id: str
    attempt_id: str = "0"
    sequence_id: int
    kind: str
    prompt_token_ids: list[int] = []
    response_token_ids: list[int] = []
    response_logprobs: list[float] | None = None
    reward: float | None = None
    attributes: dict = {}
    start_time: float | None = None
    end_time: float | None = None


def make_records(n_rollouts: int, turns: int, seed: int = 0, source: str = "json") -> list[tuple[dict, list]]:
    """Agent-like rollouts (see the module docstring): per rollout, its fields and its spans, each span as JSON
    text (``source="json"``) or as the dict of Python lists the generator built (``"python"``)."""
    rng = random.Random(seed)

    def tokens(mean: int) -> list[int]:
        return [rng.randrange(1000, 150_000) for _ in range(rng.randint(mean * 9 // 10, mean * 11 // 10))]

    records = []
    for r in range(n_rollouts):
        rollout_id = f"rollout-{r}"
        prompt, spans = tokens(200), []
        break_at = rng.randrange(1, turns) if r % 16 == 0 and turns > 1 else None
        for turn in range(turns):
            if turn == break_at:
                prompt = [7] + prompt[1:]  # the history re-rendered with another first token
            response = tokens(50)
            spans.append({"rollout_id": rollout_id, "sequence_id": 2 * turn, "kind": "llm_call",
                          "prompt_token_ids": prompt, "response_token_ids": response,
                          "response_logprobs": [-rng.random() for _ in response]})
            prompt = prompt + response + tokens(200)
        spans.append({"rollout_id": rollout_id, "sequence_id": 2 * turns, "kind": "reward", "reward": rng.random()})
        fields = {"rollout_id": rollout_id, "task_id": f"task-{r // 8}", "status": "succeeded",
                  "final_reward": spans[-1]["reward"]}
        records.append((fields, [json.dumps(s) for s in spans] if source == "json" else spans))
    return records


def make_rollouts(records: list[tuple[dict, list]], span_model: type[BaseModel] = Span) -> list[Rollout]:
    """The rollouts of ``records``, their spans validated as ``span_model``.

    From JSON text, as a store hands spans over: every token id is parsed on
    its own (a separate Python int in a ``ListSpan``). From dicts: where later
    prompts share the int objects of earlier ones, so list comparisons
    short-cut on identity.
    """
    # model_construct: the spans are validated already (and a ListSpan is not agl_core's Span).
    return [Rollout.model_construct(**fields, spans=[
        span_model.model_validate_json(s) if isinstance(s, str) else span_model.model_validate(s) for s in spans])
        for fields, spans in records]


# --------------------------------------------------------------------------- the reference approach


def left_pad(ids: list, length: int, pad) -> tuple[list, list]:
    return [pad] * (length - len(ids)) + ids, [0] * (length - len(ids)) + [1] * len(ids)


def right_pad(ids: list, length: int, pad) -> tuple[list, list]:
    return ids + [pad] * (length - len(ids)), [1] * len(ids) + [0] * (length - len(ids))


def reference_trajectory(rollouts: list[Rollout], max_prompt: int, max_response: int, pad: int = 0) -> Batch:
    """The same algorithm as ``trajectory_batch`` (default settings), one triplet and one row at a time."""
    columns: dict[str, list] = {k: [] for k in ("prompts", "prompt_mask", "responses", "response_attention",
                                                  "response_mask", "scores", "logprobs", "drop", "uid",
                                                  "rollout_id", "turn_index", "prompt_length",
                                                  "response_length")}
    for rollout in rollouts:
        if rollout.status != "succeeded":
            continue
        reward = rollout.final_reward if rollout.final_reward is not None else 0.0
        # spans -> triplets: ordered, no errors, no empty calls, the last of each retried prompt
        triplets: list[dict] = []
        for span in sorted((s for s in rollout.spans if s.kind == "llm_call"), key=lambda s: s.sequence_id):
            if span.attributes.get("error") or not span.prompt_token_ids or not span.response_token_ids:
                continue
            triplets = [t for t in triplets if t["prompt_ids"] != span.prompt_token_ids]
            triplets.append({"prompt_ids": span.prompt_token_ids, "response_ids": span.response_token_ids,
                             "logprobs": span.response_logprobs})
        # merge: consecutive triplets whose prompt starts with the previous prompt + response
        segments: list[list[int]] = []
        context: list[int] | None = None
        for turn, triplet in enumerate(triplets):
            prompt = triplet["prompt_ids"]
            if context is not None and prompt[:len(context)] == context:
                segments[-1].append(turn)
            else:
                segments.append([turn])
            context = prompt + triplet["response_ids"]
        for segment in segments:
            first = triplets[segment[0]]
            prompt = list(first["prompt_ids"])
            response, mask, logprobs = [], [], []
            drop = False
            if len(prompt) > max_prompt:
                if segment[0] > 0:  # a later segment: the overflow is context, mask 0
                    response, mask, logprobs = prompt[max_prompt:], [0] * (len(prompt) - max_prompt), \
                        [0.0] * (len(prompt) - max_prompt)
                    prompt = prompt[:max_prompt]
                else:
                    prompt, drop = prompt[-max_prompt:], True
            seen = len(first["prompt_ids"])
            for turn in segment:
                triplet = triplets[turn]
                new = triplet["prompt_ids"][seen:] if turn != segment[0] else []
                response += new
                mask += [0] * len(new)
                logprobs += [0.0] * len(new)
                response += triplet["response_ids"]
                mask += [1] * len(triplet["response_ids"])
                logprobs += triplet["logprobs"]
                seen = len(triplet["prompt_ids"]) + len(triplet["response_ids"])
            response, mask, logprobs = response[:max_response], mask[:max_response], logprobs[:max_response]
            if 1 not in mask:
                continue
            last = len(mask) - 1 - mask[::-1].index(1)
            scores = [0.0] * max_response
            scores[last] = reward
            padded_prompt, prompt_mask = left_pad(prompt, max_prompt, pad)
            padded_response, response_attention = right_pad(response, max_response, pad)
            columns["prompts"].append(padded_prompt)
            columns["prompt_mask"].append(prompt_mask)
            columns["responses"].append(padded_response)
            columns["response_attention"].append(response_attention)
            columns["response_mask"].append(right_pad(mask, max_response, 0)[0])
            columns["logprobs"].append(right_pad(logprobs, max_response, 0.0)[0])
            columns["scores"].append(scores)
            columns["drop"].append(drop)
            columns["prompt_length"].append(len(prompt))
            columns["response_length"].append(len(response))
            columns["uid"].append(rollout.task_id)
            columns["rollout_id"].append(rollout.rollout_id)
            columns["turn_index"].append(segment[0])
    prompts, responses = torch.tensor(columns["prompts"]), torch.tensor(columns["responses"])
    attention_mask = torch.cat([torch.tensor(columns["prompt_mask"]), torch.tensor(columns["response_attention"])], 1)
    uid = np.array(columns["uid"], dtype=object)
    return Batch(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
                 "attention_mask": attention_mask,
                 "position_ids": torch.clamp(torch.cumsum(attention_mask, -1) - 1, min=0),
                 "response_mask": torch.tensor(columns["response_mask"]),
                 "token_level_scores": torch.tensor(columns["scores"], dtype=torch.float32),
                 "is_drop_mask": torch.tensor(columns["drop"], dtype=torch.bool),
                 "rollout_log_probs": torch.tensor(columns["logprobs"], dtype=torch.float32),
                 "prompt_length": torch.tensor(columns["prompt_length"], dtype=torch.float32),
                 "response_length": torch.tensor(columns["response_length"], dtype=torch.float32)},
        non_tensors={"uid": uid, "data_id": uid.copy(), "rollout_id": np.array(columns["rollout_id"], dtype=object),
                     "turn_index": np.array(columns["turn_index"], dtype=np.int64)})


# --------------------------------------------------------------------------- measuring


def ours(rollouts: list[Rollout]) -> Batch:
    return trajectory_batch(rollouts, MAX_PROMPT, MAX_RESPONSE)[0]


def prefix_check(rollouts: list[Rollout]) -> None:
    """Only the token comparisons any exact implementation makes: each prompt against the previous prompt + response.

    Every prompt token id is a separate Python int parsed from JSON, so
    this alone reads the spans' 29 M prompt ids once; it bounds how fast any
    implementation can be.
    """
    for rollout in rollouts:
        previous = None
        for span in rollout.spans:
            if span.kind != "llm_call":
                continue
            if previous is not None:
                prompt, n, m = span.prompt_token_ids, len(previous.prompt_token_ids), len(previous.response_token_ids)
                _ = prompt[:n] == previous.prompt_token_ids and prompt[n:n + m] == previous.response_token_ids
            previous = span


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """Median wall and CPU seconds of ``fn`` over ``repeats`` runs after a warm-up; returns the last result too.

    CPU seconds (this process, all its threads) are reported next to wall
    seconds because on a shared machine other processes stretch the wall
    time, not the CPU time.
    """
    result = fn()
    wall, cpu = [], []
    for _ in range(repeats):
        del result  # free the previous output before building the next one
        gc.collect()
        start, start_cpu = time.perf_counter(), time.process_time()
        result = fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall), statistics.median(cpu), result


def assert_identical(a: Batch, b: Batch) -> None:
    assert sorted(a.keys()) == sorted(b.keys()), (sorted(a.keys()), sorted(b.keys()))
    for name, value in a.tensors.items():
        other = b[name]
        assert value.dtype == other.dtype and value.shape == other.shape, (name, value.dtype, other.dtype)
        assert torch.equal(value, other), f"tensor {name} differs"
    for name, value in a.non_tensors.items():
        assert np.array_equal(value, b[name]), f"column {name} differs"


def output_bytes(batch: Batch) -> int:
    """Bytes the batch's tensors span, each storage counted once.

    ``prompts`` and ``responses`` are views of ``input_ids``, and tensors
    paged in ahead sit at the start of a storage with a few spare rows.
    """
    spans: dict[int, int] = {}
    for t in batch.tensors.values():
        last = t.storage_offset() + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        storage = t.untyped_storage().data_ptr()
        spans[storage] = max(spans.get(storage, 0), (last + 1) * t.element_size())
    return sum(spans.values())


def peak_bytes(fn: Callable[[], Batch]) -> int:
    """Peak resident memory that ``fn`` adds while it runs.

    The kernel's high-water mark of the resident set (VmHWM) is reset to the
    current size (``echo 5 > /proc/self/clear_refs``), so its value after the
    call is the peak during the call; this counts every allocation, torch's
    and NumPy's included. glibc first returns the free memory it holds to the
    kernel (``malloc_trim``): memory freed by earlier runs and reused here then
    counts as it is touched again, instead of hiding in the resident set.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    reset_peak()
    before = status_bytes("VmRSS")
    result = fn()
    peak = status_bytes("VmHWM")
    del result
    return peak - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", choices=["json", "python"], default="json",
                        help="spans parsed from JSON (as from a store) or built from shared Python lists")
    args = parser.parse_args()
    torch.set_num_threads(2)

    records = make_records(args.rollouts, args.turns, source=args.source)
    # Each side is timed with only its own spans in memory, as a trainer holds one form or the other: the
    # reference's list spans take GBs of Python objects, and that heap slows whatever runs next to it.
    start = time.perf_counter()
    rollouts = make_rollouts(records)
    parse_s = time.perf_counter() - start
    ours_s, ours_cpu_s, batch = median_seconds(partial(ours, rollouts), args.repeats)
    peak = peak_bytes(partial(ours, rollouts))
    del rollouts
    start = time.perf_counter()
    list_rollouts = make_rollouts(records, span_model=ListSpan)
    parse_lists_s = time.perf_counter() - start
    del records
    prefix_check_s, _, _ = median_seconds(partial(prefix_check, list_rollouts), args.repeats)
    reference_s, reference_cpu_s, expected = median_seconds(
        partial(reference_trajectory, list_rollouts, MAX_PROMPT, MAX_RESPONSE), max(1, args.repeats // 3))
    assert_identical(batch, expected)
    size, rows, tokens = output_bytes(batch), len(batch), int(batch["attention_mask"].sum())
    print(json.dumps({
        "bench": "aggregation", "aggregator": "trajectory", "source": args.source, "rollouts": args.rollouts,
        "turns": args.turns,
        "rows": rows, "tokens": tokens,
        "ours_s": round(ours_s, 4), "reference_s": round(reference_s, 4), "speedup": round(reference_s / ours_s, 1),
        "ours_cpu_s": round(ours_cpu_s, 4), "reference_cpu_s": round(reference_cpu_s, 4),
        "speedup_cpu": round(reference_cpu_s / ours_cpu_s, 1), "prefix_check_s": round(prefix_check_s, 4),
        "parse_s": round(parse_s, 2), "parse_lists_s": round(parse_lists_s, 2),
        "output_bytes": size, "peak_bytes": peak, "peak_over_output": round(peak / size, 2),
    }))


if __name__ == "__main__":
    main()
