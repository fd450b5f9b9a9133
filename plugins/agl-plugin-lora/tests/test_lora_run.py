"""Whole runs of the embedded backend with LoRA: the real loop, runner, gateway, endpoint and checkpoints.

Covered: a run with a KL loss takes its reference from the plugin and saves
adapters in its checkpoints; it resumes from them, also with the plugin
registered after the backend (an extra, not installed, plugin); ``agl
export`` merges a checkpoint into a plain model that computes what the
adapted actor computes; with two candidates for the reference slot the
recipe must choose.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from agl_core.config import load
from agl_core.data import Task
from agl_core.loop import Trainer
from agl_core.plugins import PluginError

from agl_plugin_torch.backend import ACTOR_DIR

from agl_plugin_lora import plugin as lora_plugin
from agl_plugin_torch.testing import sampled_rows
from lora_testkit import tiny_section

TASKS = [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(4)]
PLUGINS = ["torch", "traces", "lora"]


def recipe_file(tmp_path, slots=True) -> str:
    recipe = {
        "data": {"train_batch_size": 2, "max_prompt_length": 24, "max_response_length": 24},
        "algorithm": {"estimator": "grpo", "ppo_mini_batch_size": 4, "ppo_epochs": 2,
                      "policy_loss": {"use_kl_loss": True, "kl_loss_coef": 0.1}},
        "rollout": {"n": 2, "timeout_s": 30, "agent": "lora_test_agents:say_five", "n_workers": 4},
        "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 2, "save_freq": 2, "val_before_train": False,
                    "progress": False, "resume": "never"},
        "plugins": {"torch": tiny_section(), "traces": {"aggregator": "trajectory"},
                    "lora": {"rank": 4, "alpha": 8}},
    }
    if slots:
        recipe["plugins"]["slots"] = {"compute_ref_logprob": "lora"}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def run(path, overrides=(), lora_extra=False) -> tuple[Trainer, dict[str, float]]:
    """A run of the recipe; ``lora_extra``: the lora plugin passed as an extra object, registered after torch."""
    if lora_extra:
        recipe, pset = load(path, list(overrides), ["torch", "traces"], extra_plugins=[("lora", lora_plugin)])
    else:
        recipe, pset = load(path, list(overrides), PLUGINS)
    trainer = Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
    return trainer, trainer.fit()


def agl(*args) -> subprocess.CompletedProcess:
    """The installed ``agl`` command, as a user runs it."""
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})


def test_lora_run_trains_the_adapter_resumes_with_lora_after_torch_and_exports_merged(tmp_path):
    path = recipe_file(tmp_path)
    first, metrics = run(path)
    hooks = [name for name, _ in first.ctx.plugins.implementations("load_checkpoint")]
    assert hooks.index("lora") < hooks.index("torch")  # installed plugins register by name
    assert first.ctx.slots["compute_ref_logprob"][0] == "lora"
    assert metrics["actor/kl_loss"] >= 0
    # The endpoint served the adapted actor: the trainer recomputes the log-probs it reported.
    assert metrics["training/rollout_logprob_diff/max"] < 1e-4
    checkpoint = first.ctx.run_dir / "checkpoints/global_step_2"
    saved = {f.name for f in (checkpoint / ACTOR_DIR).iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= saved and "model.safetensors" not in saved
    trained = {name: p.detach().clone() for name, p in first.ctx.state["torch"].actor.named_parameters()}

    # Resumed with lora registered after torch: torch's load_checkpoint runs first and still finds the adapter.
    resumed_trainer = Trainer(*load(path, ["trainer.total_steps=3", "trainer.resume=auto"], ["torch", "traces"],
                                    extra_plugins=[("lora", lora_plugin)]), train_tasks=TASKS, val_tasks=[])
    hooks = [name for name, _ in resumed_trainer.ctx.plugins.implementations("load_checkpoint")]
    assert hooks.index("torch") < hooks.index("lora")
    resumed_trainer.load(checkpoint)
    backend = resumed_trainer.ctx.state["torch"]
    for name, param in backend.actor.named_parameters():  # the checkpoint's adapter, loaded into the adapted actor
        assert torch.equal(param, trained[name]), name
    optimized = {id(p) for group in backend.actor_optim.param_groups for p in group["params"]}
    assert optimized == {id(p) for name, p in backend.actor.named_parameters() if "lora_" in name}
    resumed_trainer.fit()  # loads the checkpoint again (resume=auto), then step 3
    resumed = resumed_trainer
    backend = resumed.ctx.state["torch"]
    assert backend.weight_version == 3
    base = AutoModelForCausalLM.from_pretrained(backend.source, local_files_only=True).state_dict()
    for name, value in backend.actor.state_dict().items():
        if "lora_" not in name:  # the base weights never moved, through training and resuming
            assert torch.equal(value, base[name.replace(".base_layer", "")]), name

    out = tmp_path / "merged"
    exported = agl("export", resumed.ctx.run_dir, "--merged", out)
    assert exported.returncode == 0, exported.stderr
    assert "by plugin lora" in exported.stdout and "global_step_3" in exported.stdout
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not any("lora" in name for name in merged.state_dict())
    # The latest checkpoint is step 3's (the end of the run): the weights the actor has now.
    batch = sampled_rows(backend)
    torch.testing.assert_close(backend.logprobs(merged, batch, with_entropy=False)[0],
                               backend.logprobs(backend.actor, batch, with_entropy=False)[0], rtol=0, atol=1e-5)

    adapter_only = agl("export", resumed.ctx.run_dir / "checkpoints/global_step_2", "--out", tmp_path / "adapter")
    assert adapter_only.returncode == 0, adapter_only.stderr
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()
    assert not (tmp_path / "adapter" / "model.safetensors").exists()


def test_two_reference_candidates_need_the_recipe_to_choose(tmp_path):
    recipe, pset = load(recipe_file(tmp_path, slots=False), [], PLUGINS)
    with pytest.raises(PluginError, match=r"compute_ref_logprob.*lora, torch.*plugins.slots.compute_ref_logprob"):
        Trainer(recipe, pset, train_tasks=TASKS, val_tasks=[])
