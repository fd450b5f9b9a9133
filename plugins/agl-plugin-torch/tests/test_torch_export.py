"""``agl export`` of a fully fine-tuned run, and the actor transform point of the backend.

Covered: the command, run as a user runs it on a real run directory, writes
the checkpoint's actor as a plain model; with no plugin able to export, the
error names the run directory; the transforms other plugins register are
applied by ``create`` before the optimizer is made, in their stated order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml
from transformers import AutoModelForCausalLM

from agl_core.components import Component, Components
from agl_core.config import load
from agl_core.data import Task
from agl_core.loop import Trainer

from agl_plugin_torch.backend import create
from agl_plugin_torch.plugin import actor_transforms
from agl_plugin_torch.settings import TorchConfig
from agl_plugin_torch.testing import tiny_section

TASKS = [Task(id=f"t{i}", input={"text": f"guess a number {i}"}) for i in range(2)]


def agl(*args) -> subprocess.CompletedProcess:
    exe = shutil.which("agl") or str(Path(sys.executable).with_name("agl"))
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([exe, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": path})


def test_torch_agl_export_writes_the_fine_tuned_actor(tmp_path):
    recipe = {
        "data": {"train_batch_size": 2, "max_prompt_length": 24, "max_response_length": 24},
        "algorithm": {"estimator": "grpo", "ppo_mini_batch_size": 4, "ppo_epochs": 1},
        "rollout": {"n": 2, "timeout_s": 30, "agent": "torch_test_agents:say_five", "n_workers": 4},
        "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 1, "save_freq": 1, "val_before_train": False,
                    "progress": False, "resume": "never"},
        "plugins": {"torch": tiny_section(), "traces": {"aggregator": "trajectory"}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    trainer = Trainer(*load(str(path), [], ["torch", "traces"]), train_tasks=TASKS, val_tasks=[])
    trainer.fit()
    run_dir = trainer.ctx.run_dir

    exported = agl("export", run_dir, "--merged", tmp_path / "out")
    assert exported.returncode == 0, exported.stderr
    assert "by plugin torch" in exported.stdout
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", local_files_only=True)
    for (name, a), b in zip(model.named_parameters(), trainer.ctx.state["torch"].actor.parameters()):
        assert torch.equal(a, b), name
    assert (tmp_path / "out" / "tokenizer.json").is_file()

    refused = agl("export", run_dir, "--merged", tmp_path / "out")  # not empty any more
    assert refused.returncode == 2 and "exists and is not an empty directory" in refused.stderr
    # A run of the recipe without a backend (the core's built-ins only) has no plugin that exports.
    other = tmp_path / "other"
    (other / "checkpoints/global_step_1").mkdir(parents=True)
    (other / "checkpoints/global_step_1/core_state.pt").write_bytes(b"")
    (other / "config.yaml").write_text(yaml.safe_dump({"trainer": {"run_dir": str(other)}}))
    nobody = agl("export", other, "--merged", tmp_path / "out2")
    assert nobody.returncode == 2
    assert f"no plugin of run {other} can export its checkpoint global_step_1" in nobody.stderr
    assert "installed exporters: " in nobody.stderr and "torch" in nobody.stderr
    assert "Traceback" not in nobody.stderr
    bare = agl("export", tmp_path, "--merged", tmp_path / "out3")
    assert bare.returncode == 2 and "is not a run directory" in bare.stderr


def test_torch_create_applies_actor_transforms_in_order_before_the_optimizer(tmp_path):
    seen = []

    def freeze_all_but_head(actor, ctx):
        seen.append(("freeze", ctx.tag))
        for name, param in actor.named_parameters():
            param.requires_grad_(name.startswith("model.norm"))
        return actor

    def tag(actor, ctx):
        seen.append(("tag", ctx.tag))
        actor.tagged = True
        return actor

    components = Components()
    components.add(Component("actor_transform", "b-freeze", freeze_all_but_head, "p1", {"order": 10}))
    components.add(Component("actor_transform", "a-tag", tag, "p2"))
    ctx = SimpleNamespace(components=components, tag="ctx")
    backend = create(TorchConfig.model_validate(tiny_section()), tmp_path, seed=0, with_critic=False,
                     transforms=actor_transforms(ctx))
    assert seen == [("freeze", "ctx"), ("tag", "ctx")]  # order 10 before the default 100, whatever the names
    assert backend.actor.tagged
    optimized = [p for group in backend.actor_optim.param_groups for p in group["params"]]
    assert [id(p) for p in optimized] == [id(backend.actor.model.norm.weight)]
