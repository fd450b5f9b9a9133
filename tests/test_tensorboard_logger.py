"""The built-in TensorBoard logger: each logged metric of a real run lands in <run_dir>/tensorboard."""

import json
import shutil
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from agl_core.data import Task
from agl_core.loop import Trainer

TASKS = [Task(id=f"t{i}", input={"prompt_ids": [i, i + 1]}) for i in range(4)]


def run(make_recipe, overrides=()):
    recipe, pset = make_recipe(["data.train_batch_size=2", "rollout.n=4", "algorithm.ppo_mini_batch_size=8",
                                "trainer.total_steps=2", "trainer.test_freq=1", *overrides], flags=["instant"])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=TASKS[:2])
    trainer.fit()
    return trainer.ctx.run_dir


def test_every_finite_metric_is_a_scalar_equal_to_the_jsonl_record(make_recipe):
    run_dir = run(make_recipe)
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for record in records:
        step = record.pop("step")
        for key, value in record.items():
            if value is None:
                continue
            logged = {e.step: e.value for e in events.Scalars(key)}
            assert logged[step] == pytest.approx(value, rel=1e-6, abs=1e-30)  # stored as float32
    assert {e.step for e in events.Scalars("actor/pg_loss")} == {1, 2}
    assert {e.step for e in events.Scalars("val/reward/mean")} == {0, 1, 2}


def test_disabled_by_the_recipe_writes_nothing(make_recipe):
    run_dir = run(make_recipe, ["plugins.disable=[tensorboard]"])
    assert (run_dir / "metrics.jsonl").exists()
    assert not (run_dir / "tensorboard").exists()


def test_a_resumed_run_holds_each_step_once(make_recipe):
    run_dir = run(make_recipe, ["trainer.total_steps=3", "trainer.save_freq=2"])
    # As if killed after logging step 3 but before its checkpoint: the resumed run logs step 3 again.
    shutil.rmtree(run_dir / "checkpoints" / "global_step_3")
    time.sleep(1.1)  # a new event file sorts after the old one only from the next second (names hold seconds)
    run(make_recipe, ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.resume=auto"])
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("actor/pg_loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("val/reward/mean")] == [0, 1, 2, 3, 4]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
