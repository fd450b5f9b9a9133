"""Distillation in a whole run: the real loop, runner, gateway, agent, embedded backend and a served teacher."""

from __future__ import annotations

import pytest

from agl_core.plugins import PluginError

from runs import logged, recipe_file, train


def distill_plugins(teacher: str, **settings) -> dict:
    return {"plugins": {"distill": {"teacher": {"model_path": teacher}, **settings}}}


def initial_weights(tmp_path, seed=0) -> str:
    """A first run's model directory (the tiny model's initial weights of ``seed``, written before training)."""
    run_dir = tmp_path / f"first-{seed}"
    path = recipe_file(tmp_path, "first.yaml", trainer={"run_dir": str(run_dir), "total_steps": 1, "seed": seed})
    train(path)
    return str(run_dir / "model")


def test_a_teacher_equal_to_the_student_gives_no_signal(tmp_path):
    """Teacher = the student's initial weights (same seed): the reverse KL of the sampled tokens is 0, and so
    are the advantages (the student stays where it is: 0 is the fixed point)."""
    base = recipe_file(tmp_path, algorithm={"estimator": "distill"}, **distill_plugins(initial_weights(tmp_path)))
    metrics = logged(train(base, ["distill"]).ctx.run_dir)
    for step in (1, 2):
        assert metrics[step]["teacher/reverse_kl"] == pytest.approx(0.0, abs=1e-4)
        assert metrics[step]["critic/advantages/max_before_processing"] == pytest.approx(0.0, abs=1e-4)
        assert metrics[step]["critic/advantages/min_before_processing"] == pytest.approx(0.0, abs=1e-4)
        assert metrics[step]["teacher/tokens"] > 0


def test_another_teacher_gives_per_token_advantages(tmp_path):
    base = recipe_file(tmp_path, algorithm={"estimator": "distill"},
                       **distill_plugins(initial_weights(tmp_path, seed=1), coef=2.0))
    metrics = logged(train(base, ["distill"]).ctx.run_dir)
    assert abs(metrics[1]["teacher/reverse_kl"]) > 1e-3
    assert metrics[1]["critic/advantages/max_before_processing"] > 0 > \
        metrics[1]["critic/advantages/min_before_processing"]


def test_distillation_mixed_with_the_reward(tmp_path):
    teacher = initial_weights(tmp_path)
    path = recipe_file(tmp_path, algorithm={"estimator": "distill"},
                       **distill_plugins(teacher, reward_weight=1.0, reward_estimator="grpo"))
    metrics = logged(train(path, ["distill"]).ctx.run_dir)
    assert metrics[2]["training/global_step"] == 2


def test_a_run_with_the_teacher_but_another_estimator_is_refused(tmp_path):
    teacher = initial_weights(tmp_path)
    path = recipe_file(tmp_path, **distill_plugins(teacher))
    with pytest.raises(PluginError, match="algorithm.estimator=distill"):
        train(path, ["distill"])


def test_a_teacher_with_another_tokenizer_is_refused_at_start(tmp_path):
    first = recipe_file(tmp_path, "first.yaml", trainer={"run_dir": str(tmp_path / "first"), "total_steps": 1},
                        plugins={"torch": {"model": {"build": {"vocabulary": ["x", "y"], "hidden_size": 32,
                                                               "num_heads": 2}}, "num_threads": 1},
                                 "traces": {"aggregator": "trajectory"}})
    train(first)
    path = recipe_file(tmp_path, algorithm={"estimator": "distill"}, **distill_plugins(str(tmp_path / "first/model")))
    with pytest.raises(PluginError, match="different tokenizers"):
        train(path, ["distill"])
