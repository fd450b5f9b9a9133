"""``kill -9`` of a trainer past its last checkpoint, then ``resume=auto``: the run ends as if never interrupted.

Real ``agl`` processes on the quickstart recipe (the instant backend, whose
runs repeat exactly from their seed); the logs are the real files.
"""

from __future__ import annotations

import json
import shutil

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

STEPS = 30
RUN = [f"trainer.total_steps={STEPS}", "trainer.save_freq=5", "trainer.test_freq=5", "trainer.progress=false"]
WALL_CLOCK = ("timing_s/", "timing_per_token_ms/", "perf/")


def records(run_dir) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def reproducible(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(WALL_CLOCK)}


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every TensorBoard scalar of the run as ``(step, value)`` pairs, as TensorBoard shows them."""
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"] if not tag.startswith(WALL_CLOCK)}


def checkpoint_steps(run_dir) -> list[int]:
    found = (run_dir / "checkpoints").glob("global_step_*")
    return sorted(int(p.name.removeprefix("global_step_")) for p in found if (p / "core_state.pt").exists())


def test_kill_9_past_a_checkpoint_then_resume_auto_logs_the_uninterrupted_run(agl, tmp_path):
    whole = tmp_path / "whole"
    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={whole}", *RUN, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]

    parts = tmp_path / "parts"
    killed = agl.spawn("train", agl.QUICKSTART, f"trainer.run_dir={parts}", *RUN, log=tmp_path / "killed.log")
    try:
        # Killed in a step two or more steps away from the next checkpoint, with logged steps after the last one.
        def past_a_checkpoint():
            logged = records(parts)
            return logged and logged[-1]["step"] > 5 and logged[-1]["step"] % 5 in (1, 2)

        agl.wait_until(past_a_checkpoint, 60, "a step past the checkpoint of step 5")
    finally:
        killed.kill()
        killed.wait(60)
    last_checkpoint = checkpoint_steps(parts)[-1]
    assert records(parts)[-1]["step"] > last_checkpoint  # the steps the resumed run logs again

    resumed = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={parts}", *RUN, "trainer.resume=auto", timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"global_step_{last_checkpoint} at step {last_checkpoint}" in resumed.stderr

    expected, got = records(whole), records(parts)
    assert [r["step"] for r in got] == list(range(STEPS + 1))  # each step once
    assert [reproducible(r) for r in got] == [reproducible(r) for r in expected]
    tensorboard = scalars(parts)
    assert tensorboard == scalars(whole)  # each step once there too, with the same values
    assert [step for step, _ in tensorboard["actor/pg_loss"]] == list(range(1, STEPS + 1))


def test_resume_auto_never_loads_a_checkpoint_of_another_run(agl, tmp_path):
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    for run_dir, steps in ((ours, 2), (theirs, 4)):
        out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}",
                      "trainer.save_freq=2", "trainer.progress=false", timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
    run_id = {d: json.loads((d / "run.json").read_text())["run_id"] for d in (ours, theirs)}
    stray = ours / "checkpoints" / "global_step_4"
    shutil.copytree(theirs / "checkpoints" / "global_step_4", stray)  # now the latest checkpoint of ours

    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={ours}", "trainer.total_steps=6", "trainer.resume=auto",
                  timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    error = out.stderr.splitlines()[-1]
    assert error.startswith("agl: error: trainer.resume:") and str(stray) in error
    assert run_id[ours] in error and run_id[theirs] in error
    assert [r["step"] for r in records(ours)] == [0, 1, 2]  # untouched

    # Named on purpose, another run's checkpoint is a starting point (fine-tuning from it).
    shutil.rmtree(stray)
    fresh = tmp_path / "fresh"
    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={fresh}", "trainer.total_steps=6",
                  f"trainer.resume={theirs / 'checkpoints' / 'global_step_4'}", "trainer.progress=false", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"a checkpoint of another run ({run_id[theirs]})" in out.stderr
    assert [r["step"] for r in records(fresh)] == [5, 6]
    assert json.loads((fresh / "run.json").read_text())["run_id"] not in run_id.values()
