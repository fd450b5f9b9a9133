"""The core's own time per training step, side by side with the direct calls without our layer.

A backend plugin whose hooks are instant (they hand back precomputed tensors,
the post-process stage the columns agl-plugin-traces builds) runs a full step
through every hook of the loop: collect, the post-process
pipeline, pad, old log-probs, reference log-probs, unpad, KL in reward,
advantage (grpo), data metrics before and after, drop, shuffle and floor,
balance, actor update, timing and throughput metrics. The reference is the
same backend work and the same algorithm math (KL penalty in the reward, the
grpo estimator) called directly, in one function, with nothing of agl_core's
layer around it. The difference is the core's
overhead: hook dispatch, batch operations, filters and metrics.

The two run alternately, one step each, ``REPEATS`` times, and the medians
are compared: both see the same machine (this VM's speed drifts by tens of
percent within minutes) and the same caches (each starts where the other
left off, as a step starts after the backend's work in a real run).

At world_size 8 the step also balances tokens over the ranks (exact
Karmarkar-Karp, verl's partitions). Like the KL penalty and grpo, that is
algorithm work, which the reference does too (with the same function, as it
uses agl_core's KL and grpo functions); its time is printed on its own
(``balance_ms``) next to verl's ``get_seqlen_balanced_partitions`` on the
same rows (``verl_balance_ms``).

Prints one JSON line per data-parallel size. Target: core overhead <= 2 ms per step for 1,024 rows.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time

import numpy as np
import torch
from verl.utils.seqlen_balancing import get_seqlen_balanced_partitions

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.algorithms.advantages import grpo
from agl_core.algorithms.kl import FixedKLController, apply_kl_penalty
from agl_core.balance import balanced_order, workload
from agl_core.config import load
from agl_core.data import Batch, Task
from agl_core.loop import Trainer

ROWS, PROMPT, RESPONSE, GROUP = 1024, 512, 512, 8
REPEATS = 200


def make_columns(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, RESPONSE + 1, (ROWS,), generator=g)
    response_mask = (torch.arange(RESPONSE) < lengths[:, None]).long()
    prompt_mask = torch.ones(ROWS, PROMPT, dtype=torch.long)
    scores = torch.zeros(ROWS, RESPONSE)
    scores[torch.arange(ROWS), lengths - 1] = torch.randint(0, 2, (ROWS,), generator=g).float()
    prompts = torch.randint(0, 1000, (ROWS, PROMPT), generator=g)
    responses = torch.randint(0, 1000, (ROWS, RESPONSE), generator=g)
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask, "position_ids": attention_mask.cumsum(-1) - 1,
        "response_mask": response_mask, "token_level_scores": scores,
        "is_drop_mask": torch.zeros(ROWS, dtype=torch.bool),
        # The trace aggregators' length columns (verl's metrics and the loop read them instead of the mask).
        "prompt_length": prompt_mask.sum(-1).float(), "response_length": lengths.float(),
        "old_log_probs": -torch.rand(ROWS, RESPONSE, generator=g) * response_mask,
        "entropys": torch.rand(ROWS, RESPONSE, generator=g) * response_mask,
        "ref_log_prob": -torch.rand(ROWS, RESPONSE, generator=g) * response_mask,
    }


COLUMNS = make_columns()
SEQLENS = (COLUMNS["prompt_length"] + COLUMNS["response_length"]).numpy()  # valid tokens per row: what is balanced
TRACE_COLUMNS = [k for k in COLUMNS if k not in ("old_log_probs", "entropys", "ref_log_prob")]
UID = np.array([f"task-{i // GROUP}" for i in range(ROWS)], dtype=object)


class InstantBackend:
    """Every slot of the step, answered with precomputed tensors."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, world_size: int):
        self.world_size = world_size

    @hookimpl
    def on_train_start(self, ctx):
        ctx.world_size = self.world_size

    @hookimpl
    def collect_rollouts(self, ctx, tasks, mode):
        return []

    @hookimpl
    def post_process_batch(self, ctx, batch):
        return Batch({k: COLUMNS[k] for k in TRACE_COLUMNS}, {"uid": UID})

    @hookimpl
    def compute_old_logprob(self, ctx, batch):
        batch["old_log_probs"], batch["entropys"] = COLUMNS["old_log_probs"], COLUMNS["entropys"]
        return batch

    @hookimpl
    def compute_ref_logprob(self, ctx, batch):
        batch["ref_log_prob"] = COLUMNS["ref_log_prob"]
        return batch

    @hookimpl
    def update_actor(self, ctx, batch):
        return {"actor/pg_loss": 0.0}


def direct_step(world_size: int = 1) -> dict:
    """The same backend work and algorithm math (KL in reward, grpo, token balancing over ``world_size`` ranks)
    with nothing around them."""
    columns = {k: COLUMNS[k] for k in TRACE_COLUMNS}
    columns["old_log_probs"], columns["entropys"] = COLUMNS["old_log_probs"], COLUMNS["entropys"]
    columns["ref_log_prob"] = COLUMNS["ref_log_prob"]
    columns["token_level_rewards"], _ = apply_kl_penalty(
        columns["token_level_scores"], columns["old_log_probs"], columns["ref_log_prob"], columns["response_mask"],
        FixedKLController(0.001))
    columns["advantages"], columns["returns"] = grpo(
        token_level_rewards=columns["token_level_rewards"], response_mask=columns["response_mask"], index=UID)
    if world_size > 1:
        balanced_order(SEQLENS, world_size)
    return {"actor/pg_loss": 0.0}


def median_ms(*fns) -> list[float]:
    """The median time of each of ``fns`` in ms, run in turn ``REPEATS`` times after a warm-up round."""
    times: list[list[float]] = [[] for _ in fns]
    for repeat in range(REPEATS + 1):
        for fn, spent in zip(fns, times):
            start = time.perf_counter()
            fn()
            if repeat:
                spent.append((time.perf_counter() - start) * 1000)
    return [statistics.median(spent) for spent in times]


def measure(world_size: int) -> dict:
    with tempfile.TemporaryDirectory() as run_dir:
        recipe, plugins = load(None, [
            f"trainer.run_dir={run_dir}", "trainer.progress=false", "algorithm.estimator=grpo",
            "algorithm.use_kl_in_reward=true", f"algorithm.ppo_mini_batch_size={GROUP * 4}", "data.train_batch_size=1",
            f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}",
        ], ["no:console", "no:jsonl"], extra_plugins=[("bench", InstantBackend(world_size))])
        tasks = [Task(id="t", input={})]
        trainer = Trainer(recipe, plugins, train_tasks=tasks, val_tasks=[])
        plugins.broadcast("on_train_start", ctx=trainer.ctx)
        metrics = trainer.train_step(tasks)
        assert metrics["training/n_triplets_dropped_remainder"] == 0 and "actor/pg_loss" in metrics
        ours, direct = median_ms(lambda: trainer.train_step(tasks), lambda: direct_step(world_size))
    result = {
        "bench": "loop", "rows": ROWS, "prompt_length": PROMPT, "response_length": RESPONSE,
        "world_size": world_size, "ours_ms": round(ours, 3), "direct_ms": round(direct, 3),
        "core_overhead_ms": round(ours - direct, 3), "ratio": round(ours / direct, 2), "target_overhead_ms": 2.0,
    }
    if world_size > 1:
        work = workload(SEQLENS).tolist()
        ours_balance, verl_balance = median_ms(
            lambda: balanced_order(SEQLENS, world_size),
            lambda: get_seqlen_balanced_partitions(work, world_size, equal_size=True))
        result.update(balance_ms=round(ours_balance, 3), verl_balance_ms=round(verl_balance, 3))
    return result


def main() -> None:
    torch.set_num_threads(2)
    # world_size 1 is the embedded backend on one machine (no balancing); 8 adds
    # verl-style token balancing over 8 ranks (Karmarkar-Karp partitioning).
    for world_size in (1, 8):
        print(json.dumps(measure(world_size)))


if __name__ == "__main__":
    main()
