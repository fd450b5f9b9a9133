"""The `agl` command, run as a user runs it: a subprocess on the installed console script."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"


def agl(*args, env=None, cwd=ROOT):
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_train_the_quickstart_recipe(tmp_path):
    run_dir = tmp_path / "run"
    out = agl("train", QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=6", "trainer.test_freq=3",
              "trainer.save_freq=3")
    assert out.returncode == 0, out.stderr
    assert "post_process_batch pipeline: instant" in out.stderr  # the printed step plan
    assert "collect_rollouts       instant" in out.stderr
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5, 6]
    assert "val/reward/mean" in lines[0] and "val/reward/mean" in lines[3] and "val/reward/mean" in lines[6]
    assert "step 6:" in out.stdout  # the console logger
    assert "timing over 6 steps" in out.stdout and "core's own share" in out.stdout  # and, at the end, the time
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["trainer"]["total_steps"] == 6
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["global_step_3", "global_step_6"]

    resumed = agl("train", QUICKSTART, f"trainer.run_dir={run_dir}", "trainer.total_steps=8", "trainer.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stderr and "global_step_6" in resumed.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-2:] == [7, 8]


def test_bad_recipe_and_bad_plugin_are_clear_errors(tmp_path):
    out = agl("train", QUICKSTART, "algorithm.estimatr=rloo")
    assert out.returncode == 2
    assert "algorithm.estimatr: unknown key" in out.stderr and "Traceback" not in out.stderr
    out = agl("train", QUICKSTART, "algorithm.estimator=nope", f"trainer.run_dir={tmp_path}")
    assert out.returncode == 2
    assert "unknown estimator 'nope'; registered: gae, grpo" in out.stderr
    out = agl("train", QUICKSTART, "-p", "ghost")
    assert out.returncode == 2 and "'ghost' is enabled but not installed" in out.stderr


def test_doctor_shows_versions_and_slot_owners(tmp_path):
    out = agl("doctor", QUICKSTART)
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "verl" in out.stdout and "ray" in out.stdout
    assert "advantage              estimators" in out.stdout
    assert "update_actor           instant" in out.stdout

    bare = tmp_path / "bare.yaml"
    bare.write_text("algorithm: {estimator: gae}\n")
    out = agl("doctor", bare)
    assert out.returncode == 1
    assert "compute_values         (empty)   <- needed by this recipe" in out.stdout
    assert "update_actor           (empty)   <- needed by this recipe" in out.stdout


def test_disabling_every_plugin_still_lists(tmp_path):
    out = agl("plugins", "-p", "no:console", "--json")
    assert out.returncode == 0
    rows = {row["name"]: row for row in json.loads(out.stdout)}
    assert rows["console"]["status"] == "disabled"
    assert rows["instant"]["status"] == "available"  # installed, not enabled
