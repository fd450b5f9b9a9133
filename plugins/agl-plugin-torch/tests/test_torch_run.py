"""Whole runs on the torch backend: the real loop, runner, gateway, openai client and HTTP endpoint.

Covered: resuming a run from a checkpoint gives the metrics of an uninterrupted
run, with concurrent agents (every call is seeded by its place in the run, so
batching does not change the samples); misbehaving agents fail their rollouts while training goes on; a missing
model path is one clear error; a run's model and checkpoints reload with
``from_pretrained``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from agl_core.cli import main
from agl_core.config import ConfigError, load
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.testing import BatchRecorder

from agl_plugin_torch import modeling
from agl_plugin_torch.backend import ACTOR_DIR
from torch_test_agents import RELEASE
from agl_plugin_torch.testing import full_forward_logprobs, tiny_section

TASKS = [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(4)]
NOT_REPRODUCIBLE = ("timing_s/", "timing_per_token_ms/", "perf/", "rollout/latency_s/")


def recipe_file(tmp_path, name="recipe.yaml", **sections) -> str:
    recipe = {
        "data": {"train_batch_size": 2, "max_prompt_length": 24, "max_response_length": 24},
        "algorithm": {"estimator": "grpo", "ppo_mini_batch_size": 4, "ppo_epochs": 2},
        "rollout": {"n": 2, "timeout_s": 30, "agent": "torch_test_agents:short_answers", "n_workers": 4},
        "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 2, "val_before_train": False,
                    "progress": False, "resume": "never"},
        "plugins": {"torch": tiny_section(), "traces": {"aggregator": "trajectory"}},
    }
    for section, values in sections.items():
        recipe[section] = {**recipe.get(section, {}), **values}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def run(path, overrides=()) -> Trainer:
    recipe, pset = load(path, list(overrides), ["torch", "traces"])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=TASKS[:2])
    trainer.fit()
    return trainer


def logged(run_dir) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_REPRODUCIBLE)} for r in records}


def test_a_resumed_run_logs_the_metrics_of_an_uninterrupted_one(tmp_path):
    common = ["trainer.total_steps=4", "trainer.save_freq=2", "trainer.test_freq=2"]
    whole = tmp_path / "whole"
    whole.mkdir()
    run(recipe_file(whole), common)
    parts = tmp_path / "parts"
    parts.mkdir()
    path = recipe_file(parts)
    run(path, common + ["trainer.total_steps=2"])
    resumed = run(path, common + ["trainer.resume=auto"])
    expected, got = logged(whole / "run"), logged(parts / "run")
    assert sorted(got) == [1, 2, 3, 4]  # steps 1-2 from the first process, 3-4 after resuming
    for step in (3, 4):
        assert got[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (step, key)
    assert expected[4]["actor/pg_loss"] != expected[3]["actor/pg_loss"]  # it did train
    assert resumed.ctx.state["torch"].weight_version == 4


def test_the_run_reloads_with_from_pretrained(tmp_path):
    trainer = run(recipe_file(tmp_path), ["trainer.save_freq=2"])
    backend = trainer.ctx.state["torch"]
    for directory in (trainer.ctx.run_dir / "model", trainer.ctx.run_dir / "checkpoints/global_step_2" / ACTOR_DIR):
        model = AutoModelForCausalLM.from_pretrained(directory)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        assert tokenizer.encode("guess a number 5") == backend.tokenizer.encode("guess a number 5")
        assert tokenizer.decode(tokenizer.encode("higher , 3")) == "higher , 3"
        assert tokenizer.apply_chat_template([{"role": "user", "content": "5"}], add_generation_prompt=True,
                                             return_dict=False) == backend.tokenizer.apply_chat_template(
            [{"role": "user", "content": "5"}], add_generation_prompt=True, return_dict=False)
        assert model.num_parameters() == backend.actor.num_parameters()
    trained = AutoModelForCausalLM.from_pretrained(trainer.ctx.run_dir / "checkpoints/global_step_2" / ACTOR_DIR)
    for a, b in zip(trained.parameters(), backend.actor.parameters()):
        assert torch.equal(a, b)


def test_misbehaving_agents_fail_their_rollouts_and_training_goes_on(tmp_path):
    tasks = [Task(id="ok", input={"text": "guess a number"}), Task(id="raise", input={"fault": "raise"}),
             Task(id="hang", input={"fault": "hang"}), Task(id="garbage", input={"fault": "garbage"})]
    path = recipe_file(tmp_path, rollout={"agent": "torch_test_agents:faulty", "timeout_s": 1.5, "n": 4,
                                          "n_workers": 8})
    recipe, pset = load(path, ["data.train_batch_size=4", "data.shuffle=false"], ["torch", "traces"])
    trainer = Trainer(recipe, pset, train_tasks=tasks, val_tasks=[])
    try:
        metrics = trainer.fit()
    finally:
        RELEASE.set()  # let the hung agent threads end
    assert metrics["rollout/n_failed"] == 8  # raised, or returned a non-number
    assert metrics["rollout/n_timed_out"] == 4
    assert metrics["rollout/n_succeeded"] == 4
    assert trainer.ctx.state["torch"].weight_version == 2  # both steps updated the actor
    assert math.isfinite(metrics["actor/pg_loss"])
    assert metrics["training/rollout_logprob_diff/max"] < 1e-4


def test_served_logprobs_and_weight_versions_reach_the_spans_and_training(tmp_path):
    path = recipe_file(tmp_path, rollout={"agent": "torch_test_agents:say_five", "n": 4, "n_workers": 8})
    recorder = BatchRecorder(order=1)
    recipe, pset = load(path, [], ["torch", "traces"], extra_plugins=[("recorder", recorder)])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
    trainer.fit()
    metrics = logged(trainer.ctx.run_dir)
    for step, rollouts in enumerate((b.meta["rollouts"] for b in recorder.batches), start=1):
        # Through the gateway, the store and the trajectory aggregator, from concurrent batched calls.
        assert metrics[step]["training/n_calls"] == 16
        assert 0 <= metrics[step]["training/rollout_logprob_diff/max"] < 1e-4
        calls = [span for r in rollouts for span in r.spans if span.kind == "llm_call"]
        # Step s samples with the weights of update s - 1, and each span says so.
        assert {span.attributes["response"]["weight_version"] for span in calls} == {step - 1}
        assert {span.attributes["weight_version"] for span in calls} == {step - 1}


def test_a_missing_model_path_is_one_clear_error(tmp_path, capsys):
    path = recipe_file(tmp_path)
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ConfigError, match=f"model directory '{missing}' does not exist"):
        load(path, [f"plugins.torch.model.path={missing}", "plugins.torch.model.build=null"], ["torch", "traces"])
    assert main(["train", path, f"plugins.torch.model.path={missing}", "plugins.torch.model.build=null"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("agl: error:") and "does not exist" in err and "Traceback" not in err


def test_a_local_model_directory_is_served_and_trained(tmp_path):
    made = modeling.create(modeling.ModelConfig.model_validate(tiny_section()["model"]), tmp_path / "made", seed=3)
    path = recipe_file(tmp_path)
    trainer = run(path, [f"plugins.torch.model.path={made}", "plugins.torch.model.build=null",
                         "trainer.total_steps=1"])
    backend = trainer.ctx.state["torch"]
    assert backend.source == made and backend.weight_version == 1
    p = backend.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                              return_dict=False)
    assert len(full_forward_logprobs(backend, p, [5, 6])) == 2


def test_the_backend_lends_its_tokenizer_to_the_samples_plugin(tmp_path):
    """ctx.tokenizer is the policy's: the samples plugin writes the trained rows' text, as the model wrote it."""
    from agl_core.builtin import samples

    recipe, pset = load(recipe_file(tmp_path), ["trainer.total_steps=1", "plugins.samples.rows=2"], ["torch", "traces"],
                        extra_plugins=[("samples", samples)])
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
    trainer.fit()
    assert trainer.ctx.tokenizer is trainer.ctx.state["torch"].tokenizer
    rows = samples.read_step(trainer.ctx.run_dir / "samples" / "1.jsonl")
    assert len(rows) == 2 and all(row["text"] for row in rows)
    for row in rows:
        assert row["prompt"].startswith("<|user|> guess a number ") and row["prompt"].endswith("<|assistant|>")
        assert row["response"] and row["response_length"] >= row["trained_tokens"] > 0
