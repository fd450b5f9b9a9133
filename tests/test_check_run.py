"""scripts/check_run.py passes a run that trained and fails each way a smoke run can look fine and train nothing.

The runs are real: ``agl train`` of examples/smoke/recipe.yaml on the embedded backend (a tiny Qwen2 model made
from a config), in this process so that a test can break one part of it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from agl_core.cli import main

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "smoke" / "recipe.yaml"
IN_PROCESS = ["plugins.torch.serving.process=false"]  # a patched server must be the one that serves


def load_checker():
    spec = importlib.util.spec_from_file_location("check_run", REPO / "scripts" / "check_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check_run = load_checker()


def train(run_dir: Path, *overrides: str) -> int:
    return main(["train", str(RECIPE), f"trainer.run_dir={run_dir}", *overrides])


def check(run_dir: Path, capsys, *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = check_run.main([str(run_dir), *args])
    return code, capsys.readouterr().out


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """Three steps with validation and a checkpoint at step 3, then one more step resumed from it."""
    run_dir = tmp_path_factory.mktemp("good") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        assert train(run_dir) == 0
        (run_dir / "three_steps.jsonl").write_text((run_dir / "metrics.jsonl").read_text())
        assert train(run_dir, "trainer.total_steps=4", "trainer.resume=auto", "trainer.save_freq=1") == 0
    return run_dir


def test_the_reward_is_the_share_of_the_target_word(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from examples.smoke.agent import reward

    assert reward("yes no yes yes") == reward("yesnoyesyes") == 9 / 11
    assert reward("") == 0.0 and reward("no maybe") == 0.0 and reward("yes") == 1.0


def test_a_run_that_trained_passes_and_its_resume_too(good_run, capsys):
    code, out = check(good_run, capsys, "--steps", "3")
    assert code == 0, out
    assert "PASS  served log-probs match the trainer's" in out and "PASS  weights moved" in out
    code, out = check(good_run, capsys, "--resumed-at", "3")
    assert code == 0, out
    assert "PASS  resumed from step 3's weights" in out


def test_a_run_started_over_is_not_a_resume(good_run, tmp_path, capsys, monkeypatch):
    """Step 4 trained from the initial weights (``resume=never`` into a copy of the run): the resume check fails."""
    monkeypatch.chdir(REPO)
    import shutil

    copy_dir = tmp_path / "run"
    shutil.copytree(good_run / "checkpoints" / "global_step_3", tmp_path / "step3")
    assert train(copy_dir, "trainer.total_steps=1", "trainer.save_freq=1", "trainer.test_freq=0") == 0
    # The fresh run's step-1 checkpoint stands as "step 4" of a run whose step 3 is the good run's.
    (copy_dir / "checkpoints" / "global_step_1").rename(copy_dir / "checkpoints" / "global_step_4")
    shutil.copytree(tmp_path / "step3", copy_dir / "checkpoints" / "global_step_3")
    shutil.copyfile(good_run / "metrics.jsonl", copy_dir / "metrics.jsonl")
    code, out = check(copy_dir, capsys, "--resumed-at", "3", "--steps", "4")
    assert code == 1 and "FAIL  resumed from step 3's weights" in out, out


def test_an_always_failing_agent_fails(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    train(run_dir, "rollout.agent=examples.smoke.agent:always_fails", "trainer.total_steps=2")
    code, out = check(run_dir, capsys)
    assert code == 1, out
    assert "FAIL  no step skipped" in out and "FAIL  no rollout failed" in out


def test_a_wrong_model_name_fails(tmp_path, capsys, monkeypatch):
    """Every call names a model the server does not serve, and is refused with 404.

    The embedded backend answers any model name (by design); vLLM, which cannot run on a CPU, answers 404 to
    names other than the one it serves. The server is patched to do as vLLM does.
    """
    from agl_plugin_torch import server
    from agl_plugin_torch.server import RequestError

    def refuse_other_names(self, name):
        if name != "policy":
            raise RequestError(404, f"The model `{name}` does not exist.")
    monkeypatch.setattr(server.PolicyServer, "_check_model", refuse_other_names)
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    train(run_dir, "rollout.model=Qwen/not-this-one", "trainer.total_steps=1", "trainer.test_freq=0", *IN_PROCESS)
    code, out = check(run_dir, capsys)
    assert code == 1, out
    assert "FAIL  model calls made, none failed" in out or "FAIL  no step skipped" in out


def test_served_weights_that_differ_from_the_trained_ones_fail(tmp_path, capsys, monkeypatch):
    """The endpoint generates with a perturbed copy of the actor (as vLLM serving stale or dummy weights would)."""
    from agl_plugin_torch import serving_process

    serve_model = serving_process.serve_model

    def serve_other_weights(model, *args, **kwargs):
        other = copy.deepcopy(model)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for param in other.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
        return serve_model(other, *args, **kwargs)
    monkeypatch.setattr(serving_process, "serve_model", serve_other_weights)
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    assert train(run_dir, "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=1", *IN_PROCESS) == 0
    code, out = check(run_dir, capsys)
    assert code == 1, out
    assert "FAIL  served log-probs match the trainer's" in out
    row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert row["rollout_corr/tis_max"] > 4 or not 0.9 <= row["rollout_corr/tis_mean"] <= 1.1


def test_a_skipped_step_fails(tmp_path, capsys, monkeypatch):
    """The first step's 16 rollouts succeed, every one after fails: step 2 is skipped, the rest looks fine."""
    monkeypatch.setenv("AGL_SMOKE_GOOD_ROLLOUTS", "16")
    monkeypatch.chdir(REPO)
    run_dir = tmp_path / "run"
    train(run_dir, "rollout.agent=examples.smoke.agent:fails_after_first_step", "trainer.total_steps=2",
          "trainer.test_freq=0", "trainer.save_freq=2")
    code, out = check(run_dir, capsys)
    assert code == 1, out
    assert "FAIL  no step skipped (training/skipped_step): step 2: skipped" in out
    assert "step 1:" not in out  # step 1 trained: only step 2 is blamed


def test_a_directory_that_is_no_run_fails(tmp_path, capsys):
    code, out = check(tmp_path, capsys)
    assert code == 1 and "no metrics.jsonl or config.yaml" in out
