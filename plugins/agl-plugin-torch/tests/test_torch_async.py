"""Asynchronous training on the torch backend: real loop, runner, gateway, openai client, endpoint and SQLite store.

Covered: with ``trainer.async.max_staleness=1`` every step trains whole
groups of its own batch, within the bound, each rollout once; calls made
while the actor trained were served by the previous weights and recorded so;
a run stopped after a checkpoint and resumed trains the carried-over batch
(taken from the store or queued again) and never a rollout twice; ``k=0``
builds no pipeline and a checkpoint of an asynchronous run refuses to resume
synchronously.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.config import load
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.rollout.staleness import served_version, staleness
from agl_core.rollout.store import QUEUING, RUNNING
from agl_core.testing import BatchRecorder

from agl_plugin_torch.testing import tiny_section
from test_torch_run import recipe_file

TASKS = [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(4)]
N = 2
ASYNC = ["trainer.async.max_staleness=1"]


class StopAt:
    """Raises at the start of ``step``: the process stops there, as a crash would (after its last checkpoint).

    It first waits for the rollouts queued so far to end, so that the store
    holds the carried-over batch finished (a test's outcome must not depend on
    the race between the agents and the stop).
    """

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def on_step_start(self, ctx, step):
        if step == self.step:
            store = ctx.state["local_runner"].store
            deadline = time.monotonic() + 30
            while store.query([QUEUING, RUNNING]) and time.monotonic() < deadline:
                time.sleep(0.05)
            raise RuntimeError(f"stopped at step {step}")


def run(path, overrides=(), extra=()) -> tuple[Trainer, BatchRecorder]:
    recorder = BatchRecorder(order=1)  # before the aggregator: it sees batch.meta["rollouts"]
    recipe, pset = load(path, list(overrides), ["torch", "traces"], extra_plugins=[("recorder", recorder), *extra])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=TASKS[:2])
    trainer.fit()
    return trainer, recorder


def trained(recorder: BatchRecorder, first_step: int = 1) -> dict[int, list]:
    """The rollouts each step trained on, by step."""
    return {first_step + i: batch.meta["rollouts"] for i, batch in enumerate(recorder.batches)}


def test_async_steps_train_whole_groups_of_their_own_batch_within_the_bound_each_rollout_once(tmp_path):
    trainer, recorder = run(recipe_file(tmp_path, rollout={"n": N}), ASYNC + ["trainer.total_steps=4"])
    steps = trained(recorder)
    assert sorted(steps) == [1, 2, 3, 4]
    seen, ages = set(), []
    for step, rollouts in steps.items():
        by_task = collections.Counter(r.task_id for r in rollouts)
        assert set(by_task.values()) == {N}, (step, by_task)  # whole groups
        assert {r.metadata["step"] for r in rollouts} == {step}  # its own batch
        for rollout in rollouts:
            assert rollout.rollout_id not in seen  # trained once
            seen.add(rollout.rollout_id)
            ages.append(staleness(step, served_version(rollout)))
    assert max(ages) <= 1 and min(ages) >= 0
    assert 1 in ages  # the next step's games were played while the actor trained: by the previous weights
    backend = trainer.ctx.state["torch"]
    assert backend.served_version() == backend.weight_version == 4
    # The serving copy holds the trained weights after the last sync.
    for served, actor in zip(backend.serving.state_dict().values(), backend.actor.state_dict().values()):
        assert served.equal(actor)


def logged(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records}


def test_async_metrics_are_logged(tmp_path):
    run(recipe_file(tmp_path), ASYNC + ["trainer.total_steps=2"])
    last = logged(tmp_path / "run")[2]
    for key in ("async/staleness_mean", "async/staleness_max", "async/n_stale_dropped", "async/weight_sync_s",
                "async/backend_idle_s", "async/runner_idle_s", "timing_s/weight_sync"):
        assert key in last, key
    assert last["async/n_stale_dropped"] == 0


@pytest.mark.parametrize("store", ["sqlite", "memory"])
def test_a_stopped_async_run_resumes_its_carried_over_batch_without_training_a_rollout_twice(tmp_path, store):
    sections = {"rollout": {"n": N, "store": store}}
    if store == "sqlite":
        sections["plugins"] = {"torch": tiny_section(), "traces": {"aggregator": "trajectory"},
                               "sqlite": {"path": str(tmp_path / "rollouts.sqlite")}}
    path = recipe_file(tmp_path, **sections)
    common = ASYNC + ["trainer.total_steps=4", "trainer.save_freq=2"]
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(path, common, extra=[("stop", StopAt(3))])
    resumed, recorder = run(path, common + ["trainer.resume=auto"])
    # The checkpoint of step 2 carried step 3's batch; the first process trained steps 1-2 only.
    steps = trained(recorder, first_step=3)
    assert sorted(steps) == [3, 4]
    ids = [r.rollout_id for rollouts in steps.values() for r in rollouts]
    assert len(ids) == len(set(ids)) == 2 * len(TASKS[:2]) * N
    for step, rollouts in steps.items():
        assert set(collections.Counter(r.task_id for r in rollouts).values()) == {N}
        assert {r.metadata["step"] for r in rollouts} == {step}
        assert all(staleness(step, served_version(r)) <= 1 for r in rollouts)
    assert resumed.ctx.step == 4
    # SQLite kept the carried-over rollouts (finished before the stop): step 3 trains them. An in-memory store
    # lost them with the process: each of the batch's groups is queued again.
    requeued = logged(tmp_path / "run")[3].get("async/n_groups_requeued", 0)
    assert requeued == (0 if store == "sqlite" else len(TASKS[:2]))


def test_k0_builds_no_pipeline_and_an_async_checkpoint_does_not_resume_synchronously(tmp_path):
    path = recipe_file(tmp_path)
    trainer, _ = run(path, ["trainer.total_steps=2", "trainer.save_freq=2", "trainer.async.max_staleness=0"])
    assert trainer.pipeline is None
    with pytest.raises(RuntimeError, match="stopped at step 2"):
        run(path, ASYNC + ["trainer.total_steps=3", "trainer.save_freq=1", "trainer.resume=never",
                           "trainer.overwrite=true"], extra=[("stop", StopAt(2))])
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        run(path, ["trainer.total_steps=3", "trainer.resume=auto"])


def test_an_async_run_killed_after_a_checkpoint_resumes_its_carried_over_batch(tmp_path):
    """kill -9 of a training process (SQLite store) right after its step-2 checkpoint; a new process resumes."""
    sections = {"rollout": {"n": N, "store": "sqlite"},
                "plugins": {"torch": tiny_section(), "traces": {"aggregator": "trajectory"},
                            "sqlite": {"path": str(tmp_path / "rollouts.sqlite")}}}
    path = recipe_file(tmp_path, **sections)
    common = ASYNC + ["trainer.total_steps=5", "trainer.save_freq=2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    tasks = tmp_path / "train.jsonl"  # the tasks the in-process runs get, for the process
    tasks.write_text("".join(task.model_dump_json() + "\n" for task in TASKS))
    proc = subprocess.Popen([sys.executable, "-m", "agl_core.cli", "train", path, *common,
                             f"data.train_files=[{tasks}]", "trainer.progress=false"], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "killed.log", "w"))  # noqa: SIM115
    checkpoint = tmp_path / "run" / "checkpoints" / "global_step_2"
    deadline = time.monotonic() + 240
    while not checkpoint.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    # The fork server, and the update and serving processes forked from it (training runs there on a CPU).
    children = children_of(proc.pid)
    workers = [pid for child in children for pid in children_of(child)]
    children += workers
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert checkpoint.exists(), (tmp_path / "killed.log").read_text()[-3000:]
    assert len(workers) >= 2, workers
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(pid) for pid in children)  # orphaned, they ended on their own
    carried = torch.load(checkpoint / "core_state.pt", weights_only=False)["async"]["batches"]
    assert [batch["step"] for batch in carried] == [3]

    resumed, recorder = run(path, common + ["trainer.resume=auto"])
    steps = trained(recorder, first_step=3)
    assert sorted(steps) == [3, 4, 5] and resumed.ctx.step == 5
    ids = [r.rollout_id for rollouts in steps.values() for r in rollouts]
    assert len(ids) == len(set(ids)) == 3 * len(TASKS[:2]) * N  # no rollout twice, no task of a batch lost
    for step, rollouts in steps.items():
        assert set(collections.Counter(r.task_id for r in rollouts).values()) == {N}
        assert {r.metadata["step"] for r in rollouts} == {step}
    # Step 3 trained the carried-over groups: those SQLite kept (finished before the kill) by their ids, the
    # others as new samples of the same tasks.
    carried_ids = {i for group in carried[0]["groups"] for i in group["rollout_ids"]}
    carried_tasks = sorted(group["task"]["id"] for group in carried[0]["groups"])
    assert sorted({r.task_id for r in steps[3]}) == carried_tasks
    requeued = logged(tmp_path / "run")[3].get("async/n_groups_requeued", 0)
    kept = {r.rollout_id for r in steps[3]} & carried_ids
    assert len(kept) == (len(carried[0]["groups"]) - requeued) * N


def children_of(pid: int) -> list[int]:
    """The live processes whose parent is ``pid`` (read from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has ended)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_tis_correction_weights_the_update_and_reports_its_weights(tmp_path, level):
    run(recipe_file(tmp_path), ASYNC + ["trainer.total_steps=2", f"algorithm.rollout_correction.rollout_is={level}",
                                        "algorithm.rollout_correction.rollout_is_threshold=1.5"])
    step = logged(tmp_path / "run")[2]
    assert 0 < step["rollout_corr/tis_mean"] and step["rollout_corr/tis_max"] >= step["rollout_corr/tis_mean"]
    assert 0 <= step["rollout_corr/tis_capped_share"] <= 1


def test_with_a_prefetch_share_the_deferred_groups_are_served_by_the_newest_weights(tmp_path):
    trainer, recorder = run(recipe_file(tmp_path, rollout={"n": N}),
                            ASYNC + ["trainer.total_steps=4", "trainer.async.prefetch_share=0.5"])
    steps = trained(recorder)
    seen = set()
    for step, rollouts in steps.items():
        groups = collections.defaultdict(list)
        for rollout in rollouts:
            groups[rollout.task_id].append(staleness(step, served_version(rollout)))
            assert rollout.rollout_id not in seen
            seen.add(rollout.rollout_id)
        assert [len(ages) for ages in groups.values()] == [N, N]
        first, second = groups.values()  # queued ahead; deferred until the step started (after the sync)
        assert max(first) <= 1 and second == [0] * N


def test_a_checkpoint_keeps_deferred_groups_and_the_resumed_run_queues_them_at_their_step(tmp_path):
    path = recipe_file(tmp_path, rollout={"n": N})
    common = ASYNC + ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.async.prefetch_share=0.5"]
    with pytest.raises(RuntimeError, match="stopped at step 3"):
        run(path, common, extra=[("stop", StopAt(3))])
    carried = torch.load(tmp_path / "run" / "checkpoints" / "global_step_2" / "core_state.pt",
                         weights_only=False)["async"]["batches"]
    assert [[bool(g["rollout_ids"]) for g in batch["groups"]] for batch in carried] == [[True, False]]
    _, recorder = run(path, common + ["trainer.resume=auto"])
    steps = trained(recorder, first_step=3)
    assert sorted(steps) == [3, 4]
    for rollouts in steps.values():
        assert sorted(collections.Counter(r.task_id for r in rollouts).values()) == [N, N]
