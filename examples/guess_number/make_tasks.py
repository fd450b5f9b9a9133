"""Write the train and validation games of the guess-number recipe (seeded: the same files every time).

    python examples/guess_number/make_tasks.py [--high 7] [--max-turns 4] [--seed 0]

The training file is a sequence of rounds; each round holds every secret of
``[low, high]`` once, in a shuffled order. The recipe reads it in order
(``data.shuffle: false``) with ``data.train_batch_size`` equal to the size of
the range, so every step plays each secret once: no step's update leans
towards the secrets it happened to draw. The validation file holds every
secret once, so its mean reward is the share of secrets the policy finds.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def game(task_id: str, secret: int, args: argparse.Namespace) -> dict:
    return {"id": task_id, "input": {"low": args.low, "high": args.high, "secret": secret,
                                     "max_turns": args.max_turns, "max_tokens": args.max_tokens}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=7)
    parser.add_argument("--max-turns", type=int, default=4, help="answers allowed per game")
    parser.add_argument("--max-tokens", type=int, default=1, help="token limit of one answer (a number is one token)")
    parser.add_argument("--rounds", type=int, default=200, help="training rounds (each plays every secret once)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    secrets = list(range(args.low, args.high + 1))
    train = []
    for round_ in range(args.rounds):
        for secret in rng.sample(secrets, len(secrets)):
            train.append(game(f"train-{round_}-{secret}", secret, args))
    val = [game(f"val-{secret}", secret, args) for secret in secrets]
    for name, games in (("train.jsonl", train), ("val.jsonl", val)):
        (args.out / name).write_text("".join(json.dumps(g) + "\n" for g in games))
    print(f"wrote {len(train)} training and {len(val)} validation games; "
          f"set data.train_batch_size={len(secrets)} to play every secret once per step")


if __name__ == "__main__":
    main()
