"""Time agl_core's advantage estimators against verl 0.9.1's on one large batch.

Builds a GRPO-shaped batch (default 65,536 responses x 512 tokens, random ragged
lengths, groups of 8 uid strings, a 0/1 outcome reward on each response's last token),
runs ours and verl's estimator on it in this process, asserts the results are equal
(atol = rtol = 1e-5) and prints one JSON line per estimator:

    {"bench": "estimators", "estimator": "grpo", "rows": 65536, "T": 512,
     "ours_s": ..., "verl_s": ..., "speedup": ..., "repeats": ...}

Times are medians over ``--repeats`` runs after one untimed warm-up run each, with
torch.set_num_threads(2). For grpo and rloo, verl 0.9.1 also ships opt-in vectorised
variants (``grpo_vectorized``, ``rloo_vectorized``); their median goes in
``verl_vectorized_s`` for context (timed only: they differ from the default ones in
the last bits).

    python benchmarks/bench_estimators.py [--rows 65536] [--T 512] [--group-size 8] [--repeats 3]
"""

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable

import numpy as np
import torch
from torch.testing import assert_close

from agl_core.algorithms import advantages as ours


def make_batch(rows: int, T: int, group_size: int, seed: int = 0) -> dict:
    """Ragged right-padded responses with an outcome reward on the last token."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, T + 1, (rows,), generator=gen)
    response_mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    token_level_rewards = torch.zeros(rows, T)
    correct = torch.randint(0, 2, (rows,), generator=gen).float()
    token_level_rewards[torch.arange(rows), (lengths - 1).clamp(min=0)] = correct
    uids = np.array([str(uuid.UUID(int=int(i))) for i in torch.randint(0, 2**62, (rows // group_size + 1,))])
    return {
        "token_level_rewards": token_level_rewards,
        "response_mask": response_mask,
        "values": torch.randn(rows, T, generator=gen),
        "reward_baselines": torch.rand(rows, generator=gen),
        "index": np.repeat(uids, group_size)[:rows].astype(object),
    }


def median_seconds(fn: Callable[[], object], repeats: int) -> tuple[float, object]:
    """Median wall time of ``fn`` over ``repeats`` runs after a warm-up; returns the last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        del result  # free the previous output before allocating the next one
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def cases(b: dict) -> dict[str, tuple[Callable, Callable, Callable | None]]:
    """estimator -> (ours, verl's default, verl's vectorised variant or None)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo import core_algos as verl

    r, m, idx = b["token_level_rewards"], b["response_mask"], b["index"]
    gamma, lam = 0.99, 0.95
    return {
        "gae": (
            lambda: ours.gae(token_level_rewards=r, values=b["values"], response_mask=m, gamma=gamma, lam=lam),
            lambda: verl.compute_gae_advantage_return(r, b["values"], m, gamma, lam),
            None,
        ),
        "grpo": (
            lambda: ours.grpo(token_level_rewards=r, response_mask=m, index=idx),
            lambda: verl.compute_grpo_outcome_advantage(r, m, idx),
            lambda: verl.compute_grpo_vectorized_outcome_advantage(r, m, idx),
        ),
        "grpo_passk": (
            lambda: ours.grpo_passk(token_level_rewards=r, response_mask=m, index=idx),
            lambda: verl.compute_grpo_passk_outcome_advantage(r, m, idx, config=AlgoConfig()),
            None,
        ),
        "rloo": (
            lambda: ours.rloo(token_level_rewards=r, response_mask=m, index=idx),
            lambda: verl.compute_rloo_outcome_advantage(r, m, idx),
            lambda: verl.compute_rloo_vectorized_outcome_advantage(r, m, idx),
        ),
        "reinforce_plus_plus": (
            lambda: ours.reinforce_plus_plus(token_level_rewards=r, response_mask=m, gamma=gamma),
            lambda: verl.compute_reinforce_plus_plus_outcome_advantage(r, m, config=AlgoConfig(gamma=gamma)),
            None,
        ),
        "reinforce_plus_plus_baseline": (
            lambda: ours.reinforce_plus_plus_baseline(token_level_rewards=r, response_mask=m, index=idx),
            lambda: verl.compute_reinforce_plus_plus_baseline_outcome_advantage(r, m, idx),
            None,
        ),
        "remax": (
            lambda: ours.remax(token_level_rewards=r, reward_baselines=b["reward_baselines"], response_mask=m),
            lambda: verl.compute_remax_outcome_advantage(r, b["reward_baselines"], m),
            None,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536)
    parser.add_argument("--T", type=int, default=512)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="run just these estimators")
    args = parser.parse_args()

    torch.set_num_threads(2)
    batch = make_batch(args.rows, args.T, args.group_size)
    for name, (ours_fn, verl_fn, verl_vectorized_fn) in cases(batch).items():
        if args.only and name not in args.only:
            continue
        ours_s, (adv, ret) = median_seconds(ours_fn, args.repeats)
        verl_s, (verl_adv, verl_ret) = median_seconds(verl_fn, args.repeats)
        assert_close(adv, verl_adv, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} advantages: {m}")
        assert_close(ret, verl_ret, atol=1e-5, rtol=1e-5, msg=lambda m: f"{name} returns: {m}")
        del adv, ret, verl_adv, verl_ret
        line = {
            "bench": "estimators",
            "estimator": name,
            "rows": args.rows,
            "T": args.T,
            "ours_s": round(ours_s, 4),
            "verl_s": round(verl_s, 4),
            "speedup": round(verl_s / ours_s, 2),
            "repeats": args.repeats,
        }
        if verl_vectorized_fn is not None:
            line["verl_vectorized_s"] = round(median_seconds(verl_vectorized_fn, args.repeats)[0], 4)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
