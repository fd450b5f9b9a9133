"""The default recipe (examples/guess_number) runs end to end, at reduced size, and its game is scored right."""

from __future__ import annotations

import json
from pathlib import Path

from agl_core.cli import main

REPO = Path(__file__).resolve().parents[3]
RECIPE = REPO / "examples" / "guess_number" / "recipe.yaml"


def test_the_game_narrows_the_range_and_ends_on_the_secret(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.guess_number.agent import Game

    game = Game(1, 7, secret=6)
    assert game.prompt() == "guess a number from 1 to 7"
    assert game.play("4") == "higher , from 5 to 7"
    assert game.play("the 7 !") == "lower , from 5 to 6"
    assert game.play("no idea") == "invalid"
    assert game.play("6") is None


def test_the_recipe_trains_and_logs(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)  # the recipe's paths are relative to the repository root
    run_dir = tmp_path / "run"
    code = main(["train", str(RECIPE), f"trainer.run_dir={run_dir}", "trainer.total_steps=2", "trainer.test_freq=2",
                 "trainer.save_freq=2", "trainer.progress=false", "rollout.n=4",
                 "algorithm.ppo_mini_batch_size=8"])
    assert code == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    last = records[-1]
    assert last["rollout/n_succeeded"] == 28 and last["training/n_calls_error"] == 0
    assert last["training/rollout_logprob_diff/max"] < 1e-4
    assert 0 <= last["val/reward/mean"] <= 1
    assert 0 < last["perf/gen_engine_cpu_s"] <= last["timing_s/gen"]  # the model's part of the games' time
    assert (run_dir / "rollouts.sqlite").exists() and any((run_dir / "tensorboard").iterdir())
    assert (run_dir / "checkpoints" / "global_step_2" / "actor" / "config.json").exists()
    assert main(["plot", str(run_dir)]) == 0 and (run_dir / "curves.png").exists()
