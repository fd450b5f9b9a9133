"""Several policies on one tiny llama (built from a config): a named adapter each, mixed batches, per-policy updates."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from agl_core.config import validate_recipe
from agl_core.builtin.estimators import vanilla_policy_loss
from agl_plugin_torch import testing
from agl_plugin_torch.backend import create
from agl_plugin_torch.per_row_lora import PACKED, packed
from agl_plugin_torch.policies import (PolicyOptimizers, adapters_per_row, adapter_parameters,
                                      peft_adapters_per_row)
from agl_plugin_torch.sampling import SamplingParams
from agl_plugin_torch.settings import TorchConfig

from agl_plugin_lora.embedded import adapt_actor, reference_logprobs
from agl_plugin_lora.policies import POLICIES_DIR, adapter_name_of, save_adapters
from agl_plugin_lora.settings import LoraSettings
from lora_testkit import algorithm, tiny_section

POLICIES = {"hinter": {"adapter": {"rank": 4}}, "guesser": {"adapter": {"rank": 2, "alpha": 4}, "lr": 0.1},
            "judge": {"base": True}, "coach": {"trainable": False}}


def multi_backend(tmp_path, agent_match=None, settings=LoraSettings(rank=4, alpha=8), policies=POLICIES):
    recipe = validate_recipe({"policies": policies, "trainer": {"agent_match": agent_match}})
    ctx = SimpleNamespace(slots={}, plugin_config=lambda name: settings, config=recipe)
    backend = create(TorchConfig.model_validate(tiny_section()), tmp_path, seed=0, with_critic=False,
                     transforms=[lambda actor: adapt_actor(actor, ctx)])
    trains = [p for p in ("hinter", "guesser") if p in policies]
    backend.policy_optims = PolicyOptimizers(backend.actor, {p: recipe.policies[p].lr for p in trains},
                                             backend.config.actor)
    return backend


def perturb(model, adapter, seed):
    """Move an adapter off the identity (B = 0 at the start), so that the policies compute different things."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in adapter_parameters(model, adapter):
            param.add_(torch.randn(param.shape, generator=generator) * 0.3)


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def backend(tmp_path):
    made = multi_backend(tmp_path)
    for seed, adapter in enumerate(["hinter", "guesser", "coach"]):
        perturb(made.actor, adapter, seed)
    yield made
    made.stop_serving()


def test_each_policy_has_its_adapter_on_one_base(backend):
    actor = backend.actor
    assert set(actor.peft_config) == {"hinter", "guesser", "coach"}  # judge is the base itself
    assert actor.peft_config["hinter"].r == 4 and actor.peft_config["guesser"].r == 2
    assert actor.peft_config["coach"].r == 4  # plugins.lora's shape where the policy sets none
    trains = {adapter_name_of(n) for n, p in actor.named_parameters() if p.requires_grad}
    assert trains == {"hinter", "guesser"}  # coach is frozen, the base weights too
    base = [n for n, p in actor.named_parameters() if adapter_name_of(n) is None]
    assert base and all(not dict(actor.named_parameters())[n].requires_grad for n in base)
    # The base weights are held once: the base linear modules are not copied per adapter.
    assert sum(p.numel() for n, p in actor.named_parameters() if adapter_name_of(n) is None) == \
        sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(backend.source).parameters())


def lora_linears(model):
    from peft.tuners.lora.layer import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


def peft_alone(backend, batch, adapter):
    """Log-probs of every row through ``adapter`` alone, computed peft's way (the reference of the kernel)."""
    with peft_adapters_per_row(backend.actor, adapter):
        return backend.logprobs(backend.actor, batch, with_entropy=False)[0]


def assert_rows_match_each_adapter_alone(backend, batch, names, mixed):
    for adapter in dict.fromkeys(names):
        rows = [i for i, name in enumerate(names) if name == adapter]
        torch.testing.assert_close(mixed[rows], peft_alone(backend, batch, adapter)[rows], atol=1e-5, rtol=0)


def test_a_mixed_batch_gives_each_row_its_adapters_logprobs(backend):
    """The engine's mixed batch (the per-row kernel; ranks 4, 2 and 4, and base rows) against each adapter alone."""
    batch = testing.sampled_rows(backend, n=8)
    names = ["hinter", "guesser", "__base__", "coach"] * 2
    mixed, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=names)
    assert_rows_match_each_adapter_alone(backend, batch, names, mixed)
    with peft_adapters_per_row(backend.actor, names):  # peft's own mixed batch agrees too
        torch.testing.assert_close(backend.logprobs(backend.actor, batch, with_entropy=False)[0], mixed,
                                   atol=1e-5, rtol=0)
    hinter, guesser = peft_alone(backend, batch, "hinter"), peft_alone(backend, batch, "guesser")
    assert (hinter - guesser).abs().max() > 1e-3  # the adapters differ: the equality above is not vacuous
    layers = lora_linears(backend.actor)
    with adapters_per_row(backend.actor, names):  # the kernel, not peft's loop, computes every adapted linear layer
        assert layers and all("forward" in vars(layer) for layer in layers)
    assert not any("forward" in vars(layer) for layer in layers)


def test_the_adapters_are_views_of_the_stacks_and_nothing_is_held_twice(backend):
    """The memory side: the kernel's stacked adapters are the adapters' own parameters, the base is untouched."""
    actor = backend.actor
    for layer in lora_linears(actor):
        held = packed(layer)
        assert held is not None and held.names == ("hinter", "guesser", "coach") and held.ranks == (4, 2, 4)
        for name in held.names:
            assert layer.lora_A[name].weight.untyped_storage().data_ptr() == held.a.untyped_storage().data_ptr()
            assert layer.lora_B[name].weight.untyped_storage().data_ptr() == held.b_t.untyped_storage().data_ptr()
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in actor.parameters()}
    for layer in lora_linears(actor):
        stacks = getattr(layer, PACKED)
        storages.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in (stacks.a, stacks.b_t)})
    assert sum(storages.values()) == sum(p.numel() * p.element_size() for p in actor.parameters())


def test_after_an_update_mixed_batches_compute_with_the_new_weights(backend):
    batch = testing.sampled_rows(backend, n=8)
    names = ["hinter", "guesser"] * 4
    before, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=names)
    batch["old_log_probs"] = peft_alone(backend, batch, "hinter")
    batch["advantages"] = torch.randn(8, batch["responses"].shape[1], generator=torch.Generator().manual_seed(1))
    backend.update_policies(batch, np.array(["hinter"] * 8, dtype=object), algorithm(), vanilla_policy_loss)
    after, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=names)
    assert_rows_match_each_adapter_alone(backend, batch, names, after)
    assert (after[0::2] - before[0::2]).abs().max() > 1e-3  # the hinter's rows moved with its update
    torch.testing.assert_close(after[1::2], before[1::2], atol=0, rtol=0)  # the guesser's did not


def test_a_parameter_rebound_off_its_stack_is_packed_again_before_it_is_served(backend):
    """Whatever replaces a parameter's tensor (a move, an assignment) is what the next mixed batch computes with."""
    batch = testing.sampled_rows(backend, n=4)
    layer = lora_linears(backend.actor)[0]
    weight = layer.lora_B["guesser"].weight
    weight.data = weight.data.clone() + 0.5  # no longer a view of the stack: the stack alone would be stale
    assert packed(layer) is None
    names = ["guesser", "hinter", "guesser", "__base__"]
    mixed, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=names)
    assert_rows_match_each_adapter_alone(backend, batch, names, mixed)
    assert packed(layer) is not None and torch.equal(layer.lora_B["guesser"].weight.detach(), weight.detach())


def test_adapters_on_different_layers_with_different_scalings_mix_in_one_batch(tmp_path):
    """A layer without a row's adapter leaves that row as the base computes it; scalings are each adapter's own."""
    policies = {"hinter": {"adapter": {"rank": 4, "alpha": 16, "target_modules": ["q_proj", "v_proj"]}},
                "guesser": {"adapter": {"rank": 2, "alpha": 1}}, "judge": {"base": True}}
    made = multi_backend(tmp_path, policies=policies)
    for seed, adapter in enumerate(["hinter", "guesser"]):
        perturb(made.actor, adapter, seed)
    batch = testing.sampled_rows(made, n=6)
    names = ["guesser", "hinter", "__base__", "hinter", "guesser", "guesser"]
    mixed, _ = made.logprobs(made.actor, batch, with_entropy=False, adapters=names)
    assert_rows_match_each_adapter_alone(made, batch, names, mixed)
    assert {packed(layer).names for layer in lora_linears(made.actor)} == {("hinter", "guesser"), ("guesser",)}


def test_copies_of_modules_to_save_run_per_row_beside_the_kernel(tmp_path):
    """lm_head's trained copies are not LoRA: each row runs its own copy, peft's way, in the same forward."""
    made = multi_backend(tmp_path, settings=LoraSettings(rank=4, alpha=8, modules_to_save=["lm_head"]))
    for seed, adapter in enumerate(["hinter", "guesser", "coach"]):
        perturb(made.actor, adapter, seed)
    batch = testing.sampled_rows(made, n=6)
    names = ["coach", "hinter", "__base__", "guesser", "hinter", "coach"]
    mixed, _ = made.logprobs(made.actor, batch, with_entropy=False, adapters=names)
    assert_rows_match_each_adapter_alone(made, batch, names, mixed)


def test_the_base_policy_and_the_reference_are_the_actor_with_adapters_off(backend, tmp_path):
    batch = testing.sampled_rows(backend, n=4)
    base, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=["__base__"] * 4)
    reference = reference_logprobs(backend, batch)
    plain = AutoModelForCausalLM.from_pretrained(backend.source)
    expected, _ = backend.logprobs(plain, batch, with_entropy=False)
    torch.testing.assert_close(base, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=0)
    trains = {adapter_name_of(n) for n, p in backend.actor.named_parameters() if p.requires_grad}
    assert trains == {"hinter", "guesser"}  # peft's enable_adapters would have left only the active one


def test_generation_in_one_batch_matches_each_adapter_alone(backend):
    prompt = testing.prompt(backend, "guess a number")
    params = [SamplingParams(max_tokens=5, temperature=0.0)] * 3
    with adapters_per_row(backend.actor, ["hinter", "guesser", "__base__"]):
        mixed = testing.sample(backend, [prompt] * 3, params)
    for row, adapter in enumerate(["hinter", "guesser", "__base__"]):
        with peft_adapters_per_row(backend.actor, adapter):
            (alone,) = testing.sample(backend, [prompt], params[:1])
        assert mixed[row].token_ids == alone.token_ids
        np.testing.assert_allclose(mixed[row].logprobs, alone.logprobs, atol=1e-5)


def test_an_update_moves_only_its_policys_adapter(backend):
    batch = testing.sampled_rows(backend, n=16)
    policies = np.array(["hinter"] * 8 + ["judge"] * 8, dtype=object)
    batch["old_log_probs"], _ = backend.logprobs(backend.actor, batch, with_entropy=False,
                                                 adapters=["hinter"] * 8 + ["__base__"] * 8)
    batch["advantages"] = torch.randn(16, batch["responses"].shape[1], generator=torch.Generator().manual_seed(1))
    before = snapshot(backend.actor)
    metrics = backend.update_policies(batch, policies, algorithm(), vanilla_policy_loss)
    after = snapshot(backend.actor)
    moved = {adapter_name_of(n) for n in before if not torch.equal(before[n], after[n])}
    assert moved == {"hinter"}  # not guesser (no rows), not coach (frozen), not the base
    assert "policy/hinter/pg_loss" in metrics and "policy/guesser/pg_loss" not in metrics
    assert backend.policy_optims.optims["guesser"][0].state == {}  # guesser's optimizer never stepped
    assert backend.policy_optims.optims["guesser"][0].param_groups[0]["lr"] == 0.1  # its own lr


def test_checkpoint_and_resume_restore_every_adapter_and_optimizer(backend, tmp_path):
    batch = testing.sampled_rows(backend, n=8)
    batch["old_log_probs"], _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=["guesser"] * 8)
    batch["advantages"] = torch.ones(8, batch["responses"].shape[1])
    backend.update_policies(batch, np.array(["guesser"] * 8, dtype=object), algorithm(), vanilla_policy_loss)
    (tmp_path / "ckpt").mkdir()
    backend.save(tmp_path / "ckpt")
    written = save_adapters(backend.actor, backend.tokenizer, tmp_path / "ckpt" / POLICIES_DIR, str(backend.source))
    assert sorted(written) == ["coach", "guesser", "hinter"]

    resumed = multi_backend(tmp_path / "again")
    resumed.load(tmp_path / "ckpt")
    ours, theirs = dict(backend.actor.named_parameters()), dict(resumed.actor.named_parameters())
    for name, param in ours.items():
        if param.requires_grad:
            torch.testing.assert_close(theirs[name], param, atol=0, rtol=0)
    state = resumed.policy_optims.optims["guesser"][0].state_dict()["state"]
    assert state and all("exp_avg" in s for s in state.values())

    # Each adapter is a PEFT directory: peft loads it over the base and computes the adapter's log-probs.
    config = json.loads((written["guesser"] / "adapter_config.json").read_text())
    assert config["r"] == 2 and config["base_model_name_or_path"] == str(backend.source)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(backend.source), written["guesser"])
    expected, _ = backend.logprobs(backend.actor, batch, with_entropy=False, adapters=["guesser"] * 8)
    got, _ = backend.logprobs(loaded, batch, with_entropy=False)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_the_endpoint_routes_each_request_to_its_policy_and_refuses_unknown_names(backend):
    """Real HTTP on 127.0.0.1, the endpoint in a process of its own (the CPU default), the openai client."""
    import openai

    backend.start_serving("policy")
    client = openai.OpenAI(base_url=backend.url, api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["hinter", "guesser", "judge", "coach"]
    prompt = [{"role": "user", "content": "guess a number"}]
    answers = {}
    for policy, adapter in (("hinter", "hinter"), ("guesser", "guesser"), ("judge", "__base__")):
        reply = client.chat.completions.create(model=policy, messages=prompt, max_tokens=4, temperature=0.0,
                                               logprobs=True)
        ids = testing.prompt(backend, "guess a number")
        with peft_adapters_per_row(backend.actor, adapter):
            (alone,) = testing.sample(backend, [ids], [SamplingParams(max_tokens=4, temperature=0.0)])
        assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(alone.logprobs, abs=1e-5)
        answers[policy] = reply.choices[0].message.content
    stream = client.chat.completions.create(model="hinter", messages=prompt, max_tokens=4, temperature=0.0,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answers["hinter"]
    with pytest.raises(openai.NotFoundError, match="names no policy of this endpoint; the policies are hinter, "
                                                   "guesser, judge, coach"):
        client.chat.completions.create(model="gpt-4o", messages=prompt, max_tokens=2)


def test_the_endpoints_process_serves_each_update_of_the_adapters(backend):
    """Real HTTP, the endpoint in a process of its own on the shared weights: after an update, the served
    log-probs are the new adapter's, so the process computes with the stacks the optimizer wrote into."""
    import openai

    backend.start_serving("policy")
    client = openai.OpenAI(base_url=backend.url, api_key="unused", max_retries=0)
    prompt, ids = [{"role": "user", "content": "guess a number"}], testing.prompt(backend, "guess a number")

    def served(policy):
        reply = client.chat.completions.create(model=policy, messages=prompt, max_tokens=4, temperature=0.0,
                                               logprobs=True)
        return [t.logprob for t in reply.choices[0].logprobs.content]

    def alone(adapter):
        with peft_adapters_per_row(backend.actor, adapter):
            (sample,) = testing.sample(backend, [ids], [SamplingParams(max_tokens=4, temperature=0.0)])
        return sample.logprobs

    before = served("hinter")
    assert before == pytest.approx(alone("hinter"), abs=1e-5)
    batch = testing.sampled_rows(backend, n=8)
    batch["old_log_probs"] = peft_alone(backend, batch, "hinter")
    batch["advantages"] = torch.randn(8, batch["responses"].shape[1], generator=torch.Generator().manual_seed(1))
    backend.update_policies(batch, np.array(["hinter"] * 8, dtype=object), algorithm(), vanilla_policy_loss)
    backend.set_weight_version(1)
    after = served("hinter")
    assert after == pytest.approx(alone("hinter"), abs=1e-5)
    assert max(abs(a - b) for a, b in zip(after, before)) > 1e-4  # the update changed what is served
    assert served("guesser") == pytest.approx(alone("guesser"), abs=1e-5)
