"""agl-plugin-mlflow on real MLflow runs in a local file store, read back with MLflow's client.

MLflow is not installed by requirements-test.txt (its install is slow and downgrades packages): these tests
skip without it. ``pip install mlflow-skinny`` (or ``pip install -e plugins/agl-plugin-mlflow``) to run them;
the optional CI job ``mlflow`` does.
"""

import json
import shutil
from pathlib import Path

import pytest

mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed (pip install mlflow-skinny): the optional "
                                              "mlflow job runs these tests")

from mlflow.tracking import MlflowClient  # noqa: E402

from agl_core.config import load  # noqa: E402
from agl_core.loop import Trainer  # noqa: E402
from agl_core.testing.contracts import PluginContract  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"


@pytest.fixture(autouse=True)
def file_store(monkeypatch):
    """MLflow 3.x keeps its local file store behind this switch (it prefers a database now)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")


def train(run_dir, store, *overrides):
    recipe, pset = load(QUICKSTART, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.test_freq=2",
                                     f"plugins.mlflow.tracking_uri=file:{store}", "plugins.mlflow.experiment=agl-test",
                                     *overrides], ["mlflow"])
    trainer = Trainer(recipe, pset)
    trainer.fit()
    return trainer


def the_runs(store):
    client = MlflowClient(tracking_uri=f"file:{store}")
    experiment = client.get_experiment_by_name("agl-test")
    return client, client.search_runs([experiment.experiment_id])


def history(client, run_id, key):
    return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_every_step_the_recipe_and_the_curves_go_to_one_run(tmp_path):
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    trainer = train(run_dir, store, "trainer.total_steps=3")
    client, (run,) = the_runs(store)
    assert run.info.status == "FINISHED" and run.data.tags["agl.run_id"] == trainer.ctx.run_id
    assert run.data.tags["mlflow.runName"] == "run" and run.data.tags["agl.last_step"] == "3"
    assert run.data.params["trainer.total_steps"] == "3" and run.data.params["algorithm.estimator"] == "grpo"
    jsonl = {r.pop("step"): r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for key in ("critic/score/mean_before_processing", "actor/pg_loss", "val/reward/mean"):
        expected = [(step, pytest.approx(r[key])) for step, r in jsonl.items() if r.get(key) is not None]
        assert history(client, run.info.run_id, key) == expected, key
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["config.yaml", "curves.png"]


def test_a_resumed_run_continues_the_same_run_and_holds_each_step_once(tmp_path):
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    first = train(run_dir, store, "trainer.total_steps=3", "trainer.save_freq=2", "plugins.mlflow.plot=false")
    # killed after logging step 3, before its checkpoint: the resumed run trains step 3 again
    shutil.rmtree(run_dir / "checkpoints" / "global_step_3")
    train(run_dir, store, "trainer.total_steps=4", "trainer.resume=auto", "plugins.mlflow.plot=false")
    client, (run,) = the_runs(store)
    assert run.data.tags["agl.run_id"] == first.ctx.run_id and run.info.status == "FINISHED"
    assert [step for step, _ in history(client, run.info.run_id, "actor/pg_loss")] == [1, 2, 3, 4]
    assert run.data.params["trainer.total_steps"] == "3"  # params: how the run started (MLflow keeps them)


def test_a_new_run_in_the_directory_is_a_new_mlflow_run(tmp_path):
    run_dir, store = tmp_path / "run", tmp_path / "mlruns"
    train(run_dir, store, "trainer.total_steps=1", "plugins.mlflow.plot=false")
    train(run_dir, store, "trainer.total_steps=1", "trainer.resume=never", "trainer.overwrite=true",
          "plugins.mlflow.plot=false")
    _, runs = the_runs(store)
    assert len(runs) == 2 and len({r.data.tags["agl.run_id"] for r in runs}) == 2


class TestMlflowContract(PluginContract):
    @pytest.fixture
    def plugin_name(self):
        return "mlflow"

    @pytest.fixture
    def plugin_overrides(self, tmp_path):
        return [f"plugins.mlflow.tracking_uri=file:{tmp_path}/mlruns", "plugins.mlflow.plot=false"]
