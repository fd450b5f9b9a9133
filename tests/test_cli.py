"""The `agl` command, run as a user runs it: a subprocess on the installed console script."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from agl_core import HOOK_API_VERSION

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
    assert "unknown estimator 'nope'; registered: gae, gigpo, grpo" in out.stderr
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


def test_options_and_overrides_in_any_order():
    """``-p`` before, between or after the positionals, for every subcommand that takes them."""
    for args in (("config", "show", QUICKSTART, "-p", "no:console", "trainer.total_steps=3"),
                 ("config", "show", "-p", "no:console", QUICKSTART, "trainer.total_steps=3"),
                 ("config", "show", QUICKSTART, "trainer.total_steps=3", "-p", "no:console")):
        out = agl(*args)
        assert out.returncode == 0, (args, out.stderr)
        assert yaml.safe_load(out.stdout)["trainer"]["total_steps"] == 3
    out = agl("doctor", QUICKSTART, "-p", "no:console", "algorithm.estimator=rloo")
    assert out.returncode == 0, out.stderr


def test_train_with_p_between_recipe_and_overrides_and_traced_hooks(tmp_path):
    """The order writing-a-plugin.md shows; -p no:NAME beats the recipe's own plugins section; --trace-hooks."""
    run_dir = tmp_path / "run"
    out = agl("train", QUICKSTART, "-p", "no:tensorboard", f"trainer.run_dir={run_dir}", "trainer.total_steps=1",
              "trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=0", "--trace-hooks")
    assert out.returncode == 0, out.stderr
    assert "hook update_actor [instant]" in out.stderr and "ms -> dict(" in out.stderr
    assert "hook post_process_batch [instant]" in out.stderr and "-> Batch(" in out.stderr
    assert "hook log_metrics [tensorboard]" not in out.stderr
    out = agl("config", "show", QUICKSTART, "-p", "no:instant")
    assert out.returncode == 0, out.stderr
    assert "instant" not in yaml.safe_load(out.stdout)["plugins"]


def broken_stage_plugin(root: Path) -> None:
    from agl_core.testing import write_distribution

    source = f"""
from agl_core import hookimpl
AGL_HOOK_API = "{HOOK_API_VERSION}"
AGL_ORDER = 50

@hookimpl
def post_process_batch(batch):
    batch.meta["touched"] = True
"""
    write_distribution(root, "agl-plugin-forgetful", "0.3", {"forgetful_plugin": source},
                       {"forgetful": "forgetful_plugin"})


def test_a_stage_returning_none_is_an_agl_error_line(tmp_path):
    broken_stage_plugin(tmp_path)
    out = agl("train", QUICKSTART, "-p", "forgetful", f"trainer.run_dir={tmp_path / 'run'}", "trainer.total_steps=1",
              "trainer.val_before_train=false", env={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2
    assert ("agl: error: plugin forgetful (agl-plugin-forgetful 0.3): hook 'post_process_batch' returned None, "
            "expected the Batch it was given") in out.stderr
    assert "Traceback" not in out.stderr


def test_plugins_json_verbose_and_doctor_without_a_recipe(tmp_path):
    from agl_core.testing import write_distribution

    write_distribution(tmp_path, "agl-plugin-crash", "0.1", {"crash_plugin": "raise RuntimeError('boom')\n"},
                       {"crash": "crash_plugin"})
    env = {"PYTHONPATH": str(tmp_path)}
    rows = {row["name"]: row for row in json.loads(agl("plugins", "--json", env=env).stdout)}
    assert rows["instant"]["order"] == 10 and rows["console"]["order"] == 100
    assert rows["estimators"]["hook_kinds"]["advantage"] == "slot"
    assert rows["console"]["hook_kinds"]["log_metrics"] == "broadcast"
    assert rows["crash"]["status"] == "failed" and "RuntimeError: boom" in rows["crash"]["traceback"]
    short = agl("plugins", env=env)
    assert "Traceback" not in short.stdout and "--verbose" in short.stdout
    verbose = agl("plugins", "--verbose", env=env)
    assert verbose.returncode == 0
    assert "plugin crash failed to import" in verbose.stdout and "Traceback" in verbose.stdout
    assert "raise RuntimeError('boom')" in verbose.stdout

    out = agl("doctor")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.split() == ["grpo", "estimators"] for line in lines)
    assert any(line.split() == ["memory", "memory_store"] for line in lines)
    assert any(line.split() == ["transition", "traces", "(not", "active:", "-p", "traces)"] for line in lines)
    assert "loggers (log_metrics):" in out.stdout and "  console" in lines


def test_doctor_lists_wrappers_and_aligns_long_component_names(tmp_path):
    from agl_core.testing import write_distribution

    source = f"""
        from agl_core import hookimpl

        AGL_HOOK_API = {HOOK_API_VERSION!r}
        LONG = "a_very_long_estimator_name_of_a_third_party_plugin"

        @hookimpl
        def register_estimators(register):
            register(LONG, lambda batch, config: None)

        @hookimpl(wrapper=True)
        def update_actor():
            return (yield)
    """
    write_distribution(tmp_path, "agl-plugin-timer", "0.1", {"timer_plugin": source}, {"timer": "timer_plugin"})
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    out = agl("doctor", "-p", "timer", env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    estimators = lines[lines.index("estimators:") + 1:lines.index("policy losses:") - 1]
    assert "  a_very_long_estimator_name_of_a_third_party_plugin  timer" in estimators
    assert len({line.index(line.split()[1]) for line in estimators}) == 1  # one column of owners
    wrappers = lines[lines.index("wrappers (outermost first):") + 1:]
    # the built-in samples plugin wraps update_actor too, listed as not active unless the recipe enables it
    assert wrappers == ["  update_actor  timer, samples (not active: -p samples)"]
    inactive = agl("doctor", env=env).stdout.splitlines()
    assert any(line.startswith("  update_actor  ") and "timer (not active: -p timer)" in line for line in inactive)


def test_help_shows_the_defaults_of_options():
    from agl_core.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    runner = " ".join(commands["runner"].format_help().split())
    for flag, default in (("--connect-timeout-s", "60.0"), ("--workers", "8"), ("--lease-s", "30.0"),
                          ("--drain-s", "30.0"), ("--timeout-s", "600.0"), ("--model", "policy")):
        assert f"(default: {default})" in runner.split(flag, 2)[2].split(" --")[0], flag
    assert "(default: None)" not in runner and "(default: [])" not in runner
    store = commands["serve"]._subparsers._group_actions[0].choices["store"]
    assert "(default: 127.0.0.1)" in " ".join(store.format_help().split())


def test_every_subcommand_parses_options_between_its_positionals():
    from agl_core.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["export", "RUN", "k=v", "--merged", "OUT", "-p", "x", "j=w"])
    assert (args.run_dir, args.overrides, args.merged, args.plugin_flags) == ("RUN", ["k=v", "j=w"], "OUT", ["x"])
    args = parser.parse_args(["doctor", "-p", "no:console", "R.yaml", "a=1", "-p", "x"])
    assert (args.recipe, args.overrides, args.plugin_flags) == ("R.yaml", ["a=1"], ["no:console", "x"])
    args = parser.parse_args(["new-plugin", "mine", "--hook", "log_metrics", "-o", "out", "--hook", "advantage"])
    assert (args.name, args.hook, args.output) == ("mine", ["log_metrics", "advantage"], "out")
    assert parser.parse_args(["new-plugin", "mine"]).hook == []
