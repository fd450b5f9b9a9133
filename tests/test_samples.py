"""The ``samples`` plugin writes a few trained rows of each step; ``agl show`` prints them."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agl_core.builtin import samples
from agl_core.cli.show import pick
from agl_core.config import ConfigError, load
from agl_core.data import Batch
from agl_core.loop import Trainer
from agl_core.testing import BatchRecorder

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart" / "recipe.yaml"


class UpdateRecorder(BatchRecorder):
    """Keeps the batch each update_actor call trains on (a wrapper, like the samples plugin's)."""

    def __init__(self):
        super().__init__()
        self.updates = []

    from agl_core import hookimpl

    @hookimpl(wrapper=True)
    def update_actor(self, ctx, batch):
        self.updates.append((ctx.step, batch))
        return (yield)


def train(run_dir, *overrides, recorder=None):
    extra = [("samples", samples)] + ([("recorder", recorder)] if recorder else [])
    recipe, pset = load(QUICKSTART, [f"trainer.run_dir={run_dir}", "trainer.progress=false", "trainer.test_freq=0",
                                     "plugins.samples.rows=3", *overrides], extra_plugins=extra)
    return Trainer(recipe, pset).fit()


def test_each_step_writes_a_sample_of_the_rows_it_trained(tmp_path):
    run_dir = tmp_path / "run"
    recorder = UpdateRecorder()
    train(run_dir, "trainer.total_steps=3", recorder=recorder)
    assert sorted(samples.steps_in(run_dir / "samples")) == [1, 2, 3]
    for step, batch in recorder.updates:
        rows = samples.read_step(run_dir / "samples" / f"{step}.jsonl")
        assert len(rows) == 3 < len(batch)
        trained = {rid: i for i, rid in enumerate(batch["rollout_id"])}
        for row in rows:
            assert row["step"] == step and row["rollout_id"] in trained
            i = trained[row["rollout_id"]]
            mask = batch["response_mask"][i].bool()
            assert row["reward"] == pytest.approx(float(batch["token_level_scores"][i].sum()))
            assert row["advantage"]["mean"] == pytest.approx(float(batch["advantages"][i][mask].mean()))
            assert row["uid"] == batch["uid"][i] and row["trained_tokens"] == int(mask.sum())
            # the instant backend has no tokenizer: the token ids, as trained
            assert row["text"] is False and row["response_ids"] == batch["responses"][i][mask].tolist()


def test_a_resumed_run_writes_each_step_once(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "trainer.total_steps=3", "trainer.save_freq=2")
    first = (run_dir / "samples" / "3.jsonl").read_text()
    # as if the process was killed after step 3, before its checkpoint: the run resumes from step 2
    shutil.rmtree(run_dir / "checkpoints" / "global_step_3")
    (run_dir / "samples" / "3.jsonl").write_text("step 3 of the killed process\n")
    train(run_dir, "trainer.total_steps=4", "trainer.resume=auto")
    assert sorted(samples.steps_in(run_dir / "samples")) == [1, 2, 3, 4]
    assert (run_dir / "samples" / "3.jsonl").read_text() == first  # written again, as the resumed run trained it


def test_bad_settings_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"plugins.samples.rows: Input should be greater than or equal to 1"):
        train(tmp_path / "run", "plugins.samples.rows=0")


def test_agl_show_prints_a_step_and_says_what_is_missing(tmp_path):
    run_dir = tmp_path / "run"
    train(run_dir, "trainer.total_steps=2", "plugins.samples.every=2")
    assert sorted(samples.steps_in(run_dir / "samples")) == [2]
    out = subprocess.run([sys.executable, "-m", "agl_core.cli", "show", str(run_dir), "-n", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    first = samples.read_step(run_dir / "samples" / "2.jsonl")[0]
    assert f"step 2 · rollout {first['rollout_id']}" in out.stdout and "2 of the 3 rows written" in out.stdout
    assert "response [" in out.stdout and "the backend gave no tokenizer" in out.stdout
    missing = subprocess.run([sys.executable, "-m", "agl_core.cli", "show", str(run_dir), "--step", "1"],
                             capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "no samples of step 1 (nearest: 2; steps written: 2)" in missing.stderr
    with pytest.raises(ValueError, match=r"holds no samples .* plugins: \{samples: \{rows: 8\}\}"):
        pick(tmp_path, None)


def test_decoded_text_comes_from_the_backend_tokenizer(tmp_path, make_recipe):
    """A real tokenizer of the kind the embedded backend builds (agl-plugin-torch's word tokenizer)."""
    from agl_core.components import Components
    from agl_core.context import TrainContext
    from agl_core.testing.contracts import example_batch
    from agl_plugin_torch import modeling

    recipe, pset = make_recipe(plugins=[("samples", samples)])
    ctx = TrainContext(recipe, pset, Components.collect(pset), tmp_path, step=1)
    ctx.tokenizer = modeling.word_tokenizer([f"w{i}" for i in range(60)])
    batch = example_batch(rows=2, prompt_length=4)
    rows = samples.records(ctx, batch, 2)
    response = batch["responses"][0][batch["attention_mask"][0, 4:].bool()].tolist()
    assert rows[0]["text"] is True and "response_ids" not in rows[0]
    assert rows[0]["response"] == ctx.tokenizer.decode(response) and rows[0]["response"].split()[0].startswith("w")
