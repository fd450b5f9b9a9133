"""Faults around the run directory: a second trainer, a killed one's lock, reruns, bad settings.

Every trainer is the installed ``agl`` in a subprocess on the quickstart
recipe (the instant backend: steps take milliseconds), its run directory in
the test's temporary directory.
"""

from __future__ import annotations

import json
import signal
import socket

import pytest


def steps(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def is_clear_error(out, *named: str) -> bool:
    """Exit code 2, one ``agl: error:`` line naming every string of ``named``, no traceback."""
    lines = [line for line in out.stderr.splitlines() if line.startswith("agl: error:")]
    return (out.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in named)
            and "Traceback" not in out.stderr)


def test_a_second_trainer_fails_at_once_naming_the_first_which_goes_on(agl, run_dir, tmp_path):
    first = agl.spawn("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=100000",
                      "trainer.save_freq=0", "trainer.progress=false", log=tmp_path / "first.log")
    try:
        agl.wait_until(lambda: len(steps(run_dir)) >= 3, 60, "the first trainer's steps")
        config = (run_dir / "config.yaml").read_text()
        second = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.resume=auto",
                         "trainer.seed=7", timeout=60)
        assert is_clear_error(second, f"run directory {run_dir} is in use by the trainer pid {first.pid} on host"), \
            second.stderr
        assert first.poll() is None  # unharmed: still training, on its own config
        assert (run_dir / "config.yaml").read_text() == config
        logged = len(steps(run_dir))
        agl.wait_until(lambda: len(steps(run_dir)) > logged, 60, "the first trainer's next step")
    finally:
        first.send_signal(signal.SIGTERM)
        code = first.wait(60)
    assert code == 128 + signal.SIGTERM, (tmp_path / "first.log").read_text()[-3000:]
    logged = steps(run_dir)
    assert logged == list(range(len(logged)))  # each step once, in order: nothing of the second trainer


def test_the_lock_of_a_killed_trainer_is_taken_over(agl, run_dir, tmp_path):
    first = agl.spawn("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=100000",
                      "trainer.save_freq=0", "trainer.progress=false", log=tmp_path / "first.log")
    try:
        agl.wait_until(lambda: len(steps(run_dir)) >= 2, 60, "the first trainer's steps")
    finally:
        first.kill()  # SIGKILL: nothing of the trainer runs, its lock file keeps its pid
        first.wait(60)
    assert json.loads((run_dir / ".agl.lock").read_text())["pid"] == first.pid

    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.resume=auto",
                  "trainer.total_steps=3", "trainer.save_freq=0", "trainer.progress=false", timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"took over the stale lock of the trainer pid {first.pid}" in out.stderr
    assert steps(run_dir) == [0, 1, 2, 3]  # no checkpoint to resume: the run started over, its log too
    assert (run_dir / ".agl.lock").read_text() == ""  # released


def test_resume_never_into_a_run_is_refused_and_overwrite_starts_over(agl, run_dir):
    common = ["train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.progress=false"]
    first = agl.run(*common, "trainer.total_steps=4", "trainer.save_freq=2", "trainer.overwrite=false")
    assert first.returncode == 0, first.stderr[-3000:]
    run_file = (run_dir / "run.json").read_text()

    refused = agl.run(*common, "trainer.total_steps=1", "trainer.overwrite=false")
    assert is_clear_error(refused, "trainer.run_dir", str(run_dir), "trainer.resume=auto", "trainer.overwrite=true")
    assert steps(run_dir) == [0, 1, 2, 3, 4] and (run_dir / "run.json").read_text() == run_file

    again = agl.run(*common, "trainer.total_steps=1", "trainer.save_freq=1", "trainer.overwrite=true")
    assert again.returncode == 0, again.stderr[-3000:]
    assert steps(run_dir) == [0, 1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_1"]  # old ones gone
    assert json.loads((run_dir / "run.json").read_text())["run_id"] != json.loads(run_file)["run_id"]


def test_overwrite_never_deletes_a_directory_that_is_not_a_run_directory(agl, tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for resume in ("never", "auto"):
        out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={tmp_path}", f"trainer.resume={resume}",
                      "trainer.overwrite=true")
        assert is_clear_error(out, f"trainer.run_dir: {tmp_path} is not empty and is not a run directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # untouched, not even a lock file


@pytest.mark.parametrize("setting, named", [
    ("trainer.resume=autoo", ["trainer.resume", "'autoo'", "did you mean 'auto'?"]),
    ("trainer.resume={tmp}/elsewhere/checkpoints/global_step_5",
     ["trainer.resume", "{tmp}/elsewhere/checkpoints/global_step_5", "existing checkpoint"]),
    ("trainer.resume={tmp}", ["trainer.resume", "{tmp}", "neither a checkpoint"]),
    ("trainer.run_dir={tmp}/a_file/run", ["trainer.run_dir", "{tmp}/a_file/run", "Not a directory"]),
    ("trainer.run_dir={tmp}/a_file", ["trainer.run_dir", "{tmp}/a_file"]),
])
def test_a_bad_resume_or_run_dir_is_one_clear_line(agl, run_dir, tmp_path, setting, named):
    (tmp_path / "a_file").write_text("a file where a directory should be")
    out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", setting.format(tmp=tmp_path),
                  "trainer.total_steps=1")
    assert is_clear_error(out, *(n.format(tmp=tmp_path) for n in named)), out.stderr[-3000:]
    assert not run_dir.exists() or not any(p.name != ".agl.lock" for p in run_dir.iterdir())  # nothing written


def test_a_run_dir_nobody_may_create_is_one_clear_line(agl):
    """sysfs refuses new directories even to root (tests run as root, where chmod stops nothing)."""
    out = agl.run("train", agl.QUICKSTART, "trainer.run_dir=/sys/agl-fault-run", "trainer.total_steps=1")
    assert is_clear_error(out, "trainer.run_dir", "/sys/agl-fault-run", "not permitted"), out.stderr[-3000:]


def test_a_port_in_use_is_one_clear_line_naming_the_setting(agl, run_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = agl.run("train", agl.QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=1",
                      "plugins.slots.collect_rollouts=local_runner",
                      "rollout.agent=examples.guess_number.agent:guess_number", f"rollout.gateway.port={port}")
    assert is_clear_error(out, "rollout.gateway.port", f"127.0.0.1:{port}", "in use"), out.stderr[-3000:]
