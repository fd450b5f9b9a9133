"""Small whole runs for the tests: the guess-number agent, a tiny model made from a config, 2 steps."""

from __future__ import annotations

import json

import yaml

from agl_core.config import load
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_plugin_torch.testing import tiny_section

GAME = {"low": 1, "high": 7, "max_turns": 2, "max_tokens": 1}
TASKS = [Task(id=f"t{s}", input={**GAME, "secret": s}) for s in (2, 5)]
VAL_TASKS = [Task(id=f"v{s}", split="val", input={**GAME, "secret": s}) for s in (3, 6)]
VOCABULARY = ["1", "2", "3", "4", "5", "6", "7", "guess", "a", "number", "from", "to", "higher", "lower",
              "invalid", ","]


def recipe_file(tmp_path, name="recipe.yaml", **sections) -> str:
    """A recipe of 2 steps of 2 tasks x 2 games; ``sections`` are merged into its top-level sections."""
    torch_section = tiny_section()
    torch_section["model"]["build"]["vocabulary"] = VOCABULARY
    recipe = {
        "data": {"train_batch_size": 2, "max_prompt_length": 24, "max_response_length": 24},
        "algorithm": {"estimator": "grpo", "ppo_mini_batch_size": 4, "ppo_epochs": 1},
        "rollout": {"n": 2, "timeout_s": 30, "agent": "examples.guess_number.agent:guess_number", "n_workers": 4},
        "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 2, "val_before_train": False, "test_freq": 0,
                    "progress": False, "resume": "never", "save_freq": 0},
        "plugins": {"torch": torch_section, "traces": {"aggregator": "trajectory"}},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def train(path, plugins=(), overrides=()) -> Trainer:
    recipe, pset = load(path, list(overrides), ["torch", "traces", *plugins])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=VAL_TASKS)
    trainer.fit()
    return trainer


def logged(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
