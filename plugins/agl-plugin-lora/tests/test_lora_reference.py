"""The reference policy under LoRA is the base model: the adapted actor with its adapter disabled.

Compared with a separately loaded copy of the base model to 1e-5, before and
after PPO updates of the adapter.
"""

from __future__ import annotations

import torch

from agl_core.builtin.estimators import vanilla_policy_loss

from agl_plugin_torch import modeling, training

from agl_plugin_lora.embedded import reference_logprobs
from agl_plugin_lora.settings import LoraSettings
from agl_plugin_torch.testing import sampled_rows
from lora_testkit import adapted_backend, algorithm


def base_copy(backend):
    """The base model loaded again from the run's initial weights: no adapter, no shared tensors."""
    return modeling.load(backend.source, backend.config.model)[0]


def train(backend, batch, steps=3):
    """PPO updates of the actor on ``batch``, advantages rising with the row (some signal to learn)."""
    for _ in range(steps):
        batch["old_log_probs"] = backend.logprobs(backend.actor, batch, with_entropy=False)[0]
        batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(1).expand_as(batch["responses"]).clone()
        training.update_actor(backend.actor, backend.actor_optim, backend.actor_sched, batch, algorithm(),
                              vanilla_policy_loss, backend.config.actor)


def test_reference_logprobs_equal_a_separate_base_model_before_and_after_training(backend):
    check_reference_through_training(backend)


def test_trained_copies_of_modules_to_save_are_off_for_the_reference(tmp_path):
    made = adapted_backend(tmp_path, LoraSettings(rank=4, alpha=8, modules_to_save=["norm"]))
    copies = [name for name, p in made.actor.named_parameters() if p.requires_grad and "lora_" not in name]
    assert len(copies) == 5 and all(".modules_to_save.default." in name for name in copies)  # 2 per layer + final
    check_reference_through_training(made)


def check_reference_through_training(backend):
    """Reference log-probs equal a separately loaded base model's to 1e-5, before and after PPO updates."""
    base = base_copy(backend)
    batch = sampled_rows(backend)
    expected = backend.logprobs(base, batch, with_entropy=False)[0]
    before_actor = backend.logprobs(backend.actor, batch, with_entropy=False)[0]
    torch.testing.assert_close(reference_logprobs(backend, batch), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(before_actor, expected, rtol=0, atol=1e-5)  # a fresh adapter is the identity (B = 0)

    train(backend, batch)

    after_actor = backend.logprobs(backend.actor, batch, with_entropy=False)[0]
    assert (after_actor - expected).abs().max() > 1e-2  # the adapter learned something
    torch.testing.assert_close(reference_logprobs(backend, batch), expected, rtol=0, atol=1e-5)
    # The adapter is back on after the reference pass.
    torch.testing.assert_close(backend.logprobs(backend.actor, batch, with_entropy=False)[0], after_actor)


def test_only_the_adapter_trains(backend):
    """The backend's optimizer is made after the transform: over the adapter only, never over every weight."""
    before = {name: p.detach().clone() for name, p in backend.actor.named_parameters()}
    optimized = {id(p) for group in backend.actor_optim.param_groups for p in group["params"]}
    adapter = {id(p) for name, p in backend.actor.named_parameters() if "lora_" in name}
    assert optimized == adapter and adapter

    train(backend, sampled_rows(backend), steps=1)

    for name, param in backend.actor.named_parameters():
        assert torch.equal(param, before[name]) != ("lora_" in name), name


def test_target_modules_choose_the_adapted_layers(tmp_path):
    made = adapted_backend(tmp_path, LoraSettings(rank=2, target_modules=["q_proj", "v_proj"]))
    adapted = {name.split(".")[-4] for name, _ in made.actor.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "v_proj"}
    assert sum(p.requires_grad for p in made.actor.parameters()) == 2 * 2 * 2  # layers x modules x (A, B)


def test_an_adapted_actor_trains_in_an_update_process_as_in_the_trainers_and_its_reference_stays_the_base(tmp_path):
    """Asynchronous training on a CPU updates in a process of its own (agl_plugin_torch.update_process): the adapted
    actor is sent there whole, and the adapter's updates there are those made here, in the trainer's own tensors."""
    settings = LoraSettings(rank=4, alpha=8)
    here, there = adapted_backend(tmp_path / "a", settings), adapted_backend(tmp_path / "b", settings)
    there.actor.load_state_dict(here.actor.state_dict())  # the same adapter (its A is drawn at random)
    batch = sampled_rows(here)
    batch["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(1).expand_as(batch["responses"]).clone()
    expected = reference_logprobs(here, batch)
    there.train_in_a_process()
    try:
        for _ in range(2):
            assert (here.run("update_actor", batch, algorithm(), vanilla_policy_loss)
                    == there.run("update_actor", batch, algorithm(), vanilla_policy_loss))
        for (name, mine), theirs in zip(here.actor.named_parameters(), there.actor.parameters()):
            assert torch.equal(mine, theirs), name
        torch.testing.assert_close(reference_logprobs(there, batch), expected, rtol=0, atol=1e-5)
    finally:
        there.stop_serving()
