"""Step-level credit: what gigpo and turn_grpo learn on the per-turn game, and what they cost, beside rollout-level.

(a) Learning. ``examples/guess_number/recipe_gigpo.yaml`` (the guess-number
agent that emits a reward per answer and the open interval as its state key)
trained once per seed and estimator, each in a fresh process, with the same
number of steps: ``gigpo`` (the recipe), ``turn_grpo``, and the default
recipe's rollout-level estimator (``reinforce_plus_plus`` with
``algorithm.gamma=1``, which trains on the game's result alone). Per
estimator and seed: the step and the seconds (from the launch, start-up
included) at which the validation reward first reaches 0.9, and the final
validation reward. Runs are driven by ``bench_learning.run_seed``. There is
no goal on learning speed: which credit learns faster depends on how well
the per-turn rewards and state keys fit the task (here "closer than my last
number" is a dense hint that a binary search earns too), and on a tiny model
trained from scratch the seeds spread widely; the figures say what it is.

(b) Cost. ``--rollouts`` rollouts (4,096) of ``--turns`` calls (8), each
call with its own reward and a state key drawn from a few per task (groups
of 8 rollouts), turned into rows by both aggregators (one row per call:
32,768 rows; one merged row per rollout: 4,096 rows). On each set of rows,
the best of ``--rounds`` rounds of ``--repeats`` times of ``gigpo`` and ``turn_grpo`` against the
rollout-level GRPO (``grpo_rollout``) on the same rows, in this process,
each as the ``advantage`` slot calls it. Goal: each <= 2x. Beside them,
with no goal (``ragged_*``): the same with rollouts of 4 to 12 calls (8 on
average), which the estimators cannot lay out as a (rollouts, turns) matrix.

Prints one JSON line. For a short check: ``--seeds 0 --steps 10`` (learning),
``--no-learning`` or ``--no-cost`` to run one half.

    python benchmarks/bench_credit.py [--seeds 0 1 2] [--steps 80] [--rollouts 4096] [--turns 8] [--repeats 20]
                                      [--rounds 10] [--no-learning] [--no-cost] [--keep DIR] [overrides ...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from bench_learning import ROOT, TARGET, run_seed

from agl_core.components import Components, call_estimator
from agl_core.config import AlgorithmConfig, load
from agl_core.data import Rollout, Span

RECIPE = ROOT / "examples" / "guess_number" / "recipe_gigpo.yaml"
ESTIMATORS = {  # name in the figures -> the overrides of recipe_gigpo.yaml that train with it
    "gigpo": [],
    "turn_grpo": ["algorithm.estimator=turn_grpo"],
    "rollout_level": ["algorithm.estimator=reinforce_plus_plus", "algorithm.gamma=1.0"],  # recipe.yaml's
}


# ------------------------------------------------------------------ (a) learning


def learning(seeds: list[int], steps: int, overrides: list[str], keep: Path | None) -> dict:
    runs: dict[str, list[dict]] = {name: [] for name in ESTIMATORS}
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="bench_credit_") as tmp:
        for seed in seeds:
            for name, extra in ESTIMATORS.items():  # alternated, so that every estimator sees the same machine
                run_dir = Path(tmp) / name / f"seed{seed}" / "run"
                run_dir.parent.mkdir(parents=True, exist_ok=True)
                runs[name].append(run_seed(seed, run_dir, [f"trainer.total_steps={steps}", *overrides, *extra],
                                           RECIPE))
                print(f"{name} seed {seed}: {json.dumps(runs[name][-1])}", file=sys.stderr)
    return {"recipe": str(RECIPE.relative_to(ROOT)), "seeds": seeds, "steps": steps, "target": TARGET,
            **{name: {"step_to_0.9": [r["step_to_target"] for r in rs],
                      "time_to_0.9_s": [r["time_to_target_s"] for r in rs],
                      "final_val_reward": [r["end_val_reward"] for r in rs],
                      "steps_per_min": [r["steps_per_min"] for r in rs]}
               for name, rs in runs.items()}}


# ------------------------------------------------------------------ (b) cost


def rollouts(n: int, turns: int, group: int = 8, states: int = 3, seed: int = 0, ragged: bool = False) -> list[Rollout]:
    """``n`` rollouts of ``turns`` calls that extend one context (4 response, 4 observation tokens a call); each call
    is rewarded and given one of ``states`` state keys; ``group`` rollouts per task. ``ragged``: each rollout has
    ``turns // 2`` to ``turns * 3 // 2`` calls instead (as many on average)."""
    rng = np.random.default_rng(seed)
    most = turns * 3 // 2 if ragged else turns
    rewards = rng.random((n, most)).round(2)
    keys = rng.integers(0, states, (n, most))
    lengths = rng.integers(turns // 2, most + 1, n) if ragged else np.full(n, turns)
    out = []
    for r in range(n):
        rollout_id, spans, prompt, seq = f"r{r}", [], list(range(1, 9)), 0
        for t in range(lengths[r]):
            response = [100 + t, 101, 102, 103]
            spans += [Span(rollout_id=rollout_id, sequence_id=seq, kind="annotation",
                           attributes={"state_key": f"{t}:{keys[r, t]}"}),
                      Span(rollout_id=rollout_id, sequence_id=seq + 1, kind="llm_call", prompt_token_ids=prompt,
                           response_token_ids=response),
                      Span(rollout_id=rollout_id, sequence_id=seq + 2, kind="reward", reward=float(rewards[r, t]))]
            seq += 3
            prompt = prompt + response + [7, 7, 7, 7]
        out.append(Rollout(rollout_id=rollout_id, task_id=f"task{r // group}", status="succeeded",
                           final_reward=float(rewards[r, :lengths[r]].sum()), spans=spans))
    return out


def best_seconds(fns: dict, repeats: int, rounds: int) -> dict[str, float]:
    """Each function's shortest of ``repeats`` timed runs in a row, after a warm-up, over ``rounds`` rounds that
    take the functions in turn: on a shared machine the least disturbed run, and a slow spell of the machine
    falls on every function instead of one."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()
            for _ in range(repeats):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def cost(n: int, turns: int, repeats: int, rounds: int) -> dict:
    from agl_plugin_traces.trajectory import trajectory_batch
    from agl_plugin_traces.transition import transition_batch

    with tempfile.TemporaryDirectory(prefix="bench_credit_") as tmp:
        _, plugins = load(None, [f"trainer.run_dir={tmp}"], plugin_flags=["traces"])
    components = Components.collect(plugins)
    config = AlgorithmConfig(estimator="gigpo", gamma=0.95)
    traces, ragged = rollouts(n, turns), rollouts(n, turns, ragged=True)
    context, ragged_context = 8 + turns * 8, 8 + turns * 3 // 2 * 8
    batches = {"transition": transition_batch(traces, context, 4)[0],
               "trajectory": trajectory_batch(traces, 8, context)[0],
               # Not the goal's batch: rollouts of different lengths, which the estimators cannot lay out as a
               # (rollouts, turns) matrix. What a run whose agents stop at different turns costs.
               "ragged_transition": transition_batch(ragged, ragged_context, 4)[0],
               "ragged_trajectory": trajectory_batch(ragged, 8, ragged_context)[0]}
    figures = {}
    for aggregator, batch in batches.items():
        batch["token_level_rewards"] = batch["token_level_scores"]
        seconds = best_seconds({name: lambda c=components.get("estimator", name): call_estimator(c, batch, config)
                                for name in ("grpo_rollout", "gigpo", "turn_grpo")}, repeats, rounds)
        figures[aggregator] = {
            "rows": len(batch),
            **{f"{name}_s": round(s, 5) for name, s in seconds.items()},
            **{f"{name}_vs_grpo_rollout": round(seconds[name] / seconds["grpo_rollout"], 2)
               for name in ("gigpo", "turn_grpo")}}
    ratios = [figures[aggregator][f"{name}_vs_grpo_rollout"] for aggregator in ("transition", "trajectory")
              for name in ("gigpo", "turn_grpo")]
    return {"rollouts": n, "turns": turns, "repeats": repeats, "rounds": rounds,
            "torch_threads": torch.get_num_threads(), **figures, "goal_le_2x": all(r <= 2 for r in ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=80, help="training steps of every run (the recipe's 80)")
    parser.add_argument("--rollouts", type=int, default=4096)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20, help="timed runs in a row of each estimator per round")
    parser.add_argument("--rounds", type=int, default=10, help="rounds taking the estimators in turn")
    parser.add_argument("--no-learning", action="store_true", help="skip (a), the training runs")
    parser.add_argument("--no-cost", action="store_true", help="skip (b), the estimators' timing")
    parser.add_argument("--keep", type=Path, default=None, metavar="DIR", help="keep the runs' directories under DIR")
    parser.add_argument("overrides", nargs="*", help="recipe overrides of every learning run")
    args = parser.parse_args()
    torch.set_num_threads(2)
    out = {"benchmark": "credit"}
    if not args.no_cost:
        out["cost"] = cost(args.rollouts, args.turns, args.repeats, args.rounds)
        print(f"cost: {json.dumps(out['cost'])}", file=sys.stderr)
    if not args.no_learning:
        out["learning"] = learning(args.seeds, args.steps, args.overrides, args.keep)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
