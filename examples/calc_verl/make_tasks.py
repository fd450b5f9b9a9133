"""Write train.jsonl and val.jsonl: arithmetic word problems with their answers (seeded, reproducible).

    python examples/calc_verl/make_tasks.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = [
    ("A shop sells {a} boxes with {b} pencils each and then {c} loose pencils. How many pencils does it sell?",
     lambda a, b, c: a * b + c),
    ("A train travels {a} km per hour for {b} hours, then {c} km more. How far does it travel in km?",
     lambda a, b, c: a * b + c),
    ("{a} apples are shared equally among {b} baskets, and {c} apples are added to each basket. "
     "How many apples are in one basket?", lambda a, b, c: a / b + c),
    ("A tank holds {a} litres. {b} litres leak out each hour for {c} hours. How many litres are left?",
     lambda a, b, c: a - b * c),
    ("What is ({a} - {b}) * {c}?", lambda a, b, c: (a - b) * c),
    ("A rectangle is {a} m by {b} m, with a {c} m square cut out. What area in square metres is left?",
     lambda a, b, c: a * b - c * c),
]


def problem(rng: random.Random, index: int, split: str) -> dict:
    template, solve = TEMPLATES[index % len(TEMPLATES)]
    a, b, c = rng.randint(12, 999), rng.randint(2, 60), rng.randint(1, 40)
    if "shared equally" in template:
        a = b * rng.randint(3, 80)  # a whole number of apples per basket
    if "left?" in template and "litres" in template:
        a = b * c + rng.randint(1, 500)
    if "square cut out" in template:
        c = rng.randint(1, min(a, b))
    return {"id": f"{split}-{index}",
            "input": {"question": template.format(a=a, b=b, c=c), "answer": float(solve(a, b, c)),
                      "max_turns": 4, "max_tokens": 256}}


def main() -> None:
    here = Path(__file__).parent
    for split, count, seed in (("train", 1024, 0), ("val", 128, 1)):
        rng = random.Random(seed)
        with open(here / f"{split}.jsonl", "w") as f:
            for i in range(count):
                f.write(json.dumps(problem(rng, i, split)) + "\n")


if __name__ == "__main__":
    main()
