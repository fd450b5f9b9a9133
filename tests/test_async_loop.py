"""The loop with ``trainer.async``: k=0 is the synchronous loop bit for bit; k>=1 refuses a plane it cannot drive.

``data/quickstart_sync_metrics/`` holds the quick start's metrics (all but
times) as the synchronous loop logged them, one file per kind of machine they
were recorded on (see :mod:`agl_core.testing.golden`). The loop before
asynchronous training existed (commit 02faa85) gave them bit for bit; they
were last recorded when GRPO's group statistics moved to float64 sums (a
change in the last bits). Record this machine's with the code of that
change: ``agl train examples/quickstart/recipe.yaml trainer.run_dir=DIR``,
then ``record_golden(DIR / "metrics.jsonl", GOLDEN, TIMES)``. A change meant
to move the quick start's numbers replaces the folder with its own run's file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agl_core.config import load
from agl_core.loop import Trainer
from agl_core.plugins import PluginError
from agl_core.testing.golden import check_golden

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"
GOLDEN = Path(__file__).parent / "data" / "quickstart_sync_metrics"
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
    check_golden(tmp_path / "run" / "metrics.jsonl", GOLDEN, TIMES)


def test_async_with_a_backend_that_collects_its_own_rollouts_is_refused_at_start(tmp_path):
    with pytest.raises(PluginError, match=r"max_staleness=1 needs a rollout plane.*plugin 'instant'"):
        train(tmp_path / "run", "trainer.async.max_staleness=1", "trainer.total_steps=2")


def test_the_tis_correction_without_rollout_log_probs_is_a_clear_error(tmp_path):
    with pytest.raises(RuntimeError, match="rollout_correction.rollout_is is set, but the batch has no "
                                           "rollout_log_probs"):
        train(tmp_path / "run", "algorithm.rollout_correction.rollout_is=token", "trainer.total_steps=1")
