"""``agl new-plugin``: the rendered distribution installs, passes its own tests and trains the quick start.

The end-to-end test really ``pip install``s the generated plugin into this
environment (editable, no build isolation: nothing is downloaded) and
uninstalls it at the end.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from agl_core.cli.new_plugin import TEMPLATED_HOOKS, NewPluginError, main, render
from agl_core.testing import check_plugin

REPO = Path(__file__).resolve().parents[1]


def run(*argv, cwd=None):
    # Third-party plugins not asked for stay unimported (verl, ray: seconds each), as a plugin author's venv has none.
    return subprocess.run([*argv], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "AGL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def test_generated_plugin_installs_passes_its_tests_and_trains_one_step(tmp_path):
    name = f"scaffold{os.getpid()}"
    out = tmp_path / "dist"
    assert main(SimpleNamespace(name=name, hook=["register_estimators", "log_metrics", "save_checkpoint"],
                                output=str(out))) == 0
    for path in ("pyproject.toml", "README.md", ".github/workflows/ci.yml", f"agl_plugin_{name}/__init__.py",
                 f"agl_plugin_{name}/settings.py", f"tests/test_{name}.py"):
        assert (out / path).is_file(), path
    assert "[build-system]" in (out / "pyproject.toml").read_text()
    installed = run(sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", "-e", str(out))
    assert installed.returncode == 0, installed.stderr
    try:
        tests = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(out / "tests"), cwd=out)
        assert tests.returncode == 0, tests.stdout + tests.stderr
        assert " passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout

        run_dir = tmp_path / "run"
        trained = run(sys.executable, "-m", "agl_core.cli", "train", "-p", name,
                      str(REPO / "examples/quickstart/recipe.yaml"), f"algorithm.estimator={name}_baseline",
                      "trainer.total_steps=1", "trainer.test_freq=1", f"trainer.run_dir={run_dir}",
                      "trainer.progress=false", f"data.train_files=[{REPO}/examples/quickstart/train.jsonl]",
                      f"data.val_files=[{REPO}/examples/quickstart/val.jsonl]")
        assert trained.returncode == 0, trained.stderr[-3000:]
        logged = [json.loads(line) for line in (run_dir / f"{name}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in logged] == [0, 1] and "actor/pg_loss" in logged[1]
        assert (run_dir / "checkpoints/global_step_1" / f"{name}.json").is_file()
    finally:
        removed = run(sys.executable, "-m", "pip", "uninstall", "-y", f"agl-plugin-{name}")
        assert removed.returncode == 0, removed.stderr


@pytest.mark.parametrize("hook", [*TEMPLATED_HOOKS, "plugin_config_schema"])
def test_each_templated_hook_renders_a_plugin_that_loads(tmp_path, monkeypatch, hook):
    name = f"only_{hook}"
    render(name, [hook], tmp_path / "dist")
    monkeypatch.syspath_prepend(str(tmp_path / "dist"))
    module = importlib.import_module(f"agl_plugin_{name}")
    plugin = check_plugin(module, name)
    assert hook in plugin.hooks and "plugin_config_schema" in plugin.hooks


@pytest.mark.parametrize("name, hooks, message", [
    ("My-Plugin", [], "lower-case letters"),
    ("slots", [], "reserved"),
    ("ok", ["log_metric"], "not a hook of agl_core \\(did you mean 'log_metrics'\\?\\); hooks with a template: "),
    ("ok", ["compute_old_logprob"], "no starting point for a slot hook"),
])
def test_bad_input_is_refused_naming_it(tmp_path, name, hooks, message):
    with pytest.raises(NewPluginError, match=message):
        render(name, hooks, tmp_path / "dist")
    assert not (tmp_path / "dist").exists()


def test_a_non_empty_output_directory_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(NewPluginError, match="not an empty directory"):
        render("ok", [], tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_help_lists_the_hooks_with_a_template():
    from agl_core.cli import build_parser

    parser = build_parser()
    new_plugin = parser._subparsers._group_actions[0].choices["new-plugin"]
    text = new_plugin.format_help()
    for hook in TEMPLATED_HOOKS:
        assert f"  {hook} " in text, hook
    assert "(default: register_estimators log_metrics)" in " ".join(text.split())


def test_without_copier_the_error_names_the_extra_that_brings_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "copier", None)  # import copier now raises ImportError
    with pytest.raises(NewPluginError, match=r'pip install "agl-core\[plugin-dev\]"'):
        render("ok", [], tmp_path / "dist")
