"""agl-plugin-wandb on real offline W&B runs (wandb's offline mode: nothing leaves the machine).

W&B 0.31 writes an offline run as a binary transaction log that only its service reads back, so the tests
spy on ``Run.log`` and ``Run.log_artifact``: each call is recorded, then goes to the real run.
"""

import json
import shutil
import time
from pathlib import Path

import pytest
import wandb
import yaml

from agl_core.config import load
from agl_core.loop import Trainer
from agl_core.testing.contracts import PluginContract

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


@pytest.fixture
def sent(monkeypatch):
    """What the plugin sent to W&B: [(step, metrics)] and the artifacts' names, recorded on the way to the real run."""
    calls = {"log": [], "artifacts": [], "init": []}
    log, log_artifact, init = wandb.sdk.wandb_run.Run.log, wandb.sdk.wandb_run.Run.log_artifact, wandb.init

    def spy_init(**kwargs):
        calls["init"].append(kwargs)
        return init(**kwargs)

    def spy_log(self, data, step=None, **kwargs):
        calls["log"].append((step, dict(data)))
        return log(self, data, step=step, **kwargs)

    def spy_artifact(self, artifact, *args, **kwargs):
        calls["artifacts"].append((artifact.name, artifact.type, sorted(artifact.manifest.entries)))
        return log_artifact(self, artifact, *args, **kwargs)

    monkeypatch.setattr(wandb, "init", spy_init)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy_log)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log_artifact", spy_artifact)
    return calls


def train(run_dir, *overrides):
    recipe, pset = load(QUICKSTART, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.test_freq=2",
                                     "plugins.wandb.project=agl-test", *overrides], ["wandb"])
    trainer = Trainer(recipe, pset)
    trainer.fit()
    return trainer


def logged(run_dir):
    return {r.pop("step"): r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_every_step_the_recipe_and_the_curves_go_to_one_run(tmp_path, sent):
    run_dir = tmp_path / "run"
    trainer = train(run_dir, "trainer.total_steps=3")
    run_id = trainer.ctx.run_id
    assert [step for step, _ in sent["log"]] == [0, 1, 2, 3]
    jsonl = logged(run_dir)
    for step, metrics in sent["log"]:
        assert metrics == {k: v for k, v in jsonl[step].items() if v is not None and not isinstance(v, bool)}
    assert sent["artifacts"] == [(f"curves-{run_id}", "plot", ["curves.png"])]
    runs = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1 and (runs[0] / f"run-{run_id}.wandb").is_file()
    (init,) = sent["init"]
    assert (init["id"], init["resume"], init["project"], init["dir"]) == (run_id, "allow", "agl-test", str(run_dir))
    assert init["config"] == yaml.safe_load((run_dir / "config.yaml").read_text())  # the resolved recipe
    assert init["config"]["trainer"]["total_steps"] == 3
    assert json.loads((run_dir / "wandb.json").read_text()) == {"run_id": run_id, "last_step": 3}


def test_a_resumed_run_continues_the_same_run_and_sends_each_step_once(tmp_path, sent):
    run_dir = tmp_path / "run"
    first = train(run_dir, "trainer.total_steps=3", "trainer.save_freq=2", "plugins.wandb.plot=false")
    # killed after logging step 3, before its checkpoint: the resumed run trains step 3 again
    shutil.rmtree(run_dir / "checkpoints" / "global_step_3")
    sent["log"].clear()
    # W&B names an offline run's directory by the second the process starts it: the resumed one starts in a later
    # second than the first (a first run that lasts under a second would otherwise share its directory).
    started = int(time.time())
    while int(time.time()) == started:
        time.sleep(0.02)
    resumed = train(run_dir, "trainer.total_steps=4", "trainer.resume=auto", "plugins.wandb.plot=false")
    assert resumed.ctx.run_id == first.ctx.run_id
    assert [(i["id"], i["resume"]) for i in sent["init"]] == [(first.ctx.run_id, "allow")] * 2
    assert [step for step, _ in sent["log"]] == [4]  # step 3 is in W&B already, from the first process
    assert len(sorted((run_dir / "wandb").glob(f"offline-run-*-{first.ctx.run_id}"))) == 2  # one run, resumed
    assert sent["artifacts"] == []


def test_a_new_run_in_the_directory_is_a_new_wandb_run(tmp_path, sent):
    run_dir = tmp_path / "run"
    first = train(run_dir, "trainer.total_steps=1", "plugins.wandb.plot=false")
    sent["log"].clear()
    again = train(run_dir, "trainer.total_steps=1", "trainer.resume=never", "trainer.overwrite=true",
                  "plugins.wandb.plot=false")
    assert again.ctx.run_id != first.ctx.run_id and [step for step, _ in sent["log"]] == [0, 1]


class TestWandbContract(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "wandb"

    @pytest.fixture
    def plugin_overrides(self):
        return ["plugins.wandb.mode=offline", "plugins.wandb.plot=false"]
