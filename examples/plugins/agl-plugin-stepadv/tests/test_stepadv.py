"""agl-plugin-stepadv: its math against a plain reference, its logger, its contracts, and the quick start with it."""

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

from agl_core.algorithms.advantages import grpo
from agl_core.testing.contracts import EstimatorContract, LoggerContract, PluginContract
from agl_plugin_stepadv.advantages import step_group_advantages
from agl_plugin_stepadv.csv_logger import drop_steps_from, write_row

REPO = Path(__file__).resolve().parents[4]


def reference(rewards, mask, uid, turn, norm_by_std, eps=1e-6):
    """Row by row, as the README states it: GRPO over (uid, turn) groups, a group of one keeps its score."""
    scores = rewards.sum(-1).tolist()
    out = torch.zeros_like(rewards)
    for i, key in enumerate(zip(uid, turn)):
        group = [scores[j] for j, other in enumerate(zip(uid, turn)) if other == key]
        if len(group) == 1:
            adv = scores[i]
        else:
            adv = scores[i] - float(np.mean(group))
            if norm_by_std:
                adv /= float(np.std(group, ddof=1)) + eps
        out[i] = adv * mask[i]
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_step_groups_match_the_reference(norm_by_std):
    g = torch.Generator().manual_seed(0)
    rows, width = 24, 5
    mask = (torch.arange(width) < torch.randint(1, width + 1, (rows,), generator=g)[:, None]).float()
    rewards = torch.rand(rows, width, generator=g) * mask
    uid = np.array([f"task-{i % 3}" for i in range(rows)], dtype=object)
    turn = np.array([i % 4 for i in range(rows)])
    turn[0] = 9  # a group of one
    advantages, returns = step_group_advantages(rewards, mask, uid, turn, norm_by_std=norm_by_std)
    assert torch.allclose(advantages, reference(rewards, mask, uid.tolist(), turn.tolist(), norm_by_std), atol=1e-5)
    assert torch.equal(advantages, returns)


def test_one_turn_per_rollout_is_grpo():
    g = torch.Generator().manual_seed(1)
    rewards, mask = torch.rand(8, 3, generator=g), torch.ones(8, 3)
    uid = np.array([f"t{i // 4}" for i in range(8)], dtype=object)
    ours, _ = step_group_advantages(rewards, mask, uid, np.zeros(8, dtype=np.int64))
    theirs, _ = grpo(rewards, mask, uid)
    assert torch.equal(ours, theirs)


def test_a_resumed_run_keeps_each_step_once(tmp_path):
    path = tmp_path / "metrics.csv"
    for step in range(4):
        write_row(path, ["a", "b"], step, {"a": step / 2})
    drop_steps_from(path, 2)
    write_row(path, ["a", "b"], 2, {"a": 7, "b": 1})
    rows = list(csv.reader(path.open()))
    assert rows == [["step", "a", "b"], ["0", "0", ""], ["1", "0.5", ""], ["2", "7", "1"]]


def test_the_estimator_reads_its_plugin_setting(tmp_path):
    """plugins.stepadv.epsilon reaches step_grpo (bound at registration): a large one shrinks the advantages."""
    from agl_core.testing.contracts import contract_env, example_batch

    def advantages(run, *overrides):
        env = contract_env(tmp_path / run, "stepadv", None, list(overrides))
        batch = example_batch()
        return env.ctx.components.get("estimator", "step_grpo").obj(batch, env.recipe.algorithm)[0]

    default, damped = advantages("a"), advantages("b", "plugins.stepadv.epsilon=10")
    assert damped.abs().sum() < default.abs().sum() / 5


class TestStepAdvPlugin(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "stepadv"


class TestStepGrpo(EstimatorContract):
    @pytest.fixture
    def plugin_name(self):
        return "stepadv"

    @pytest.fixture
    def estimator_name(self):
        return "step_grpo"


class TestCsvLogger(LoggerContract):
    @pytest.fixture
    def plugin_name(self):
        return "stepadv"

    @pytest.fixture
    def plugin_overrides(self):
        return ["plugins.stepadv.columns=[val/reward/mean,actor/pg_loss]"]


def test_the_quickstart_trains_with_it(tmp_path):
    """``agl train`` of the quick start (instant backend) with the plugin's estimator and logger."""
    from agl_core.cli import main

    run_dir = tmp_path / "run"
    code = main(["train", "-p", "stepadv", str(REPO / "examples/quickstart/recipe.yaml"),
                 "algorithm.estimator=step_grpo", "trainer.total_steps=3", "trainer.test_freq=3",
                 f"trainer.run_dir={run_dir}", "trainer.progress=false",
                 f"data.train_files=[{REPO}/examples/quickstart/train.jsonl]",
                 f"data.val_files=[{REPO}/examples/quickstart/val.jsonl]"])
    assert code == 0
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert all(r["actor/pg_loss"] for r in rows[1:]) and rows[-1]["val/reward/mean"]
