"""Write the quick start's task files (seeded, so the files in the repo are reproducible).

Each task is a short prompt of token ids; the instant backend's agent answers
with tokens of its bandit policy and is rewarded for the target token.
"""

import json
import random
from pathlib import Path

HERE = Path(__file__).parent


def write(path: Path, n: int, rng: random.Random, prefix: str) -> None:
    with path.open("w") as f:
        for i in range(n):
            prompt = [rng.randrange(8) for _ in range(rng.randint(2, 6))]
            f.write(json.dumps({"id": f"{prefix}-{i}", "input": {"prompt_ids": prompt}}) + "\n")


if __name__ == "__main__":
    rng = random.Random(0)
    write(HERE / "train.jsonl", 64, rng, "train")
    write(HERE / "val.jsonl", 8, rng, "val")
