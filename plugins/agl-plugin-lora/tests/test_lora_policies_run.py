"""Whole runs with several policies: the real loop, runner, gateway (real HTTP), endpoint, checkpoints and ``agl``.

Three roles on one tiny llama built from a config: ``planner`` and ``solver``
each a LoRA adapter, ``critic`` the base model; the agent
(``lora_test_agents:two_roles``) reaches them by role and by model name.
"""

from __future__ import annotations

import json

import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agl_core.config import load
from agl_core.loop import Trainer

from agl_plugin_lora.policies import adapter_name_of
from agl_plugin_torch.testing import sampled_rows
from lora_testkit import tiny_section
from test_lora_run import TASKS, agl

PLUGINS = ["torch", "traces", "lora"]


def recipe_file(tmp_path, **trainer) -> str:
    recipe = {
        "data": {"train_batch_size": 2, "max_prompt_length": 24, "max_response_length": 8},
        "algorithm": {"estimator": "grpo", "ppo_mini_batch_size": 4, "ppo_epochs": 1,
                      "policy_loss": {"use_kl_loss": True, "kl_loss_coef": 0.1}},
        "rollout": {"n": 2, "timeout_s": 30, "agent": "lora_test_agents:two_roles", "n_workers": 4},
        "trainer": {"run_dir": str(tmp_path / "run"), "total_steps": 2, "save_freq": 2, "val_before_train": False,
                    "progress": False, "resume": "never", **trainer},
        "policies": {"planner": {"adapter": {"rank": 2}}, "solver": {"lr": 0.02}, "critic": {"base": True}},
        "plugins": {"torch": tiny_section(), "traces": {"aggregator": "transition"}, "lora": {"rank": 4, "alpha": 8},
                    "slots": {"compute_ref_logprob": "lora"}},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return str(path)


def adapters(backend) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in backend.actor.named_parameters() if adapter_name_of(n)}


def test_a_run_of_three_roles_trains_each_adapter_on_its_rows_and_exports_each(tmp_path):
    path = recipe_file(tmp_path)
    trainer = Trainer(*load(path, [], PLUGINS), train_tasks=TASKS, val_tasks=[])
    backend = trainer.ctx.state.get("torch")
    metrics = trainer.fit()
    backend = trainer.ctx.state["torch"]
    for policy in ("planner", "solver"):  # per-policy metrics of the last step
        for key in ("rows", "tokens", "reward/mean", "advantages/mean", "kl", "entropy", "pg_loss", "kl_loss"):
            assert f"policy/{policy}/{key}" in metrics, (policy, key)
        assert metrics[f"policy/{policy}/rows"] == 4  # 2 tasks x 2 samples, one call each
    assert not any(key.startswith("policy/critic/") for key in metrics)  # the base model makes no rows
    # The endpoint served each row through its own adapter: the trainer recomputes the log-probs it reported.
    assert metrics["training/rollout_logprob_diff/max"] < 1e-4
    checkpoint = trainer.ctx.run_dir / "checkpoints/global_step_2"
    assert sorted(p.name for p in (checkpoint / "policies").iterdir()) == ["planner", "solver"]
    trained = adapters(backend)

    # Resume: every adapter and optimizer restored, then a step more.
    again = Trainer(*load(path, ["trainer.total_steps=3", "trainer.resume=auto"], PLUGINS), train_tasks=TASKS,
                    val_tasks=[])
    again.load(checkpoint)
    resumed = again.ctx.state["torch"]
    for name, value in adapters(resumed).items():
        assert torch.equal(value, trained[name]), name
    for policy in ("planner", "solver"):
        assert resumed.policy_optims.optims[policy][0].state  # AdamW's moments came back
    again.fit()

    # agl export: every adapter as a PEFT directory; one merged.
    out = tmp_path / "adapters"
    done = agl("export", checkpoint, "--out", out)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "planner" / "adapter_config.json").read_text())["r"] == 2
    merged_out = tmp_path / "solver_merged"
    done = agl("export", checkpoint, "--merged", merged_out, "--policy", "solver")
    assert done.returncode == 0, done.stderr
    merged = AutoModelForCausalLM.from_pretrained(merged_out, local_files_only=True)
    batch = sampled_rows(backend)
    planner = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(backend.source), out / "planner")
    with torch.no_grad():
        expected_solver = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=["solver"] * len(batch))[0]
        expected_planner = backend.logprobs(backend.actor, batch, with_entropy=False,
                                            adapters=["planner"] * len(batch))[0]
    torch.testing.assert_close(backend.logprobs(merged, batch, with_entropy=False)[0], expected_solver, rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(backend.logprobs(planner, batch, with_entropy=False)[0], expected_planner, rtol=0,
                               atol=1e-5)
    refused = agl("export", checkpoint, "--merged", tmp_path / "x", "--policy", "judge")
    assert refused.returncode != 0 and "the run's policies are critic, planner, solver" in refused.stderr
    refused = agl("export", checkpoint, "--merged", tmp_path / "y")
    assert refused.returncode != 0 and "name the one to merge with --policy" in refused.stderr


def test_agent_match_trains_only_the_selected_role(tmp_path):
    path = recipe_file(tmp_path, agent_match=["planner"])
    trainer = Trainer(*load(path, [], PLUGINS), train_tasks=TASKS, val_tasks=[])
    trainer.ctx.config.trainer.save_freq = 0
    metrics = trainer.fit()
    actor = trainer.ctx.state["torch"].actor
    # A fresh adapter's B matrices are zero (it starts as the identity): only an update moves them.
    moved = {adapter_name_of(n) for n, p in actor.named_parameters() if ".lora_B." in n and p.abs().sum() > 0}
    assert moved == {"planner"}  # the solver's calls were served and recorded, never trained
    assert "policy/planner/rows" in metrics and "policy/solver/rows" not in metrics
    assert list(trainer.ctx.state["torch"].policy_optims.optims) == ["planner"]


def test_agl_eval_serves_every_adapter_of_a_checkpoint_as_the_run_validated_it(tmp_path, monkeypatch):
    """``agl eval --checkpoint`` of a run of several policies restores every adapter into the recipe's model (as
    a resume does) and serves each role through its own: the greedy games of examples/two_roles give what the
    run's validation of that step gave, which the untrained adapters do not."""
    from pathlib import Path

    from agl_core.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[3])  # the example's paths are relative to the repository
    run_dir = tmp_path / "run"
    assert main(["train", "examples/two_roles/recipe.yaml", f"trainer.run_dir={run_dir}", "trainer.total_steps=5",
                 "trainer.test_freq=5", "trainer.save_freq=5", "trainer.progress=false"]) == 0
    validation = {m["step"]: m["val/reward/mean"] for m in map(json.loads, (run_dir / "metrics.jsonl").open())
                  if "val/reward/mean" in m}
    assert validation[5] != validation[0]  # five steps moved the pair: the check below tells the two apart
    out = tmp_path / "eval.jsonl"
    assert main(["eval", "examples/two_roles/recipe.yaml", "--checkpoint", str(run_dir), "-o", str(out)]) == 0
    summary = json.loads((tmp_path / "eval.summary.json").read_text())
    assert summary["n_rollouts"] == 5 and summary["n_failed"] == 0
    assert summary["reward_mean"] == validation[5]
