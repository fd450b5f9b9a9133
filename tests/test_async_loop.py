"""The loop with ``trainer.async``: k=0 is the synchronous loop bit for bit; k>=1 refuses a plane it cannot drive.

``data/quickstart_sync_metrics.jsonl`` holds the quick start's metrics (all but
times) as the loop logged them before asynchronous training existed (commit
02faa85's loop). Regenerate it only for a change that is meant to move the
quick start's numbers: ``agl train examples/quickstart/recipe.yaml
trainer.run_dir=DIR`` and keep the keys this test compares.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agl_core.config import load
from agl_core.loop import Trainer
from agl_core.plugins import PluginError

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"
GOLDEN = Path(__file__).parent / "data" / "quickstart_sync_metrics.jsonl"
TIMES = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/latency_s/")


def train(run_dir: Path, *overrides: str) -> Trainer:
    recipe, plugins = load(QUICKSTART, [f"trainer.run_dir={run_dir}", "trainer.progress=false",
                                        f"data.train_files=[{ROOT}/examples/quickstart/train.jsonl]",
                                        f"data.val_files=[{ROOT}/examples/quickstart/val.jsonl]", *overrides])
    trainer = Trainer(recipe, plugins)
    trainer.fit()
    return trainer


def test_k0_reproduces_the_synchronous_quickstart_bit_for_bit(tmp_path):
    trainer = train(tmp_path / "run", "trainer.async.max_staleness=0")
    assert trainer.pipeline is None
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    got = [{k: v for k, v in record.items() if not k.startswith(TIMES)} for record in logged]
    expected = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for mine, theirs in zip(got, expected):
        assert mine == theirs, mine["step"]  # exact floats: the same computation, not a close one


def test_async_with_a_backend_that_collects_its_own_rollouts_is_refused_at_start(tmp_path):
    with pytest.raises(PluginError, match=r"max_staleness=1 needs a rollout plane.*plugin 'instant'"):
        train(tmp_path / "run", "trainer.async.max_staleness=1", "trainer.total_steps=2")


def test_the_tis_correction_without_rollout_log_probs_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="rollout_correction.rollout_is is set, but the batch has no "
                                           "rollout_log_probs"):
        train(tmp_path / "run", "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=1")
