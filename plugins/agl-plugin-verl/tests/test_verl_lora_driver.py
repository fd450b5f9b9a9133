"""LoRA on verl's CPU workers through agl-plugin-lora: the real driver, a tiny model, a KL loss, a few steps.

The recipe is ``plugins: [verl, lora]`` with ``plugins.lora`` keys only (no
verl LoRA key): agl-plugin-verl translates them, verl's actor worker wraps
its model with verl's peft adapter (the CPU engine uses verl's own
builder), and the reference slot is the lora plugin's, which calls verl's
actor worker group with the adapter disabled. No reference worker group is
built. The reference log-probs equal a separately loaded base model's, before
and after the adapter trained; a checkpoint holds the adapter and resumes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from agl_core import HOOK_API_VERSION, hookimpl
from agl_core.data import Batch

from verl_testkit import TOKENS, BanditRollouts, first_and_resumed, train_bandit

pytest.importorskip("agl_plugin_lora")
ray = pytest.importorskip("ray")

PROMPT = [3, 4, 5]
RESPONSES = [[TOKENS[0], TOKENS[2], TOKENS[4]], [TOKENS[1], TOKENS[3], TOKENS[2]]]


def probe_batch() -> Batch:
    """Two rows (one per worker) with different responses."""
    prompts = torch.tensor([PROMPT] * len(RESPONSES))
    responses = torch.tensor(RESPONSES)
    mask = torch.ones(len(RESPONSES), len(PROMPT) + responses.shape[1], dtype=torch.long)
    return Batch(tensors={"prompts": prompts, "responses": responses,
                          "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
                          "position_ids": mask.cumsum(-1) - 1, "response_mask": torch.ones_like(responses)})


def base_logprobs(model_dir, weights: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """The response log-probs of :func:`probe_batch` under the base model, loaded apart in this process (with
    ``weights`` loaded over it when given: the weights a rollout server would serve)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if weights is not None:
        missing, unexpected = model.load_state_dict(weights, strict=False)
        assert not unexpected and all("lm_head" in key for key in missing), (missing, unexpected)  # lm_head: tied
    batch = probe_batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    width = batch["responses"].shape[1]
    logits = logits[:, len(PROMPT) - 1:len(PROMPT) - 1 + width]
    return torch.log_softmax(logits, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


class ReferenceProbe:
    """At the start and end of each step: the reference slot's log-probs (the lora plugin's) and the actor's."""

    AGL_HOOK_API = HOOK_API_VERSION

    def __init__(self):
        self.records: list[tuple[int, str, torch.Tensor, torch.Tensor]] = []
        self.groups = None
        self.synced: dict[int, dict[str, torch.Tensor]] = {}  # step -> the weights rank 0 would sync at its end

    def measure(self, ctx, step: int, when: str) -> None:
        from agl_plugin_verl import calls
        from agl_plugin_verl.plugin import run_of

        run = run_of(ctx)
        self.groups = run.groups
        reference = ctx.call("compute_ref_logprob", batch=probe_batch())["ref_log_prob"]
        actor, _, _ = calls.compute_log_prob(run.groups.actor, probe_batch(), 1.0, calculate_entropy=False)
        self.records.append((step, when, reference, actor))

    @hookimpl
    def on_step_start(self, ctx, step):
        self.measure(ctx, step, "start")

    @hookimpl
    def on_step_end(self, ctx, step, metrics):
        self.measure(ctx, step, "end")
        self.synced[step] = self.groups.actor.synced_weights()[0]


def train(run_dir, model_dir, total_steps: int, resume: str):
    bandit, probe = BanditRollouts(), ReferenceProbe()
    trainer = train_bandit(run_dir, model_dir, total_steps, resume, [
        "algorithm.estimator=grpo", "algorithm.policy_loss.kl_loss_coef=0.1",
        "plugins.lora.rank=4", "plugins.lora.alpha=8", "plugins.slots.compute_ref_logprob=lora",
    ], [("bandit", bandit), ("reference_probe", probe)])
    return bandit, probe, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("verl_lora_driver")
    model_dir, first, resumed = first_and_resumed(root, train)
    return root, model_dir, first, resumed


def test_the_reference_slot_is_loras_and_verl_builds_no_reference_model(runs):
    _, _, (bandit, probe, trainer), _ = runs
    assert trainer.ctx.slots["compute_ref_logprob"][0] == "lora"
    assert probe.groups.ref is None  # no reference worker group: only the actor's processes
    assert probe.groups.layout.ref_in_actor and probe.groups.layout.ref_role is None
    steps = dict(bandit.records["metrics"])
    assert sorted(steps) == [1, 2]
    for metrics in steps.values():
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "timing_s/ref", "timing_s/update_actor"):
            assert np.isfinite(metrics[key]), key
    assert steps[2]["actor/kl_loss"] > 0  # the adapter moved the actor away from its reference


def test_reference_logprobs_are_the_base_models_before_and_after_training(runs):
    _, model_dir, (_, probe, _), (_, resumed, _) = runs
    base = base_logprobs(model_dir)
    records = probe.records + resumed.records
    assert len(records) == 6
    for step, when, reference, _ in records:
        torch.testing.assert_close(reference, base, atol=1e-5, rtol=0, msg=f"step {step} {when}")
    (_, _, _, fresh), *_ = probe.records
    torch.testing.assert_close(fresh, base, atol=1e-5, rtol=0)  # a fresh adapter is the identity (B = 0)
    *_, (_, _, _, trained) = records
    assert (trained - base).abs().max() > 1e-3  # while the actor itself has moved


def test_the_checkpoint_holds_the_adapter_and_resumes_it(runs):
    root, _, (_, first, _), (_, resumed, trainer) = runs
    actor_dir = root / "run" / "checkpoints" / "global_step_2" / "verl" / "actor"
    state = torch.load(actor_dir / "model_world_size_2_rank_0.pt", weights_only=False)
    assert any("lora_A" in key for key in state) and any("lora_B" in key for key in state)
    assert json.loads((actor_dir / "lora_train_meta.json").read_text())["r"] == 4
    assert trainer.ctx.step == 3
    (saved,) = [actor for step, when, _, actor in first.records if (step, when) == (2, "end")]
    (restored,) = [actor for step, when, _, actor in resumed.records if (step, when) == (3, "start")]
    torch.testing.assert_close(restored, saved, atol=1e-6, rtol=0)  # the resumed actor holds the saved adapter


def test_the_rollout_servers_would_serve_the_trained_adapter_merged(runs):
    """What verl syncs to its vLLM servers (model.lora.merge, which the plugin sets) scores the probe as the actor
    does, not as the base model: agents' calls, which do not name the adapter, are served by the trained policy."""
    _, model_dir, (_, probe, _), _ = runs
    actor = {step: logprobs for step, when, _, logprobs in probe.records if when == "end"}
    base = base_logprobs(model_dir)
    for step, weights in probe.synced.items():
        assert not any("lora" in name for name in weights)  # plain Hugging Face names: a vLLM weight update
        served = base_logprobs(model_dir, weights)
        torch.testing.assert_close(served, actor[step], atol=1e-5, rtol=0, msg=f"step {step}")
    assert (served - base).abs().max() > 1e-3  # the trained adapter, not the base model
