"""``agl eval`` through the real CLI: on an endpoint (the test endpoint, whose echo plays a known game), on a
checkpoint of a run (the embedded backend serving it), and ``--compare``."""

from __future__ import annotations

import json

import pytest

from agl_core.cli import main
from agl_plugin_teachers.evaluation import pass_at_k

from runs import logged, recipe_file, train


def games(tmp_path, max_tokens=64):
    """Secrets 1..7, 4 turns. Against the echo endpoint the agent guesses 1, 2, 3, 4 in turn (each prompt's first
    number): the games of secrets 1 to 4 are won, 5 to 7 lost."""
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{s}", "input": {"low": 1, "high": 7, "secret": s, "max_turns": 4,
                                                                  "max_tokens": max_tokens}}) + "\n"
                            for s in range(1, 8)))
    return str(path)


def test_eval_on_an_endpoint_writes_results_and_a_summary(tmp_path, endpoint, capsys):
    recipe = recipe_file(tmp_path, data={"val_files": [games(tmp_path)]})
    out = tmp_path / "echo.jsonl"
    assert main(["eval", recipe, "-p", "torch", "-p", "traces", "--endpoint", endpoint.url, "--model", "echo",
                 "--n", "2", "-o", str(out)]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(results) == 14
    won = {r["task_id"]: r["reward"] for r in results}
    assert won == {"s1": 1.0, "s2": 1.0, "s3": 1.0, "s4": 1.0, "s5": 0.0, "s6": 0.0, "s7": 0.0}
    assert all(r["status"] == "succeeded" and r["response_tokens"] > 0 for r in results)
    assert {r["model"] for r in endpoint.requests} == {"echo"}
    summary = json.loads((tmp_path / "echo.summary.json").read_text())
    assert summary["reward_mean"] == pytest.approx(4 / 7)
    assert summary["pass@1"] == pytest.approx(4 / 7) and summary["pass@2"] == pytest.approx(4 / 7)
    assert summary["n_failed"] == 0 and summary["n_tasks"] == 7 and summary["n_rollouts"] == 14
    assert summary["response_tokens"] == sum(r["response_tokens"] for r in results)
    assert json.loads(capsys.readouterr().out)["pass@1"] == summary["pass@1"]


def test_eval_counts_failures_and_they_lower_pass_at_k(tmp_path, endpoint):
    """Calls answered 400 fail their games: counted with their error, never a silent reward of 0."""
    recipe = recipe_file(tmp_path, data={"val_files": [games(tmp_path)]}, rollout={"max_attempts": 1})
    endpoint.fail_next.extend([400] * 3)
    out = tmp_path / "flaky.jsonl"
    assert main(["eval", recipe, "-p", "torch", "-p", "traces", "--endpoint", endpoint.url, "-o", str(out),
                 "rollout.n_workers=1"]) == 0
    summary = json.loads((tmp_path / "flaky.summary.json").read_text())
    assert summary["n_failed"] == 3 and sum(summary["failures"].values()) == 3
    assert summary["pass@1"] < 4 / 7


def test_eval_on_a_checkpoint_matches_the_runs_own_validation(tmp_path):
    """A checkpoint evaluated greedily on the validation games gives what the run's validation of that step gave."""
    recipe = recipe_file(tmp_path, data={"val_files": [games(tmp_path, max_tokens=4)]},
                         trainer={"total_steps": 1, "save_freq": 1, "test_freq": 1},
                         plugins={"torch": {"model": {"build": {"vocabulary": ["1", "2", "3", "4", "5", "6", "7",
                                                                               "guess", "a", "number", "from", "to",
                                                                               "higher", "lower", "invalid", ","],
                                                                "hidden_size": 32, "num_heads": 2}},
                                            "actor": {"lr": 0.05}, "num_threads": 1},
                                  "traces": {"aggregator": "trajectory"}})
    trainer = train(recipe, overrides=[f"data.val_files=[{games(tmp_path, max_tokens=4)}]"])
    run_dir = trainer.ctx.run_dir
    validation = logged(run_dir)[1]
    out = tmp_path / "ckpt.jsonl"
    assert main(["eval", recipe, "-p", "torch", "-p", "traces", "--checkpoint", str(run_dir), "-o", str(out)]) == 0
    summary = json.loads((tmp_path / "ckpt.summary.json").read_text())
    assert summary["policy"] == f"checkpoint {run_dir}"
    assert summary["reward_mean"] == pytest.approx(validation["val/reward/mean"])
    assert summary["n_rollouts"] == 7 and summary["n_failed"] == 0


def test_compare_prints_both_side_by_side(tmp_path, capsys):
    for name, mean in (("a", 0.25), ("b", 0.75)):
        (tmp_path / f"{name}.jsonl").write_text("")
        (tmp_path / f"{name}.summary.json").write_text(json.dumps(
            {"policy": name, "split": "val", "n_tasks": 4, "reward_mean": mean, "pass@1": mean, "n_failed": 0}))
    assert main(["eval", "--compare", str(tmp_path / "a.jsonl"), str(tmp_path / "b.summary.json")]) == 0
    table = capsys.readouterr().out.splitlines()
    row = next(line for line in table if line.startswith("reward_mean"))
    assert row.split()[1:] == ["0.25", "0.75", "+0.5"]
    assert main(["eval", "--compare", str(tmp_path / "missing.jsonl"), str(tmp_path / "a.jsonl")]) == 2
    assert "missing.jsonl: no summary beside it" in capsys.readouterr().err


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - (3 / 4) * (2 / 3))  # 1 - C(3,2)/C(4,2) = 0.5
    assert pass_at_k(4, 2, 3) == 1.0  # only 2 failures: any 3 samples hold a pass


def test_what_a_checkpoint_path_serves(tmp_path):
    """A model directory is served as the recipe's model; a checkpoint of adapters (given as the run, the
    checkpoint or its actor directory) is restored as a resume does; anything else is refused, naming the path."""
    from agl_plugin_teachers.evaluation import checkpoint_source

    from agl_core.checkpoint import CORE_STATE

    whole = tmp_path / "run" / "checkpoints" / "global_step_3"
    (whole / "actor").mkdir(parents=True)
    (whole / CORE_STATE).write_bytes(b"")
    (whole / "actor" / "config.json").write_text("{}")
    assert checkpoint_source(tmp_path / "run") == (whole / "actor", None)
    assert checkpoint_source(whole) == (whole / "actor", None)
    adapters = tmp_path / "lora" / "checkpoints" / "global_step_2"
    (adapters / "actor").mkdir(parents=True)
    (adapters / CORE_STATE).write_bytes(b"")
    for path in (tmp_path / "lora", adapters, adapters / "actor"):
        assert checkpoint_source(path) == (None, adapters), path
    with pytest.raises(ValueError, match=r"--checkpoint .*nowhere: not a model directory, a checkpoint"):
        checkpoint_source(tmp_path / "nowhere")
