"""The default recipe (examples/guess_number) runs end to end, at reduced size, and its game is scored right."""

from __future__ import annotations

import json
from pathlib import Path

from agl_core.cli import main
from agl_core.testing.golden import check_golden

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


GOLDEN = Path(__file__).parent / "data" / "guess_number_sync_metrics"
UNREPEATABLE = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/latency_s/",
                "training/rollout_logprob_diff/")
"""Times, and the serving/training log-prob gap (~1e-8: float noise of which calls the engine batched together)."""


def test_k0_reproduces_the_synchronous_default_recipe_bit_for_bit(tmp_path, monkeypatch):
    """``trainer.async.max_staleness=0`` trains the default recipe (at reduced size) exactly as the loop did before
    asynchronous training existed.

    ``data/guess_number_sync_metrics/`` holds the metrics (all but times) of this run made with commit 02faa85's
    code, one file per kind of machine (x86-64, torch 2.13.0 CPU build, one thread; see
    :mod:`agl_core.testing.golden`): every model call is seeded by its place in the run, so the run is deterministic
    on one kind of CPU. Record another kind's file with that code and the command below, then ``record_golden``.
    Metrics added since are not in the golden files and not compared. The recipe then used GRPO, which the run
    therefore sets (its estimator is REINFORCE++ since: examples/guess_number/README.md), and its gateway sent
    every call as text (exact contexts, the default since, change the prompts the model sees: docs/rollout.md).
    """
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    assert main(["train", str(RECIPE), *REDUCED, f"trainer.run_dir={run_dir}", "trainer.async.max_staleness=0",
                 "algorithm.estimator=grpo", "rollout.gateway.exact_contexts=false"]) == 0
    check_golden(run_dir / "metrics.jsonl", GOLDEN, UNREPEATABLE)


REDUCED = ["trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=0", "trainer.progress=false",
           "rollout.n=6", "algorithm.ppo_mini_batch_size=14"]
"""The default recipe at the size of a test: ``agl train examples/guess_number/recipe.yaml`` with these overrides."""
